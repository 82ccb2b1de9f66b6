"""Argument checks of the paged optimizers' constructor and ``add_param_group``.

Each raises a ``ValueError``/``TypeError`` naming the bad value and the fix, before anything
changes (no page, no spill folder, no param group); where torch refuses the same input, with
torch's exception type and words (then the fix). Hyperparameter checks are in
:mod:`tightfit.optim.hyper`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tightfit.optim.dtensor import check_param
from tightfit.tiers.spill import check_spill_dir


def _check_bytes(name: str, value: Any, page_bytes: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes or None, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}={value} is negative; pass a byte count >= 0 or None")
    if value < page_bytes:
        raise ValueError(
            f"{name}={value} is below one page (page_bytes={page_bytes}); pass at least "
            f"{page_bytes} bytes, lower page_bytes, or pass None for no limit"
        )


def check_paging_options(
    page_bytes: Any,
    device_budget: Any,
    host_budget: Any,
    spill_dir: str | os.PathLike | None,
) -> None:
    """``page_bytes`` a positive int; the budgets ``None`` or at least one page; ``spill_dir``
    usable."""
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ValueError(f"page_bytes={page_bytes!r} must be a positive int (e.g. 4 << 20)")
    _check_bytes("device_budget", device_budget, page_bytes)
    _check_bytes("host_budget", host_budget, page_bytes)
    check_spill_dir(spill_dir)


def intake(params: Any) -> list[Any]:
    """``params`` as a list, refused as torch refuses it: a bare tensor (``TypeError``, torch's
    words) or nothing at all (``ValueError``)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}; pass [tensor] or model.parameters()"
        )
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list; pass the model's parameters")
    return params


def group_params(params: Any) -> tuple[list[Any], list[str] | None]:
    """A group's params as a list, and their names when given as ``(name, param)`` pairs
    (``named_parameters()``), as torch's ``add_param_group`` takes them."""
    if isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs; pass a list instead"
        )
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    named = [isinstance(p, tuple) for p in items]
    if not any(named):
        return items, None
    if not all(named):
        raise ValueError(
            "all optimizer params should be with/without names. Some param names are "
            "missing; pass model.named_parameters() or model.parameters(), not a mix"
        )
    return [p[1] for p in items], [p[0] for p in items]


def common_device(params: list[Any]) -> torch.device:
    """The one device of ``params`` (tensors, ``(name, tensor)`` pairs or group dicts)."""
    devices = []
    for item in params:
        ps = item["params"] if isinstance(item, dict) else [item]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        ps = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in ps]
        devices += [p.device for p in ps if isinstance(p, torch.Tensor)]
    if not devices:
        raise ValueError("optimizer got an empty parameter list; pass the model's parameters")
    found = sorted({str(d) for d in devices})
    if len(found) > 1:
        raise ValueError(
            f"params are on different devices ({', '.join(found)}); a paged optimizer pages "
            "state for one device: move the params to one device or make one optimizer each"
        )
    return devices[0]


def check_group_params(params: list[Any], device: torch.device) -> None:
    """Every param a dense floating-point (or complex) tensor on ``device`` (FSDP2 shards
    allowed; any strides: :mod:`tightfit.optim.flat` decides their element order)."""
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"optimizer can only optimize Tensors, but one of the params is "
                f"{type(p).__name__}; pass the model's parameters"
            )
        if p.device != device:
            raise ValueError(
                f"param on {p.device} but this optimizer pages state for "
                f"{device}; move it or make another optimizer for it"
            )
        check_param(p)  # FSDP2/DTensor params: the pages hold this rank's local shard
        if not (p.is_floating_point() or p.is_complex()):
            raise TypeError(f"param of dtype {p.dtype} cannot be optimized; use float params")
        if p.layout != torch.strided:
            raise TypeError(
                f"param with layout {p.layout} cannot be paged; pass dense (strided) params"
            )
