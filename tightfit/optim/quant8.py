"""Blockwise 8-bit optimizer state: bitsandbytes' dynamic maps, codes and per-block absmax.

A state array of ``n`` elements is stored as ``n`` uint8 *codes* (indices into a 256-entry
dynamic quantization map) plus one fp32 *absmax* per block of :data:`BLOCKSIZE` elements;
value ``i`` is ``map[codes[i]] * absmax[i // BLOCKSIZE]``. The maps, the block size and the
4,096-element threshold below which a param keeps 32-bit state are bitsandbytes' own, so our
states are bitsandbytes' states: its kernels update them and its state tensors load into ours.

Inside a page the codes and the absmax of the same element range sit side by side (see
:mod:`tightfit.paging.layout`), so a page moves with its scales and a block never straddles
two pages or two params.

Quantization runs bitsandbytes' kernel where it has one for the device (CUDA, XPU, and the CPU
since 0.50). Elsewhere — or when asked — :func:`quantize_torch` does it in plain torch with the
same rounding as bitsandbytes' pure-torch backend (nearest map entry, ties to the lower one)
through a 2^17-entry lookup table on the float's top bits instead of a binary search.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Literal

import torch

BLOCKSIZE = 256  # elements per absmax (bitsandbytes' 8-bit optimizers use 256)
MIN_8BIT_SIZE = 4096  # params with fewer elements keep 32-bit state, as in bitsandbytes

Backend = Literal["auto", "bitsandbytes", "torch"]


# ---------------------------------------------------------------------------- maps
# bitsandbytes is imported on first use, here and below: it loads its native libraries (CUDA
# ones where there is a GPU) when imported, which fp32 optimizers and ``import tightfit`` skip.
@functools.cache
def _map_cpu(signed: bool) -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=signed).to(torch.float32).contiguous()


_MAPS: dict[tuple[bool, str], torch.Tensor] = {}


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """bitsandbytes' 256-entry dynamic quantization map (sorted, fp32), cached per device.

    Args:
        signed: ``True`` for the signed map (first moment, momentum), ``False`` for the
            unsigned map (second moment).
        device: where the map should live.
    """
    key = (signed, str(torch.device(device)))
    m = _MAPS.get(key)
    if m is None:
        m = _MAPS[key] = _map_cpu(signed).to(device)
    return m


def blocks(numel: int) -> int:
    """Absmax values (blocks) needed for ``numel`` elements."""
    return math.ceil(numel / BLOCKSIZE)


def is_8bit(numel: int, min_8bit_size: int = MIN_8BIT_SIZE) -> bool:
    """Whether a param of ``numel`` elements gets 8-bit state (bitsandbytes' rule)."""
    return numel >= min_8bit_size


# ---------------------------------------------------------------------------- backends
def bnb_ops() -> object:
    """``torch.ops.bitsandbytes`` (importing bitsandbytes registers its ops)."""
    import bitsandbytes  # noqa: F401

    return torch.ops.bitsandbytes


@contextlib.contextmanager
def bnb_stream_order(device: torch.device) -> Iterator[None]:
    """Order bitsandbytes' kernels, launched on the legacy default stream, with torch's stream.

    bitsandbytes' CUDA ops pass no stream: ``optimizer_update_8bit_blockwise`` runs on the
    legacy default stream, while the page loads it reads were ordered on torch's current
    stream, and torch's streams are non-blocking (no implicit sync with the legacy one). So
    when the current stream is not the default one, the default stream waits for the current
    one before the kernels (the loads have landed) and the current one waits for the default
    one after them (what follows, a page going out included, sees the update). A no-op off
    CUDA and on the default stream.
    """
    if device.type != "cuda":
        yield
        return
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current == default:
        yield
        return
    default.wait_stream(current)
    try:
        yield
    finally:
        current.wait_stream(default)


def bnb_has_kernel(device: torch.device) -> bool:
    """Whether bitsandbytes has native 8-bit kernels for ``device``'s type."""
    if device.type not in ("cpu", "cuda", "xpu"):
        return False
    try:
        from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib
    except Exception:  # pragma: no cover - bitsandbytes missing or broken
        return False
    return not isinstance(lib, ErrorHandlerMockBNBNativeLibrary)


def resolve_backend(backend: Backend, device: torch.device) -> Literal["bitsandbytes", "torch"]:
    """Pick the kernel family: ``"auto"`` means bitsandbytes where it has a kernel.

    Raises:
        ValueError: unknown name, or ``"bitsandbytes"`` asked for on a device it lacks.
    """
    if backend not in ("auto", "bitsandbytes", "torch"):
        raise ValueError(
            f"backend={backend!r} is not one of 'auto', 'bitsandbytes', 'torch'; pass 'auto' "
            "to use bitsandbytes' kernels where they exist and plain torch elsewhere"
        )
    has = bnb_has_kernel(device)
    if backend == "bitsandbytes" and not has:
        raise ValueError(
            f"bitsandbytes has no 8-bit kernel for {device.type}; pass backend='torch' "
            "(or 'auto') to run the plain-torch update"
        )
    if backend == "auto":
        return "bitsandbytes" if has else "torch"
    return backend


# ---------------------------------------------------------------------------- torch path
class _NearestTable:
    """Nearest-map-entry lookup by the float's top bits: one gather and one compare.

    The key is sign + exponent + ``mbits`` mantissa bits of an fp32 value, so each key covers a
    float interval narrow enough (relative width 2^-mbits) to hold at most one decision
    boundary (midpoint between two map entries). ``base[key]`` counts the boundaries below the
    interval and ``thr[key]`` is the boundary inside it (+inf if none), so
    ``#boundaries < x = base[key] + (x > thr[key])`` — exactly ``torch.bucketize``'s answer.
    """

    def __init__(self, code: torch.Tensor, mbits: int = 8) -> None:
        code = code.detach().to("cpu", torch.float32)
        bounds = (code[:-1] + code[1:]) / 2  # the same fp32 midpoints bitsandbytes uses
        self.shift = 23 - mbits
        self.mask = (1 << (9 + mbits)) - 1
        keys = torch.arange(self.mask + 1, dtype=torch.int64)
        lo = (keys << self.shift).to(torch.int32).view(torch.float32)
        hi = ((keys << self.shift) | ((1 << self.shift) - 1)).to(torch.int32).view(torch.float32)
        fmin, fmax = torch.minimum(lo, hi), torch.maximum(lo, hi)  # negatives run backwards
        base = torch.searchsorted(bounds, fmin, right=False)  # boundaries < fmin
        inside = torch.searchsorted(bounds, fmax, right=True) - base  # boundaries in [fmin, fmax]
        nan = torch.isnan(fmin) | torch.isnan(fmax)
        if bool((inside[~nan] > 1).any()):  # pragma: no cover - not for bitsandbytes' maps
            raise ValueError("quantization map too dense for the lookup table; raise mbits")
        thr = torch.where(inside == 1, bounds[base.clamp(max=bounds.numel() - 1)], math.inf)
        base[nan], thr[nan] = 0, math.inf
        self.base = base.to(torch.uint8)
        self.thr = thr.to(torch.float32)
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._on:
            self._on[key] = (self.base.to(device), self.thr.to(device))
        return self._on[key]

    def lookup(self, x: torch.Tensor) -> torch.Tensor:
        """Codes (uint8) of values ``x`` already scaled into [-1, 1]."""
        base, thr = self.tables(x.device)
        key = (x.view(torch.int32) >> self.shift).bitwise_and_(self.mask)
        # index_select with int32 keys is several times faster than advanced indexing here
        out = torch.index_select(base, 0, key)
        out += x > torch.index_select(thr, 0, key)
        return out


@functools.cache
def _table(signed: bool) -> _NearestTable:
    return _NearestTable(_map_cpu(signed))


def _table_for(code: torch.Tensor) -> _NearestTable:
    for (signed, _device), m in _MAPS.items():  # the cached maps: no device read (no sync)
        if code is m:
            return _table(signed)
    for signed in (True, False):
        if code.numel() == 256 and torch.equal(code.cpu(), _map_cpu(signed)):
            return _table(signed)
    return _NearestTable(code)


def _scaled(values: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``values / absmax`` per block, clamped to [-1, 1], rounded as bitsandbytes' torch path."""
    n = values.numel()
    full = n - n % BLOCKSIZE
    safe = absmax.clamp(min=1e-38)
    out = torch.empty_like(values)
    if full:
        head = values[:full].view(-1, BLOCKSIZE)
        torch.mul(head, safe[: full // BLOCKSIZE].reciprocal().unsqueeze(1), out=out[:full].view_as(head))
    if full < n:
        torch.div(values[full:], safe[-1], out=out[full:])
    return out.clamp_(-1.0, 1.0)


def quantize_torch(
    values: torch.Tensor, code: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor
) -> None:
    """Quantize fp32 ``values`` into ``codes``/``absmax`` in plain torch.

    Same result as bitsandbytes' pure-torch ``quantize_blockwise`` (its backend for devices
    without a native kernel): nearest map entry, ties to the lower one.
    """
    values = values.reshape(-1).float()
    n = values.numel()
    full = n - n % BLOCKSIZE
    if full:
        torch.amax(values[:full].view(-1, BLOCKSIZE).abs(), dim=1, out=absmax[: full // BLOCKSIZE])
    if full < n:
        absmax[-1] = values[full:].abs().max().clamp(min=1e-38)  # as bitsandbytes' torch path
    codes.copy_(_table_for(code).lookup(_scaled(values, absmax)))


def dequantize_torch(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values of ``codes``/``absmax`` (``map[code] * absmax`` per block)."""
    n = codes.numel()
    vals = torch.index_select(code, 0, codes.reshape(-1).to(torch.int32))
    full = n - n % BLOCKSIZE
    if full:
        vals[:full].view(-1, BLOCKSIZE).mul_(absmax[: full // BLOCKSIZE].unsqueeze(1))
    if full < n:
        vals[full:].mul_(absmax[-1])
    if out is None:
        return vals
    return out.copy_(vals.view_as(out))


# ---------------------------------------------------------------------------- dispatch
def quantize_into(
    values: torch.Tensor,
    code: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    backend: Literal["bitsandbytes", "torch"] = "bitsandbytes",
) -> None:
    """Quantize ``values`` blockwise into the views ``codes`` (uint8) and ``absmax`` (fp32).

    Args:
        values: fp32 values, ``codes.numel()`` of them, blocks starting at element 0.
        code: the 256-entry map (:func:`dynamic_map`).
        codes: destination codes (e.g. a slice of a page).
        absmax: destination absmax, ``blocks(values.numel())`` of them.
        backend: ``"bitsandbytes"`` (its kernel) or ``"torch"`` (:func:`quantize_torch`).
    """
    if values.numel() != codes.numel() or absmax.numel() != blocks(codes.numel()):
        raise ValueError(
            f"{values.numel()} values need {values.numel()} codes and {blocks(values.numel())} "
            f"absmax, got {codes.numel()} and {absmax.numel()}; pass views of matching size"
        )
    if backend == "torch":
        quantize_torch(values, code, codes, absmax)
        return
    q, a = bnb_ops().quantize_blockwise(
        values.reshape(-1).float().contiguous(), code, BLOCKSIZE
    )
    codes.copy_(q.view_as(codes))
    absmax.copy_(a)


def dequantize(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    backend: Literal["bitsandbytes", "torch"] = "bitsandbytes",
) -> torch.Tensor:
    """fp32 values (flat) of blockwise codes and their absmax."""
    if backend == "torch":
        return dequantize_torch(codes, absmax, code)
    return bnb_ops().dequantize_blockwise(
        codes.reshape(-1), absmax, code, BLOCKSIZE, torch.float32
    )
