"""The memory side of a paged optimizer's public API: the pager, pressure, events and stats.

A mixin of :class:`~tightfit.optim.base.PagedOptimizer`, kept apart so that the base holds the
optimizer itself (params, the step, the torch API) and this the questions about memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tightfit.paging.events import PagingEvent
from tightfit.pressure.occupancy import OccupancyControl
from tightfit.pressure.probes import Probe
from tightfit.paging.store import PageStore
from tightfit.pressure.watch import PressureWatch


class MemoryAPI:
    """``pager``, ``set_pressure``, ``watch``, ``paging_events`` and ``memory_stats``."""

    _store: PageStore
    _pressure: OccupancyControl | None
    _oom_recoveries: int

    def _check_open(self) -> None:  # pragma: no cover - the base defines it
        raise NotImplementedError

    @property
    def pager(self) -> PageStore:
        """The page store (residency, budgets, counters, events)."""
        return self._store

    def set_pressure(
        self,
        target: float | int | None = None,
        probe: Probe | None = None,
        *,
        restore_margin_bytes: int | None = None,
    ) -> OccupancyControl:
        """Keep the device under ``target`` (see the ``target``/``probe`` arguments).

        Replaces an earlier setting (its watches stay installed and keep their old target);
        returns the :class:`~tightfit.pressure.occupancy.OccupancyControl`.
        """
        self._check_open()
        self._pressure = OccupancyControl(
            self._store, probe, target, restore_margin_bytes=restore_margin_bytes
        )
        return self._pressure

    def watch(
        self,
        model: torch.nn.Module,
        *,
        margin_bytes: int | None = None,
        min_interval_s: float = 0.005,
        blocks: Iterable[torch.nn.Module] | None = None,
    ) -> PressureWatch:
        """Hook ``model``'s blocks so pages leave the device before a spike passes the target.

        Uses the optimizer's target (on CUDA, 0.9 of the device when none was set; on the CPU
        set one first: ``target=`` or :meth:`set_pressure`). See
        :class:`~tightfit.pressure.watch.PressureWatch`; ``.remove()`` uninstalls it.
        """
        self._check_open()
        if self._pressure is None:
            self._pressure = OccupancyControl(self._store)
        return self._pressure.watch(
            model, margin_bytes=margin_bytes, min_interval_s=min_interval_s, blocks=blocks
        )

    def paging_events(self) -> list[PagingEvent]:
        """Every logged residency change (evict, restore, oom, ...): time, reason, bytes, tiers."""
        return list(self._store.events.events)

    def memory_stats(self) -> dict[str, Any]:
        """Bytes per tier, peak device bytes and cumulative paging traffic.

        Returns:
            ``device_bytes``, ``host_bytes``, ``disk_bytes``, ``peak_device_bytes``,
            ``state_bytes``, ``resident_bytes``, ``window_bytes``, ``bytes_paged_in``,
            ``bytes_paged_out``, ``page_faults``, ``stall_seconds``, ``pages``, ``page_bytes``,
            ``device_budget``, ``host_budget``, ``spill_dir``, ``evict_events``,
            ``restore_events``, ``oom_recoveries``; with a target also ``target_bytes``,
            ``probe_peak_bytes``, ``evictions``, ``restores``, ``evicted_bytes``,
            ``restored_bytes``, ``over_target_reads`` (and ``watch_*`` while watching).
        """
        return {
            **self._store.stats(),
            "oom_recoveries": self._oom_recoveries,
            **(self._pressure.stats() if self._pressure is not None else {}),
        }
