"""Offloaded activations: saved tensors wait on the next tier between forward and backward.

An :class:`Offloader` is a pair of ``torch.autograd.graph.saved_tensors_hooks``: *pack* starts
moving a saved tensor's storage to a region of the next tier through the tiers' copy engine
(:mod:`tightfit.tiers.copy`) and hands autograd a small handle; *unpack* waits for the bytes
to be back on the device. The next tier is pinned host memory for a CUDA device (side stream
and events) and a spill file for the CPU (a worker thread writes into the memory map, then
``msync`` + ``MADV_DONTNEED`` hand the pages back: the bytes really leave RAM). Regions come
from a :class:`~tightfit.tiers.regions.RegionPool` sized from the plan and reused every step.

The schedule, which the peak model (:mod:`tightfit.checkpoint.cost`) charges exactly, by
segment ``k`` of the plan (the tail after the chain is segment ``K``):

* forward: segment ``k``'s writes overlap segment ``k + 1``'s forward and are retired when
  segment ``k + 2`` starts (on CUDA the compute stream waits on the copy's event; on the CPU
  the host waits for the worker): then the device memory goes;
* backward: when segment ``k``'s backward starts (a gradient hook on its last block's
  output; the model's output for the tail), segment ``k - 1``'s tensors are fetched into
  fresh device memory: one segment ahead. A tensor that was not prefetched is fetched when
  unpacked.

What stays put: storages smaller than ``min_bytes``, parameters and buffers (and anything
sharing their storage), leaves that require grad, tensors a block is passed besides its
first argument (rotary tables, masks: alive for every block), and tensor subclasses. A
storage saved several times (views, the same input saved by two ops) moves once.
"""

from __future__ import annotations

import functools
import os
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from tightfit.checkpoint.plan import OffloadTier
from tightfit.tiers.copy import CopyEngine, CudaCopyEngine
from tightfit.tiers.regions import Region, RegionPool, disk_pool, measure_tier, pinned_pool
from tightfit.tiers.spill import SpillArea, release_range

_SPEED: dict[tuple[str, str, int], tuple[float, float]] = {}


def tier_of(device: torch.device) -> tuple[str, bool]:
    """The next tier of ``device`` and whether moves to it overlap with compute."""
    return ("host", True) if device.type == "cuda" else ("disk", False)


def tier_speed(device: torch.device, tier: str, offload_dir: str | None = None,
               ) -> tuple[float, float]:
    """``(bandwidth, latency)`` of one-way moves from ``device`` to ``tier``: timed round
    trips through the copy engine (:func:`~tightfit.tiers.regions.measure_tier`), measured
    once per device, tier and file system."""
    try:
        fs = os.stat(offload_dir or tempfile.gettempdir()).st_dev if tier == "disk" else 0
    except OSError:
        fs = -1
    key = (str(device), tier, fs)
    if key not in _SPEED:
        engine, pool, spill = _engine_and_pool(device, tier, offload_dir, 9 << 20, None)
        try:
            _SPEED[key] = measure_tier(engine, pool, device)
        finally:
            engine.close()
            pool.close()
            if spill is not None:
                spill.close()
    return _SPEED[key]


def _engine_and_pool(device: torch.device, tier: str, offload_dir: str | None, grow: int,
                     limit: int | None) -> tuple[CopyEngine, RegionPool, SpillArea | None]:
    if tier == "host":
        return CudaCopyEngine(device), pinned_pool(grow, limit), None
    spill = SpillArea(offload_dir)
    return CopyEngine(), disk_pool(spill, grow, limit), spill


