"""Target occupancy: keep a page store's device tier under a target, whatever else grows.

The bathtub with an overflow drain: between steps optimizer pages stay on the device while
there is headroom under the target; when usage passes it (a long sequence, an odd batch, the
recompute of a checkpointed segment) pages drain to the next tier, and they come back at a
later step once the surge has passed. An out-of-memory error inside the step drains
everything evictable and the step finishes by streaming pages through a small window.

:class:`OccupancyControl` is the policy; the store (:class:`~tightfit.paging.store.PageStore`)
does the moves and logs every one as a :class:`~tightfit.paging.events.PagingEvent`.
Which pages leave first: the store keeps a prefix of the sweep order resident, so pages leave
from the end of the sweep. All pages cost the same per byte to move (out now, in at a later
step), so the benefit of an eviction is the bytes it frees: whole pages, fewest moves.
"""

from __future__ import annotations

import collections
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tightfit.measure.cgroup import limiting_cgroup
from tightfit.measure.heap import trim_heap
from tightfit.paging.store import PageStore
from tightfit.pressure import probes
from tightfit.pressure.probes import CgroupProbe, CudaProbe, Probe, RSSProbe
from tightfit.pressure.target import resolve_target
from tightfit.pressure.watch import PressureWatch

__all__ = ["OccupancyControl", "OccupancyCounts", "default_probe", "oom_reason", "recover_from_oom"]

MiB = 2**20
#: Steps whose room the restore hysteresis remembers (their median is what comes back).
RECENT_STEPS = 8


def default_probe(device: torch.device) -> Probe:
    """The probe for ``device``: :class:`CudaProbe` on CUDA; on the CPU :class:`CgroupProbe`
    under a memory cgroup with a limit (what the kernel compares with it), else
    :class:`RSSProbe`."""
    if device.type == "cuda":
        return CudaProbe(device)
    if device.type == "cpu":
        limit = probes.cgroup_memory_limit()  # looked up on the module: tests stand one in
        cg = limiting_cgroup() if limit is not None else None
        return CgroupProbe(cg) if cg is not None and cg.limit == limit else RSSProbe()
    raise ValueError(
        f"no built-in probe for {device.type!r}; pass probe=<a Probe> reading that device."
    )


@dataclass
class OccupancyCounts:
    """What pressure handling did (cumulative)."""

    evictions: int = 0  # calls that moved pages off the device
    restores: int = 0  # calls that brought pages back
    evicted_bytes: int = 0  # net device bytes freed by evictions
    restored_bytes: int = 0  # net device bytes taken back by restores
    seconds: float = 0.0  # wall time spent reading the probe and moving pages
    over_target_reads: int = 0  # readings between steps that found usage above the target


