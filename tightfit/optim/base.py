"""PagedOptimizer: a ``torch.optim.Optimizer`` whose per-element state lives in pages.

The base class owns the page store and the step sweep; a subclass supplies only

* ``_state_specs(group)`` — the state arrays (names, dtypes, blocks) a group needs;
* ``unit`` — element alignment of params and page splits (256 for blockwise 8-bit state);
* ``_check_group(group)`` — hyperparameter validation (raise before anything changes; the base
  calls it on ``defaults`` first thing, and on each group added);
* ``_update(group, params, grads, states, steps)`` — the math on lists of flat views, done by
  torch's fused/foreach kernels;
* optionally ``_export_segment`` / ``_import_segment`` — conversion of one segment of state
  to/from torch's state-dict tensors (default: copy arrays of the same name).

A subclass's constructor takes torch's arguments, then ``**paging`` (:class:`PagingOptions`)
passed on unchanged. The state files use only the public API and the "friend API" below.

See ``docs/paging.md`` ("Extending: a new paged optimizer").
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Unpack

import torch

from tightfit.optim import checks, options, state_io, views
from tightfit.optim.dtensor import local_tensor
from tightfit.optim.options import DEFAULT_PAGE_BYTES, PagingOptions
from tightfit.optim.views import Group, StateLists, Tensors
from tightfit.paging.events import PagingEvent
from tightfit.paging.layout import Page, StateSpec, build_pages
from tightfit.paging.occupancy import OccupancyControl, recover_from_oom
from tightfit.paging.probes import Probe
from tightfit.paging.store import PageStore
from tightfit.paging.sweep import sweep
from tightfit.paging.watch import PressureWatch

__all__ = ["DEFAULT_PAGE_BYTES", "PagedOptimizer", "PagingOptions"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class PagedOptimizer(torch.optim.Optimizer):
    """Base of the paged optimizers (see the module docstring for the subclass contract).

    Args:
        params: iterable of params or of param-group dicts, as for any torch optimizer.
        defaults: default hyperparameters of the subclass.
        **paging: the paging and pressure options, documented once in
            :class:`~tightfit.optim.options.PagingOptions` (``page_bytes``,
            ``device_budget``, ``host_budget``, ``spill_dir``, ``target``, ``probe``); any
            other keyword raises ``TypeError``.
    """

    unit: ClassVar[int] = 1
    # Longest run of elements handed to ``_update`` as one view (None: no limit). Views of
    # adjacent resident pages are joined (one kernel call per param on a slab, see
    # tightfit.paging.coalesce); a subclass making per-view temporaries caps their size here.
    _view_limit: int | None = None
    # Device-tier pages in slabs (None: where supported, i.e. on the CPU under Linux);
    # tests set it False to run the one-buffer-per-page path that CUDA uses.
    _slabs: ClassVar[bool | None] = None

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        **paging: Unpack[PagingOptions],
    ) -> None:
        opts = options.resolve(type(self).__name__, paging)  # an unknown keyword: TypeError
        self._check_group(defaults)  # bad hyperparameters raise before any state exists
        checks.check_paging_options(
            opts["page_bytes"], opts["device_budget"], opts["host_budget"], opts["spill_dir"]
        )
        params = list(params)
        device = checks.common_device(params)
        self._page_bytes = opts["page_bytes"]
        self._store = self._new_store(device, opts)
        # the update lists cached per resident bucket (tightfit.optim.views): ours, emptied
        # by the store whenever pages move or it closes, and by us when the state is replaced
        self._view_cache: dict[Any, Any] = {}
        self._store.on_move(self._view_cache.clear)
        # pressure: a target occupancy (opt-in); OOM recovery in step() is always on
        self._pressure: OccupancyControl | None = None
        if opts["target"] is not None or opts["probe"] is not None:
            self._pressure = OccupancyControl(self._store, opts["probe"], opts["target"])
        self._oom_recoveries = 0
        self._finalizer = weakref.finalize(self, self._store.close)
        self._group_pages: list[list[Page]] = []
        self._step_id = 0
        self._pending_step: int | None = None
        self._closed = False
        super().__init__(params, defaults)

    def _new_store(self, device: torch.device, paging: PagingOptions) -> PageStore:
        """The page store, built once by the constructor: the one place it is made, which
        tests and emulation override to give it their own copy engine (``engine=``) or to
        emulate an accelerator's tiers on the CPU (``emulate_accelerator=True``)."""
        return PageStore(
            device, paging["page_bytes"], paging["device_budget"], paging["host_budget"],
            paging["spill_dir"], slabs=self._slabs,
        )  # fmt: skip

    # ------------------------------------------------------------------ subclass contract
    def _state_specs(self, group: dict[str, Any]) -> list[StateSpec]:
        """The state arrays a param group needs."""
        raise NotImplementedError

    def _param_specs(self, group: dict[str, Any], param: torch.Tensor) -> list[StateSpec]:
        """The state arrays of one param (default: the group's :meth:`_state_specs`).

        A layout may give some params other arrays (bitsandbytes-style 8-bit optimizers keep
        params under 4,096 elements in 32 bit) or none at all (no pages; the subclass then
        updates those params itself). Pages never mix layouts, and ``_update`` is called per
        layout, so its ``states`` lists stay parallel.
        """
        return self._state_specs(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError``/``TypeError`` for bad hyperparameters in ``group``."""

    def _update(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        """Update params and state in place; lists are parallel flat views, ``steps`` holds
        each param's step count *after* this step's increment (shared between a param's
        segments, so never modify them). A view may span several pages of one param (joined
        when they lie back to back in a slab; capped by ``_view_limit``). The lists themselves
        are reused across steps (``tightfit.optim.views``): never append to or reorder them."""
        raise NotImplementedError

    def _export_segment(
        self, group: dict[str, Any], views: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Torch state-dict tensors (flat, fp32) of one segment of state."""
        return {name: v.float() for name, v in views.items()}

    def _import_segment(
        self, group: dict[str, Any], values: dict[str, torch.Tensor], views: dict[str, torch.Tensor]
    ) -> None:
        """Write one segment of torch state-dict tensors (flat) into the page views."""
        for name, view in views.items():
            view.copy_(values[name])

    # ------------------------------------------------------------------ friend API
    # What state_io/state8bit use beyond the public API (typed there as Protocols: they never
    # import this module): the hooks _state_specs/_export_segment/_import_segment and these.
    def _validate_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError``/``TypeError`` for bad hyperparameters in a complete group
        (``defaults`` merged in); changes nothing."""
        self._check_group(group)

    def _clear_pending_step(self) -> None:
        """Forget a step that stopped part-way: the whole state was just replaced (a load)."""
        self._pending_step = None

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated first) and lay out its state pages."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        ps = group["params"]
        if isinstance(ps, set):
            raise TypeError("params must be an ordered collection (list), not a set")
        group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        merged = {**self.defaults, **group}
        checks.check_group_params(group["params"], self._store.device)
        self._check_group(merged)
        # Params may need different state arrays (an 8-bit layout keeps small params in 32
        # bit): one run of pages per distinct layout; a layout without arrays gets no pages.
        layouts = [tuple(self._param_specs(merged, p)) for p in group["params"]]
        n_before = len(self.param_groups)
        super().add_param_group(group)
        if len(self.param_groups) == n_before:  # pragma: no cover - torch raised instead
            return
        g = len(self.param_groups) - 1
        pg = self.param_groups[g]
        pages: list[Page] = []
        for layout in dict.fromkeys(layouts):
            if not layout:
                continue
            numels = [local_tensor(p).numel() if k == layout else 0
                      for p, k in zip(pg["params"], layouts)]  # fmt: skip
            pages += build_pages(
                g, numels, [p.dtype for p in pg["params"]], list(layout), self.unit,
                self._page_bytes, first_index=len(self._store.pages) + len(pages),
            )  # fmt: skip
        self._group_pages.append(pages)
        self._store.add_pages(pages)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (streaming pages through the device as needed).

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        self._check_open()
        if self._pending_step is not None:
            raise RuntimeError(
                "the previous step stopped part-way; call finish_step() to complete it "
                "(with the same gradients) before the next step"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError(
                        f"{type(self).__name__} does not support sparse gradients; use "
                        "torch.optim.SparseAdam for sparse embeddings or dense gradients"
                    )
                active.append(p)
        if not active:
            return loss
        if self._pressure is not None:
            # evict if over the target, else bring pages back (the grads die after the step)
            self._pressure.before_step(sum(p.grad.nbytes for p in active))
        self._store.materialize()
        steps = []
        for p in active:
            if p not in self.state:
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            steps.append(self.state[p]["step"])
        self._step_id += 1
        self._pending_step = self._step_id
        torch._foreach_add_(steps, 1)
        self._run_sweep_or_stream()
        return loss

    def finish_step(self) -> None:
        """Complete a step that stopped part-way, updating only the pages it had not updated."""
        self._check_open()
        if self._pending_step is not None:
            self._run_sweep_or_stream()

    def _run_sweep_or_stream(self) -> None:
        try:
            self._run_sweep()
        except torch.OutOfMemoryError as exc:
            # Drain every evictable page and finish by streaming through a one- or two-page
            # window; pages updated before the error carry this step's id and are skipped.
            recover_from_oom(self._store, exc)
            self._oom_recoveries += 1
            if self._pressure is None and self._store.device.type == "cuda":
                self._pressure = OccupancyControl(self._store)  # pages come back under 0.9
            self._run_sweep()
        if self._pressure is not None:
            self._pressure.after_step()

    def _run_sweep(self) -> None:
        pages = [
            page
            for gi, group in enumerate(self.param_groups)
            for page in self._group_pages[gi]
            if any(group["params"][s.param].grad is not None for s in page.segments)
        ]
        sweep(self._store, pages, self._pending_step, self._update_pages)  # type: ignore[arg-type]
        self._pending_step = None

    def _update_pages(self, items: list[tuple[Page, dict[str, torch.Tensor]]]) -> None:
        # The sweep calls this once per layout (one group, param dtype and state arrays).
        first = items[0][0]
        group = self.param_groups[first.group]
        lists = views.bucket_lists(
            self.state, group["params"], items, self._view_limit, self._view_cache
        )
        if lists is None:
            return
        params, grads, states, steps = lists
        if first.dtype in _LOW_PRECISION:
            # fp32 state for bf16/fp16 params: update an fp32 copy, round once into the param.
            p32 = [p.float() for p in params]
            self._update(group, p32, [g.float() for g in grads], states, steps)
            torch._foreach_copy_(params, p32)
        else:
            self._update(group, params, grads, states, steps)

    # ------------------------------------------------------------------ state dicts, files
    def state_dict(self) -> dict[str, Any]:
        """Torch-format state dict (e.g. ``torch.optim.AdamW``'s), gathered from the pages."""
        self._check_open()
        return state_io.to_torch(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format state dict (torch's or a paged optimizer's); paging is kept."""
        self._check_open()
        self._view_cache.clear()  # the step tensors are replaced
        state_io.from_torch(self, state_dict)

    def save(self, path: str | os.PathLike) -> None:
        """Write the state page by page to ``path`` (atomically: temp file + rename)."""
        self._check_open()
        state_io.save(self, path)

    def load(self, path: str | os.PathLike) -> None:
        """Read a file written by :meth:`save` for the same params, page by page."""
        self._check_open()
        self._view_cache.clear()  # the step tensors are replaced
        state_io.load(self, path)

    # ------------------------------------------------------------------ memory
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
        returns the :class:`~tightfit.paging.occupancy.OccupancyControl`.
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
        :class:`~tightfit.paging.watch.PressureWatch`; ``.remove()`` uninstalls it.
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

    def close(self) -> None:
        """Free every page, stop the copy worker and delete the spill files (idempotent)."""
        if not self._closed:
            self._closed = True
            if self._pressure is not None:
                self._pressure.close()
            self._finalizer()
            self.state.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed; make a new optimizer")

    def __enter__(self) -> PagedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
