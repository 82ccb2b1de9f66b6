"""Paged base weights: the frozen 4-bit weights of a decoder layer wait on the next tier.

Each decoder block (:func:`tightfit.model.blocks.find_blocks`) holds its linears' packed NF4
codes (``Params4bit``) and their quantization state (``absmax``; with double quantization the
second level's ``absmax``). :func:`enable_paged_base` keeps the last ``resident_layers``
blocks' weights on the device and gives every other block's storages a *home* on the next
tier — pinned host memory for a CUDA device, a spill file for the CPU (where device and host
are one memory, so the disk is what frees RAM) — then frees their device memory. Hooks bring a
block's bytes back through the tiers' copy engine (:mod:`tightfit.tiers.copy`) when the block
runs and one block ahead of it, in forward, in the recompute of a checkpointed segment and in
backward, and free them again when the step moves on. Nothing is written back: the weights are
frozen.

The weights stay the same tensor objects: a paged storage is resized to 0 bytes and back
(``UntypedStorage.resize_``), so every view of it — bitsandbytes' ``MatMul4Bit`` keeps one of
the weight in its autograd context and dequantizes it again in backward — sees the bytes
whenever they are back. That is why the paging follows the step exactly:

* **the order of uses** of a step is known from the installed checkpoint plan
  (:func:`tightfit.checkpoint.apply.installed`): forward ``0 … n-1``; then per segment from the
  last, a stored one backward ``b … a``, a checkpointed one recomputed ``a … b`` and then
  backward ``b … a``;
* **the hooks**: a forward pre-hook on each block (it fires in the recompute too: the replay
  calls blocks as modules), and a gradient hook on each block's output (it fires when the
  backward reaches the block, before any of its nodes run: for a stored block the weights are
  needed now, for a checkpointed segment's last block the recompute of its first follows);
* **at each hook** the block used now is made ready (its copy waited for, or loaded now), the
  next block in that order is started, and every other streamed block is freed — so at most
  two streamed blocks are on the device at once (tested at every hook). A block's bytes are
  freed only after the compute waited for their copy (on CUDA an event the compute stream
  waits on; torch's caching allocator then reuses the memory in compute order — no
  ``record_stream``), and the end of backward frees what is left.

Storages under ``min_bytes`` (the 64-byte NF4 code, the double-quant code and offset) and any
storage shared with another block or with the rest of the model stay resident; so do MoE
experts (:mod:`tightfit.qlora.experts` keeps them in buffers, not ``Params4bit``). A
``state_dict`` of the model brings nothing back to the device: a state-dict post-hook on each
block puts CPU copies read from the homes in place of its streamed entries (a save must not
hold the whole streamed base on the device; the copies alias no storage a free empties).
:func:`disable_paged_base` brings everything back and removes the hooks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tightfit.checkpoint.apply import installed
from tightfit.measure.heap import trim_heap
from tightfit.model.blocks import resolve_blocks
from tightfit.tiers.copy import CopyEngine, CudaCopyEngine
from tightfit.tiers.regions import Region, RegionPool, disk_pool, pinned_pool
from tightfit.tiers.spill import SpillArea, release_range

ResidentLayers = int | Literal["all", "auto"]
STATE_ATTR = "_tightfit_paged_base"
MIN_BYTES = 4096  # smaller storages stay resident: a copy each would cost more than they save


def check_resident_layers(value: Any, layers: int | None = None) -> ResidentLayers:
    """``value`` as a ``resident_layers`` option, or a ``ValueError`` naming the fix.

    Args:
        value: ``"all"`` (nothing pages), ``"auto"`` (``tightfit train`` lets the planner
            choose before it reads the data; :func:`tightfit.prepare` alone pages nothing) or
            the number of decoder layers whose 4-bit weights stay on the device (the others
            stream from the next tier).
        layers: The model's decoder layers, when known (an int above it is refused).
    """
    if value in ("all", "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"resident_layers must be 'all', 'auto' or a number of decoder layers (an int "
                         f">= 0), got {value!r}; e.g. resident_layers=2 (tightfit train "
                         "--resident-layers 2).")
    if value < 0:
        raise ValueError(f"resident_layers={value} is negative; pass 0 (every layer's weights "
                         "stream) up to the number of layers, or 'all'.")
    if layers is not None and value > layers:
        raise ValueError(f"resident_layers={value} is more than the model's {layers} decoder "
                         f"layers; pass at most {layers}, or 'all'.")
    return value


@dataclass
class _Piece:
    """One paged storage: its home on the next tier, and its size on the device."""

    storage: torch.UntypedStorage
    nbytes: int
    region: Region


@dataclass
class _Layer:
    index: int
    pieces: list[_Piece] = field(default_factory=list)
    loaded: bool = True
    handles: list[object] | None = None  # copies the compute has not waited for

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def _four_bit_tensors(block: nn.Module) -> list[torch.Tensor]:
    """``block``'s ``Params4bit`` weights and the tensors of their quantization state."""
    import bitsandbytes as bnb

    out: list[torch.Tensor] = []
    for module in block.modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, bnb.nn.Params4bit) or w.quant_state is None:
            continue
        qs = w.quant_state
        tensors = [w, qs.absmax, qs.code, qs.offset]
        if qs.state2 is not None:
            tensors += [qs.state2.absmax, qs.state2.code]
        out += [t for t in tensors if isinstance(t, torch.Tensor)]
    return out