def shared_storages(call: Any, first_block: bool = False) -> set[int]:
    """Storages of the tensors in a block call's arguments that stay alive elsewhere: all
    but the first one (the carry the chain passes on; the others — rotary tables, masks —
    are passed to every block), and the first too for the chain's first block (the model's
    forward keeps its input: HF's ``inputs_embeds``)."""
    ptrs = [t.untyped_storage().data_ptr() for t in tree_leaves(call)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    return set(ptrs) if first_block else set(ptrs) - set(ptrs[:1])


def param_storages(module: nn.Module) -> set[int]:
    """Storages of ``module``'s parameters and buffers (read at call time: FSDP swaps them)."""
    return {t.untyped_storage().data_ptr()
            for t in (*module.parameters(), *module.buffers()) if t.layout == torch.strided}


class _Item:
    """One offloaded storage: its region, the write in flight, the bytes fetched back.

    ``pending`` holds the copies whose device tensor (``src``, ``dst``) the compute has not
    yet waited for (``"put"``, ``"get"``); an item that dies with one pending (a backward
    that raised, ``autograd.grad`` of a subset, a skipped node) has the engine
    :meth:`~tightfit.tiers.copy.CopyEngine.forget` it before that memory is freed.
    """

    __slots__ = ("region", "nbytes", "src", "dst", "pending", "segment", "__weakref__")

    def __init__(self, region: list, nbytes: int, src: torch.Tensor, put: object,
                 segment: int) -> None:
        self.region = region  # [Region] until it is given back, then []
        self.nbytes, self.src, self.segment = nbytes, src, segment
        self.pending: dict[str, object] = {"put": put}
        self.dst: torch.Tensor | None = None

    @property
    def put(self) -> object | None:
        return self.pending.get("put")

    @property
    def get(self) -> object | None:
        return self.pending.get("get")


def _give_once(pool: RegionPool, holder: list) -> None:
    if holder:
        pool.give(holder.pop())


def _item_died(engine: CopyEngine, pool: RegionPool, holder: list, pending: dict) -> None:
    # runs before the item's tensors are freed (weakref callbacks come first)
    for handle in pending.values():
        engine.forget(handle)
    pending.clear()
    _give_once(pool, holder)


class Offloader:
    """Moves saved tensors of a plan's offloaded segments to the next tier and back.

    Args:
        device: Where the model's activations live.
        tier: The plan's :class:`~tightfit.checkpoint.plan.OffloadTier` (its ``name`` picks the
            engine and the pool: ``"host"`` pinned buffers through the CUDA engine, ``"disk"``
            spill files through the CPU one).
        num_segments: Segments in the plan (the tail is segment ``num_segments``).
        host_bytes: The plan's predicted host bytes: the pool's first chunk.

    Attributes:
        trace: ``(event, segment)`` in order — ``"put"``, ``"retire"``, ``"fetch"``, ``"wait"``
            — when a list is assigned (tests read the schedule from it).
    """

    def __init__(self, device: torch.device, tier: OffloadTier, num_segments: int,
                 host_bytes: int) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.tier, self.min_bytes = device, tier, tier.min_bytes
        self.engine, self.pool, self.spill = _engine_and_pool(
            device, tier.name, tier.offload_dir, host_bytes, tier.offload_host_budget)
        self._num = num_segments
        self._written: list[list[weakref.ref]] = [[] for _ in range(num_segments + 1)]
        self._items: list[list[weakref.ref]] = [[] for _ in range(num_segments + 1)]
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._unreleased: list[Region] = []  # written (or read) since the last release
        self.bytes_offloaded = self.bytes_fetched = 0
        self.blocked_s = 0.0
        self.trace: list[tuple[str, int]] | None = None

    # -- the hooks ----------------------------------------------------------------------
    def hooks(self, segment: int, skip: set[int]) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks of segment ``segment``'s forward; ``skip``: storages that
        stay (the block's parameters, its shared arguments)."""
        return torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, segment, skip), self._unpack)

    def _offloadable(self, t: torch.Tensor, skip: set[int]) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.device != self.device:
            return False  # parameters, subclasses (NF4 weights, DTensors), other devices
        if (t.is_leaf and t.requires_grad) or t.is_conj() or t.is_neg() or t.is_quantized:
            return False
        st = t.untyped_storage()
        return st.nbytes() >= self.min_bytes and st.data_ptr() not in skip

    def _pack(self, segment: int, skip: set[int], t: torch.Tensor) -> Any:
        if not self._offloadable(t, skip):
            return t
        st = t.untyped_storage()
        ref = self._by_storage.get(st)
        item = ref() if ref is not None else None
        if item is None:
            item = self._put(st, segment)
            self._by_storage[st] = weakref.ref(item)
        return (item, t.dtype, tuple(t.size()), t.stride(), t.storage_offset())

    def _put(self, st: torch.UntypedStorage, segment: int) -> _Item:
        nbytes = st.nbytes()
        region = self.pool.take(nbytes)  # TierFullError before anything is written
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
        handle = self.engine.offload(src, region.view)
        self._unreleased.append(region)
        holder = [region]
        item = _Item(holder, nbytes, src, handle, segment)
        died = weakref.finalize(item, _item_died, self.engine, self.pool, holder, item.pending)
        died.atexit = False  # no stream calls while the interpreter shuts down
        self._written[segment].append(weakref.ref(item))
        self._items[segment].append(weakref.ref(item))
        self.bytes_offloaded += nbytes
        self._note("put", segment)
        return item

    def _release(self) -> None:
        """Queue one release of the disk pages written or read since the last: behind those
        copies, on the copy thread, they are synced and leave this process's RAM (one
        ``msync`` per segment, not per tensor: it costs milliseconds a call)."""
        regions, self._unreleased = self._unreleased, []
        if regions and self.pool.tier == "disk":
            views = self.pool.covering(regions)
            self.engine.then(lambda: [release_range(v) for v in views])

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        item, dtype, size, stride, offset = packed
        if item.dst is None:  # not prefetched
            self._fetch(item)
            self._release()
        if item.get is not None:
            self.blocked_s += self.engine.wait(item.get)
            del item.pending["get"]
            self._note("wait", item.segment)
            _give_once(self.pool, item.region)  # later writes to it queue behind this read
        out = torch.empty(0, dtype=dtype, device=self.device)
        return out.set_(item.dst.untyped_storage(), offset, size, stride)

    def _fetch(self, item: _Item) -> None:
        if item.dst is not None:
            return
        item.dst = torch.empty(item.nbytes, dtype=torch.uint8, device=self.device)
        item.pending["get"] = self.engine.fetch(item.region[0].view, item.dst)
        self._unreleased.append(item.region[0])
        self.bytes_fetched += item.nbytes
        self._note("fetch", item.segment)

    def _note(self, event: str, segment: int) -> None:
        if self.trace is not None:
            self.trace.append((event, segment))

    # -- the schedule -------------------------------------------------------------------
    def segment_forward(self, j: int) -> None:
        """Segment ``j``'s forward starts (``j == num_segments``: the tail's)."""
        if j == 0:  # a new step: whatever an interrupted one left is retired now
            self._retire_all()
            for lst in self._items:
                lst.clear()
        self._release()  # the previous segment's writes
        if j >= 2:
            self._retire(j - 2)

    def forward_done(self) -> None:
        """The model's forward returned (or raised): every write is retired."""
        self._release()
        self._retire_all()

    def segment_backward(self, j: int) -> None:
        """Segment ``j``'s backward starts: its tensors are needed now, ``j - 1``'s next."""
        for k in (j, j - 1):
            if 0 <= k < len(self._items):
                for ref in self._items[k]:
                    item = ref()
                    if item is not None:
                        self._fetch(item)
                self._items[k].clear()
        self._release()

    def _retire(self, k: int) -> None:
        for ref in self._written[k]:
            item = ref()
            if item is not None and item.src is not None:
                self.blocked_s += self.engine.retire(item.put)
                item.src = None
                del item.pending["put"]
                self._note("retire", k)
        self._written[k].clear()

    def _retire_all(self) -> None:
        for k in range(len(self._written)):
            self._retire(k)

    def close(self) -> None:
        """Retire what is in flight, stop the engine, free the pool and delete spill files."""
        try:
            self._retire_all()
        finally:
            self.engine.close()
            self.pool.close()
            if self.spill is not None:
                self.spill.close()