class OccupancyControl:
    """Keeps ``store``'s device under ``target`` bytes of total usage, as ``probe`` reads it.

    Args:
        store: The optimizer's page store (``opt.pager``).
        probe: Reads the device's usage; ``None`` picks :func:`default_probe`.
        target: A fraction of the probe's capacity (float), bytes (int), or ``None`` for 0.9
            of the capacity on CUDA (required on the CPU, where capacity is what you say).
        restore_margin_bytes: Headroom left under the target when pages come back between
            steps (the update itself needs a little). ``None``: two pages. With a watched
            model pages also leave the watch's margin free for the next forward.

    Raises:
        ValueError/TypeError: see :func:`~tightfit.pressure.target.resolve_target`; a negative
            ``restore_margin_bytes``.
    """

    def __init__(
        self,
        store: PageStore,
        probe: Probe | None = None,
        target: float | int | None = None,
        *,
        restore_margin_bytes: int | None = None,
    ) -> None:
        if probe is not None and not isinstance(probe, Probe):
            raise TypeError(
                "probe must be a tightfit.pressure.probes.Probe (CudaProbe, CgroupProbe, "
                f"RSSProbe), got {type(probe).__name__}."
            )
        if restore_margin_bytes is not None and restore_margin_bytes < 0:
            raise ValueError(f"restore_margin_bytes must be >= 0, got {restore_margin_bytes}.")
        probe = probe if probe is not None else default_probe(store.device)
        self.target_bytes = resolve_target(target, probe)
        self.store = store
        self.probe = probe
        self.restore_margin_bytes = restore_margin_bytes
        self.counts = OccupancyCounts()
        self.watches: list[PressureWatch] = []
        # the state each recent step could have held without its watch evicting (from
        # PressureWatch.end_step); restores stop at their median: hysteresis against an
        # evict-in-backward, restore-before-update ping-pong on every ordinary step, while a
        # rare spike (an outlier) does not keep the pages out after it
        self._holds: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)

    # -- moves -------------------------------------------------------------------------
    def relieve(self, need_bytes: int, reason: str) -> int:
        """Evict at least ``need_bytes`` of state from the device (as far as pages allow).

        Returns:
            Device bytes freed (0 when nothing is left to evict).
        """
        t0 = time.perf_counter()
        try:
            return self._relieve(need_bytes, reason)
        finally:
            self.counts.seconds += time.perf_counter() - t0

    def _relieve(self, need_bytes: int, reason: str) -> int:
        store = self.store
        if need_bytes <= 0 or not store.materialized or store.resident_bytes() == 0:
            return 0
        freed = 0
        while freed < need_bytes and store.resident_bytes() > 0:
            got = store.evict_bytes(min(self._chunk_bytes(), int(need_bytes) - freed), reason)
            _return_to_os(store)
            if got <= 0:
                break
            freed += got
        if freed > 0:
            self.counts.evictions += 1
            self.counts.evicted_bytes += freed
        return freed

    def before_step(self, grad_bytes: int = 0) -> None:
        """Between backward and the update: evict if over the target, else restore lazily.

        Args:
            grad_bytes: Bytes of the gradients now alive, which ``zero_grad()`` frees after
                the step. Pages come back only as far as they stay under the target now (less
                the restore margin) *and* leave the watch's margin free once the gradients
                are gone, so the next forward does not push them straight out again.
        """
        t0 = time.perf_counter()
        try:
            self._before_step(grad_bytes)
        finally:
            self.counts.seconds += time.perf_counter() - t0

    def _before_step(self, grad_bytes: int) -> None:
        store = self.store
        self._learn_holds()
        if self._lowered() or not store.materialized:
            # the spike's freed activations (or, before the first placement, what the setup
            # freed: the plan's profile of the longest batch) out of RSS before reading it
            _return_to_os(store)
        used = self.probe.used_bytes()
        if not store.materialized:
            # first step: place only what fits under the target (no moves yet, so no events)
            room = self.target_bytes - used - self._restore_margin()
            if store.state_bytes > room:
                store.limit_device(max(room, store.page_bytes), self._why("first step", used))
            return
        if used > self.target_bytes:
            self.counts.over_target_reads += 1
            self._relieve(used - self.target_bytes, self._why("over target before step", used))
            return
        if self._lowered():
            self._restore(used, grad_bytes)

    def _lowered(self) -> bool:
        """Whether pressure holds the device below its budget (pages evicted, not yet back)."""
        limit, budget = self.store.device_limit, self.store.device_budget
        return limit is not None and (budget is None or limit < budget)

    def _restore(self, used: int, grad_bytes: int) -> None:
        """Bring pages back as far as they fit now and a step like the recent ones holds."""
        store = self.store
        limit, budget = store.device_limit, store.device_budget
        room = self.target_bytes - used - self._restore_margin()  # the update's own room
        if self._holds:  # what the recent steps could hold (their median)
            held = sorted(self._holds)[len(self._holds) // 2]
            room = min(room, held - store.device_bytes - store.page_bytes)
        else:  # nothing learned yet: keep the watch's margin free once the grads are freed
            watch_margin = max((w.margin_bytes for w in self.watches if w.active), default=0)
            room = min(room, self.target_bytes - watch_margin - (used - grad_bytes))
        if room < store.page_bytes:
            return
        added, why = 0, self._why("headroom", used)
        failed = None
        try:
            while added + store.page_bytes <= room and store.disk_bytes() + store.host_bytes:
                got = store.restore_bytes(min(self._chunk_bytes(), int(room) - added), why)
                _return_to_os(store)
                if got <= 0:
                    break
                added += got
        except torch.OutOfMemoryError as exc:  # the probe was optimistic: stay where we were
            failed = oom_reason(exc)
        if failed is not None:  # out of the handler: the failed restore's buffers are freed
            store.limit_device(limit, f"restore failed: {failed}")
            return
        if budget is None and (store.device_limit or 0) >= store.state_bytes:
            store.limit_device(None, "pressure passed")  # back to no limit at all
        if added > 0:
            self.counts.restores += 1
            self.counts.restored_bytes += added

    def _learn_holds(self) -> None:
        """Fold in the step that just ran its backward (see ``_holds``)."""
        for w in self.watches:
            if not w.active:
                continue
            room, freed = w.end_step()
            if room is not None:  # the state it began with, plus the room left above that
                self._holds.append(self.store.device_bytes + freed + room)
            # growth is measured within a step: what the update and a restore add between
            # two steps is not an activation spike (it would inflate the margin)
            w.reset()

    def after_step(self) -> None:
        """Drop the spill file's pages from this process's RSS after the sweep streamed them.

        Counted as time on pressure when pressure (not the budget) kept them off the device:
        writing the streamed pages back is what the eviction costs at the update.
        """
        if self.store.on_cpu and self.store.materialized and self.store.disk_bytes():
            t0 = time.perf_counter()
            self.store.spill.release()
            if self._lowered():
                self.counts.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Remove the hooks of every watch."""
        for w in self.watches:
            w.remove()

    # -- watching ----------------------------------------------------------------------
    def watch(
        self,
        model: nn.Module,
        *,
        margin_bytes: int | None = None,
        min_interval_s: float = 0.005,
        blocks: Iterable[nn.Module] | None = None,
    ) -> PressureWatch:
        """Hook ``model``'s blocks so pages drain before a spike passes the target.

        See :class:`~tightfit.pressure.watch.PressureWatch` for the arguments. Returns the
        watch; ``watch.remove()`` uninstalls it.
        """
        w = PressureWatch(
            model,
            self.probe,
            self.target_bytes,
            self.relieve,
            margin_bytes=margin_bytes,
            min_interval_s=min_interval_s,
            blocks=blocks,
        )
        self.watches.append(w)
        return w

    # -- reporting ---------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Counts for ``memory_stats()``: moves, bytes, recoveries, target and probe peak."""
        c = self.counts
        out: dict[str, int | float] = {
            "target_bytes": self.target_bytes,
            "probe_peak_bytes": self.probe.peak_bytes,
            "evictions": c.evictions,
            "restores": c.restores,
            "evicted_bytes": c.evicted_bytes,
            "restored_bytes": c.restored_bytes,
            "over_target_reads": c.over_target_reads,
            "pressure_seconds": c.seconds,
        }
        live = [w for w in self.watches if w.active]
        if live:
            out["watch_reads"] = sum(w.stats.reads for w in live)
            out["watch_triggers"] = sum(w.stats.triggers for w in live)
            # the hooks' own time: the evictions they asked for are in pressure_seconds
            out["watch_seconds"] = sum(w.stats.time_s - w.stats.callback_s for w in live)
        return out

    def _chunk_bytes(self) -> int:
        # On the CPU pages move through the spill map: in chunks, each released before the
        # next, so the mapped pages of a large move never sit in RSS all at once.
        return 4 * self.store.page_bytes if self.store.on_cpu else 1 << 62

    def _restore_margin(self) -> int:
        if self.restore_margin_bytes is not None:
            return self.restore_margin_bytes
        return 2 * self.store.page_bytes

    def _why(self, what: str, used: int) -> str:
        return (
            f"{what}: {used / MiB:.1f} MiB in use, target {self.target_bytes / MiB:.1f} MiB"
        )


def recover_from_oom(store: PageStore, why: BaseException | str) -> int:
    """Drain every evictable page so an interrupted step can finish by streaming.

    The device keeps only the streaming window: one page-sized slot, or two when two fit. The
    store logs the moves; an ``"oom"`` event records the error itself.

    Call it after the ``except`` block that caught the error, with :func:`oom_reason`'s line
    (an exception still works): inside the block the error's traceback keeps the failed
    attempt's tensors allocated, the memory this drain is meant to make room beside.

    Returns:
        Device bytes freed.
    """
    why = why if isinstance(why, str) else _short(why)
    before = store.device_bytes
    store.limit_device(store.page_bytes, f"out of memory in step: {why}")
    freed = max(before - store.device_bytes, 0)
    store.events.record("oom", why, freed, 0, "device", "disk" if store.on_cpu else "host")
    _return_to_os(store)
    return freed


def oom_reason(exc: BaseException) -> str:
    """``exc`` in one line, for the log and :func:`recover_from_oom`, with the finished frames
    of its traceback cleared: their locals (the failed attempt's temporaries) are freed when
    the ``except`` block ends, even if something still holds the exception."""
    why = _short(exc)
    traceback.clear_frames(exc.__traceback__)  # the handler's own frame is left as it is
    return why


def _return_to_os(store: PageStore) -> None:
    """On the CPU, make freed pages leave the process's RSS, where a probe or cgroup sees it.

    Spill-file pages are synced and unmapped (:meth:`SpillArea.release`); page buffers freed
    into glibc's heap are handed back with ``malloc_trim`` (a 4 MiB page is under glibc's
    mmap threshold once that has grown, so ``free`` alone may keep it).
    """
    if not store.on_cpu:
        return
    store.spill.release()
    trim_heap()


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"