def _four_bit_storages(block: nn.Module) -> list[torch.UntypedStorage]:
    """Storages of ``block``'s ``Params4bit`` weights and their quantization state."""
    return [t.untyped_storage() for t in _four_bit_tensors(block)]


def _uint8(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class PagedBase:
    """The paged 4-bit weights of a model's decoder blocks (see the module docstring).

    Attributes:
        resident_layers: Blocks whose weights stay on the device (the last ones).
        streamed_bytes: Bytes of the streamed blocks' weights, kept on the next tier.
        bytes_loaded, loads: What came back to the device so far, and in how many block loads.
        blocked_s: Seconds the compute waited for a copy.
        max_streamed_loaded: Most streamed blocks on the device at once, seen at the hooks.
        trace: ``(event, block)`` — ``"load"``, ``"wait"``, ``"free"`` — when a list is
            assigned (tests read the schedule from it).
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], resident_layers: int,
                 spill_dir: str | None = None, min_bytes: int = MIN_BYTES) -> None:
        self.model, self.blocks = model, blocks
        self.resident_layers, self._spill_dir = resident_layers, spill_dir
        self.device = next((p.device for b in blocks for p in b.parameters()),
                           torch.device("cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.layers = self._collect(min_bytes)
        self.streamed_bytes = sum(ly.nbytes for ly in self.layers)
        self.bytes_loaded = self.loads = 0
        self.blocked_s = 0.0
        self.max_streamed_loaded = 0
        self.trace: list[tuple[str, int]] | None = None
        self._backward = False  # a backward through the blocks is running
        self._uses: list[tuple[tuple[str, int], int | None]] = []
        self._at_key: dict[tuple[str, int], int] = {}
        self._handles: list[Any] = []
        self._flags: list[tuple[nn.Module, bool]] = []
        self.engine, self.pool, self.spill = self._tier()
        try:
            self._move_out()
        except BaseException:
            self._close_tier()
            raise
        self._install()

    # -- setting up ----------------------------------------------------------------------
    def _collect(self, min_bytes: int) -> list[_Layer]:
        """The streamed blocks' pieces (storages no other block or module shares)."""
        per_block = [_four_bit_storages(b) for b in self.blocks]
        owners: dict[int, int] = {}
        for i, sts in enumerate(per_block):
            for st in {s.data_ptr(): s for s in sts}.values():
                owners[st.data_ptr()] = -1 if st.data_ptr() in owners else i
        inside = {id(p) for b in self.blocks for p in (*b.parameters(), *b.buffers())}
        for t in (*self.model.parameters(), *self.model.buffers()):
            if id(t) not in inside and t.untyped_storage().data_ptr() in owners:
                owners[t.untyped_storage().data_ptr()] = -1
        streamed = len(self.blocks) - self.resident_layers
        layers = []
        for i in range(streamed):
            ly = _Layer(i)
            for st in {s.data_ptr(): s for s in per_block[i]}.values():
                if owners.get(st.data_ptr()) == i and st.nbytes() >= min_bytes:
                    ly.pieces.append(_Piece(st, st.nbytes(), None))  # type: ignore[arg-type]
            layers.append(ly)
        return layers

    def _pinned_tier(self) -> bool:
        """Whether the next tier is pinned host memory (a CUDA device) or the disk."""
        return self.device.type == "cuda"

    def _tier(self) -> tuple[CopyEngine, RegionPool, SpillArea | None]:
        grow = sum(-(-p.nbytes // 4096) * 4096 for ly in self.layers for p in ly.pieces)
        if self._pinned_tier():
            # pinned with the other pinned users, against one budget: a host that cannot
            # pin the weights says so here (TierFullError), before any step
            pool = pinned_pool(grow, None, what="paged base weights", device=self.device)
            # its own side stream: a block's prefetch must not queue behind the previous
            # block's activation offload copies ("activations")
            return CudaCopyEngine(self.device, stream_name="weights"), pool, None
        spill = SpillArea(self._spill_dir)
        return CopyEngine(), disk_pool(spill, grow, None), spill

    def _move_out(self) -> None:
        """Copy every streamed piece to its home, then free the device bytes (nothing is freed
        before every copy has landed: a full tier changes nothing)."""
        for ly in self.layers:
            for p in ly.pieces:
                p.region = self.pool.take(p.nbytes)
                p.region.view.copy_(_uint8(p.storage, self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._release_homes([p.region for ly in self.layers for p in ly.pieces])
        for ly in self.layers:
            self._free(ly)

    def _install(self) -> None:
        import bitsandbytes as bnb

        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(
                functools.partial(self._pre_forward, i)))
            self._handles.append(block.register_forward_hook(
                functools.partial(self._post_forward, i)))
            self._handles.append(block.register_state_dict_post_hook(
                functools.partial(self._state_dict, i)))
            for m in block.modules():
                if isinstance(m, bnb.nn.Linear4bit):
                    # its CPU inference path repacks the weight into new storage
                    self._flags.append((m, m.support_avx512bf16_for_cpu))
                    m.support_avx512bf16_for_cpu = False
        self._handles.append(self.model.register_forward_pre_hook(self._model_start))
        self._handles.append(self.model.register_forward_hook(self._model_done,
                                                              always_call=True))

    # -- moving bytes --------------------------------------------------------------------
    def _allocate(self, piece: _Piece) -> None:
        piece.storage.resize_(piece.nbytes)  # on the current (compute) stream

    def _deallocate(self, piece: _Piece) -> None:
        piece.storage.resize_(0)

    def _load(self, ly: _Layer) -> None:
        if ly.loaded:
            return
        handles = []
        for p in ly.pieces:
            self._allocate(p)
            handles.append(self.engine.load(p.region.view, _uint8(p.storage, self.device)))
        ly.loaded, ly.handles = True, handles
        self._release_homes([p.region for p in ly.pieces])
        self.bytes_loaded += ly.nbytes
        self.loads += 1
        self._note("load", ly.index)

    def _ready(self, ly: _Layer) -> None:
        """Block ``ly``'s weights usable by the compute (loaded now if nobody started it)."""
        self._load(ly)
        self._wait(ly)

    def _wait(self, ly: _Layer) -> None:
        handles, ly.handles = ly.handles, None
        if handles:
            t0 = time.perf_counter()
            for h in handles:
                self.engine.wait(h)
            self.blocked_s += time.perf_counter() - t0
            self._note("wait", ly.index)

    def _free(self, ly: _Layer) -> None:
        if not ly.loaded:
            return
        self._wait(ly)  # the copy is ordered before the memory goes back
        for p in ly.pieces:
            self._deallocate(p)
        ly.loaded = False
        if self.device.type == "cpu":
            trim_heap()  # glibc keeps freed heap pages mapped otherwise
        self._note("free", ly.index)

    def _release_homes(self, regions: list[Region]) -> None:
        """On the disk tier, the spill pages just written or read leave this process's RSS
        (behind the copies queued so far, on the copy thread)."""
        if self.spill is not None and regions:
            views = self.pool.covering(regions)
            self.engine.then(lambda: [release_range(v) for v in views])

    def _note(self, event: str, index: int) -> None:
        if self.trace is not None:
            self.trace.append((event, index))

    # -- the schedule --------------------------------------------------------------------
    def _plan_uses(self) -> None:
        """The step's order of block uses under the installed checkpoint plan."""
        n = len(self.blocks)
        segments = [(0, n, False)]
        found = next((s for m in self.model.modules() if (s := installed(m)) is not None), None)
        if found is not None and [id(b) for b in found[1]] == [id(b) for b in self.blocks]:
            segments = [(s.start, s.stop, s.recomputes) for s in found[0].segments]
        uses: list[tuple[tuple[str, int], int | None]] = [(("fwd", i), i) for i in range(n)]
        for start, stop, recomputed in reversed(segments):
            if recomputed:  # the backward reaches its last block, then recomputes from its first
                uses.append((("reach", stop - 1), None))
                uses += [(("rec", j), j) for j in range(start, stop)]
                uses += [(("reach", j), j) for j in range(stop - 2, start - 1, -1)]
            else:
                uses += [(("reach", j), j) for j in range(stop - 1, start - 1, -1)]
        self._uses = uses
        self._at_key = {key: k for k, (key, _) in enumerate(uses)}

    def _step_to(self, key: tuple[str, int]) -> None:
        """The step is at ``key``: its block ready, the next one started, the rest freed."""
        k = self._at_key.get(key)
        if k is None:  # an order the plan does not have (a changed plan): this block only
            now, keep = key[1], [key[1]]
        else:  # the next two blocks of the order (a "reach" of a checkpointed segment needs
            # none of them yet: its recompute comes next)
            now, keep = self._uses[k][1], []
            for _, b in self._uses[k:]:
                if b is not None and b not in keep:
                    keep.append(b)
                    if len(keep) == 2:
                        break
        for ly in self.layers:
            if ly.index not in keep:
                self._free(ly)
        for b in keep:
            if b < len(self.layers):
                (self._ready if b == now else self._load)(self.layers[b])
        loaded = sum(ly.loaded for ly in self.layers)
        self.max_streamed_loaded = max(self.max_streamed_loaded, loaded)

    def _model_start(self, _m: nn.Module, _args: tuple) -> None:
        # a new forward of the model: whatever an interrupted backward left is freed
        self._backward = False
        self._plan_uses()
        self.free_all()

    def _pre_forward(self, i: int, _m: nn.Module, _args: tuple) -> None:
        self._step_to(("rec" if self._backward else "fwd", i))

    def _post_forward(self, i: int, _m: nn.Module, _args: tuple, out: Any) -> None:
        if self._backward or not torch.is_grad_enabled():
            return
        t = next((x for x in tree_leaves(out) if isinstance(x, torch.Tensor)
                  and x.requires_grad and x.grad_fn is not None), None)
        if t is not None:
            t.register_hook(functools.partial(self._reached, i))

    def _reached(self, i: int, _grad: torch.Tensor) -> None:
        if not self._backward:
            self._backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._step_to(("reach", i))

    def _backward_done(self) -> None:
        self._backward = False
        self.free_all()

    def _model_done(self, _m: nn.Module, _args: tuple, out: Any) -> None:
        loss = getattr(out, "loss", None)
        needs_grad = any(isinstance(x, torch.Tensor) and x.requires_grad
                         for x in [loss, *tree_leaves(out)])
        if not (torch.is_grad_enabled() and needs_grad):
            self.free_all()  # evaluation: no backward follows

    def _state_dict(self, i: int, _block: nn.Module, state_dict: dict[str, Any], prefix: str,
                    _meta: Any) -> None:
        """Block ``i``'s streamed entries of a ``state_dict``: CPU copies read from their homes.

        Nothing comes back to the device (a save must not bring the whole streamed base back),
        and the dict does not alias a storage the next free empties. ``keep_vars=True``
        entries (the model's own tensors) are left as they are.
        """
        if i >= len(self.layers):
            return
        ly = self.layers[i]
        pieces = {p.storage._cdata: p for p in ly.pieces}
        live = {id(t) for t in _four_bit_tensors(self.blocks[i])}
        copies: dict[int, torch.Tensor] = {}
        for key, t in state_dict.items():
            if not (key.startswith(prefix) and isinstance(t, torch.Tensor)) or id(t) in live:
                continue
            p = pieces.get(t.untyped_storage()._cdata)
            if p is None:
                continue
            if id(p) not in copies:
                copies[id(p)] = p.region.view[:p.nbytes].clone()  # the frozen bytes
            home = copies[id(p)].untyped_storage()
            state_dict[key] = torch.empty(0, dtype=t.dtype).set_(home, t.storage_offset(),
                                                                 t.shape, t.stride())
        self._release_homes([p.region for p in ly.pieces])

    # -- public --------------------------------------------------------------------------
    def free_all(self) -> None:
        """Free every streamed block's device bytes (they wait on the next tier)."""
        for ly in self.layers:
            self._free(ly)

    def load_all(self) -> None:
        """Bring every streamed block's weights back to the device (until the next forward)."""
        for ly in self.layers:
            self._ready(ly)

    def device_bytes(self) -> int:
        """Bytes of the streamed blocks' weights on the device now."""
        return sum(p.storage.nbytes() for ly in self.layers for p in ly.pieces)

    def _close_tier(self) -> None:
        try:
            self.engine.close()
        finally:
            self.pool.close()
            if self.spill is not None:
                self.spill.close()

    def close(self) -> None:
        """Every weight back on the device, the hooks removed, the next tier freed."""
        try:
            self.load_all()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            for h in self._handles:
                h.remove()
            for m, flag in self._flags:
                m.support_avx512bf16_for_cpu = flag
            self._close_tier()


def enable_paged_base(model: nn.Module, resident_layers: ResidentLayers, *,
                      blocks: Sequence[nn.Module] | None = None, spill_dir: str | None = None,
                      min_bytes: int = MIN_BYTES) -> PagedBase | None:
    """Page the 4-bit base weights of all but the last ``resident_layers`` decoder blocks.

    Args:
        model: A prepared (4-bit) model; its blocks are found as the checkpoint planner finds
            them, or given as ``blocks``.
        resident_layers: Blocks whose weights stay on the device; ``"all"`` pages nothing,
            and so does ``"auto"`` here (``tightfit train``'s preflight turns it into the
            planner's number before it calls this).
        blocks: The decoder blocks in forward order (default: discovered).
        spill_dir: Folder of the CPU's spill file (default: the temp folder).
        min_bytes: Storages smaller than this stay resident.

    Returns:
        The :class:`PagedBase` (also ``model._tightfit_paged_base``), or ``None`` for
        ``"all"`` and ``"auto"``.

    Raises:
        ValueError: A bad ``resident_layers``, or paging already enabled on ``model``.
        tightfit.tiers.regions.TierFullError: The next tier cannot hold the weights (nothing
            was changed).
    """
    chain = resolve_blocks(model, blocks)
    resident = check_resident_layers(resident_layers, len(chain))
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("paged base weights are already enabled on this model; call "
                         "disable_paged_base(model) first to change resident_layers.")
    if resident in ("all", "auto"):  # "auto": tightfit train's planner chooses; alone, none
        return None
    pager = PagedBase(model, chain, resident, spill_dir, min_bytes)
    object.__setattr__(model, STATE_ATTR, pager)
    return pager


def paged_base_of(model: nn.Module) -> PagedBase | None:
    """The :class:`PagedBase` enabled on ``model``, if any."""
    return getattr(model, STATE_ATTR, None)


def disable_paged_base(model: nn.Module) -> None:
    """Bring every paged weight back to the device and remove the hooks (a no-op when none)."""
    pager = getattr(model, STATE_ATTR, None)
    if pager is not None:
        object.__delattr__(model, STATE_ATTR)
        pager.close()