def stored_forward(off: Offloader, segment: int, block: nn.Module, original: Callable,
                   first_block: bool = False) -> Callable:
    """The ``forward`` of a block of stored segment ``segment`` whose saves are offloaded
    (``first_block``: the chain's first)."""

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        skip = param_storages(block) | shared_storages((args, kwargs), first_block)
        with off.hooks(segment, skip):
            return original(*args, **kwargs)

    forward.__tightfit_original__ = original  # type: ignore[attr-defined]
    return forward


def _when_backward_reaches(out: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` when the gradient of ``out`` (its loss, else its first tensor that needs
    one) has been computed: the backward of what produced it starts next."""
    loss = getattr(out, "loss", None)
    leaves = [loss] if isinstance(loss, torch.Tensor) else []
    t = next((x for x in leaves + tree_leaves(out) if isinstance(x, torch.Tensor)
              and x.requires_grad and x.grad_fn is not None), None)
    if t is not None:
        t.register_hook(lambda _g: fn())


def schedule_hooks(off: Offloader, model: nn.Module, blocks: list[nn.Module],
                   segments: tuple, replaying: Callable[[], bool]) -> list[Any]:
    """Hooks that tell ``off`` where the step is: each segment's forward start, the tail's,
    the model's end, and (through gradient hooks) each segment's backward start. Hooks of
    checkpointed blocks also run in the recompute; ``replaying()`` says when to ignore them."""
    tail = len(segments)
    handles: list[Any] = []

    def live() -> bool:
        return torch.is_grad_enabled() and not replaying()

    for j, seg in enumerate(segments):
        def pre(_m: nn.Module, _args: tuple, j: int = j) -> None:
            if live():
                off.segment_forward(j)

        def post(_m: nn.Module, _args: tuple, out: Any, j: int = j) -> None:
            if live():
                _when_backward_reaches(out, functools.partial(off.segment_backward, j))
                if j == tail - 1:
                    off.segment_forward(tail)

        handles.append(blocks[seg.start].register_forward_pre_hook(pre))
        handles.append(blocks[seg.stop - 1].register_forward_hook(post))

    def done(_m: nn.Module, _args: tuple, out: Any) -> None:
        off.forward_done()
        if torch.is_grad_enabled():
            _when_backward_reaches(out, functools.partial(off.segment_backward, tail))

    handles.append(model.register_forward_hook(done, always_call=True))
    return handles
