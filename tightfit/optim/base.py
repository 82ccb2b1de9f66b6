"""PagedOptimizer: a ``torch.optim.Optimizer`` whose per-element state lives in pages.

The base class owns the page store, the step sweep and the memory API (``pager``,
``set_pressure``, ``watch``, ``paging_events``, ``memory_stats``); a subclass supplies only

* ``_state_specs(group)`` — the state arrays (names, dtypes, blocks) a group needs (fp32;
  float64 and complex128 params get them in float64, as torch keeps state in the param's
  precision);
* ``unit`` — element alignment of params and page splits (256 for blockwise 8-bit state);
* ``_check_group(group)`` — hyperparameter validation (raise before anything changes; the base
  calls it on ``defaults`` first thing, and on each group added);
* ``_update(group, params, grads, states, steps)`` — the math on lists of flat views, done by
  torch's fused/foreach kernels;
* optionally ``_export_segment`` / ``_import_segment`` — conversion of one segment of state
  to/from torch's state-dict tensors (default: copy arrays of the same name).

A subclass's constructor takes torch's arguments, then ``**paging_kw`` passed on unchanged:
``paging=PagingOptions(...)`` or its fields as keywords (``page_bytes``, ``device_budget``,
``host_budget``, ``spill_dir``), and the pressure keywords ``target`` and ``probe``. The
state files use only the public API and the "friend API" below; ``optimizer.state[p]`` is a
:class:`~tightfit.optim.param_state.ParamState`; torch's state API (state dicts with hooks,
pickling) is :mod:`tightfit.optim.torch_api`'s mixin, param groups
:mod:`tightfit.optim.param_groups`'.

See ``docs/paging.md`` ("Extending: a new paged optimizer") and ``docs/optimizers.md``
("torch.optim compatibility").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from tightfit.integrity.interrupts import hold_interrupts
from tightfit.optim import upcast, update_lists
from tightfit.optim.host_reads import HostReads
from tightfit.optim.optimizer_options import check_keywords, paging_options
from tightfit.optim.param_groups import GroupLayout, common_device, intake
from tightfit.optim.param_state import ParamState, StateAccess, adopt_plain_states, step_tensor
from tightfit.optim.torch_api import TorchAPI
from tightfit.optim.update_lists import Group, StateLists, Tensors
from tightfit.paging.events import PagingEvent
from tightfit.paging.layout import Page, StateSpec
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore
from tightfit.paging.sweep import mark_done, sweep
from tightfit.pressure.occupancy import OccupancyControl, oom_reason, recover_from_oom
from tightfit.pressure.probes import Probe
from tightfit.pressure.watch import PressureWatch
from tightfit.tiers.copy import CopyEngine


class PagedOptimizer(GroupLayout, TorchAPI, torch.optim.Optimizer):
    """Base of the paged optimizers (see the module docstring for the subclass contract).

    Args:
        params: iterable of params, of ``(name, param)`` pairs (``named_parameters()``) or of
            param-group dicts, as for any torch optimizer.
        defaults: default hyperparameters of the subclass.
        paging: the page size, budgets and spill folder
            (:class:`~tightfit.paging.paging_options.PagingOptions`); or give its fields as
            keywords (``page_bytes``, ``device_budget``, ``host_budget``, ``spill_dir``).
            Any other keyword raises ``TypeError``.
        target: keep the device's total usage (as ``probe`` reads it) under this: a fraction
            of capacity (float, e.g. 0.9) or bytes (int; required on the CPU). Pages leave the
            device when usage passes it and come back at later steps; ``None`` with no
            ``probe``: no pressure handling (see ``docs/pressure.md``).
        probe: reads the device's usage (``None``: CudaProbe on CUDA; on the CPU CgroupProbe
            under a memory cgroup with a limit, else RSSProbe).
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
        *,
        paging: PagingOptions | None = None,
        target: float | int | None = None,
        probe: Probe | None = None,
        **paging_kw: Any,
    ) -> None:
        check_keywords(type(self).__name__, paging_kw)  # an unknown keyword: TypeError
        self._check_group(defaults)  # bad hyperparameters raise first (as in torch)
        params = intake(params)  # torch's TypeError for a bare tensor, empty lists
        self._paging = paging_options(paging, paging_kw)
        self._target, self._probe = target, probe
        device = common_device(params)
        # the update lists cached per resident bucket (tightfit.optim.update_lists): ours,
        # emptied by the store whenever pages move or it closes, and by us when the state is
        # replaced
        self._view_cache = update_lists.ViewCache()
        self._host = HostReads()  # step counts, tensor hyperparameters: read once a step
        self._access = StateAccess(self)  # optimizer.state[p]'s reads and writes
        self._pressure: OccupancyControl | None = None
        self._finalizer: weakref.finalize | None = None
        self._scratch_planned: tuple[PageStore, int] | None = None  # store, pages when planned
        self._install_store(device)
        self._oom_recoveries = 0
        self._group_pages: list[list[Page]] = []
        self._group_params: list[list[torch.Tensor]] = []  # each group's list when laid out
        self._maybe_staged: set[int] = set()  # params whose memory may not be in page order
        self._step_id = 0
        self._pending_step: int | None = None
        self._grad_scale: torch.Tensor | None = None  # the AMP scaler's, during a step
        self._closed = False
        super().__init__(params, defaults)

    def _new_store(self, device: torch.device, paging: PagingOptions) -> PageStore:
        """The page store, built by the constructor (and again when meta params were
        materialized): the one place it is made, which tests and emulation override to give
        it their own copy engine (``engine=``) or to emulate an accelerator's tiers on the
        CPU (``emulate_accelerator=True``)."""
        meta = device.type == "meta"  # a placeholder until the params get real memory
        return PageStore(device, paging, slabs=None if meta else self._slabs,
                         engine=CopyEngine() if meta else None)  # fmt: skip

    def _install_store(self, device: torch.device) -> None:
        store = self._new_store(device, self._paging)
        store.on_move(self._view_cache.clear)
        if self._finalizer is not None:
            self._finalizer()  # closes the store being replaced
        if self._pressure is not None:
            self._pressure.close()
        self._store = store
        self._finalizer = weakref.finalize(self, store.close)
        # pressure: a target occupancy (opt-in); OOM recovery in step() is always on
        self._pressure = None
        if self._target is not None or self._probe is not None:
            self._pressure = OccupancyControl(store, self._probe, self._target)

    def _follow_device(self, action: str | None) -> None:
        """Meta params (built under ``torch.device("meta")``) hold no data: the store waits.
        Once they are materialized (``module.to_empty(device=...)``) the pages are laid out
        on their device; ``action`` (a step, a load) needs that and raises until then."""
        if self._store.device.type != "meta":
            return
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if not devices or any(d.type == "meta" for d in devices):
            if action is None:
                return
            raise RuntimeError(
                f"params are on the meta device, so {action} cannot run: `fused=True` requires "
                "all the params to be floating point Tensors of supported devices, and meta "
                "tensors hold no data; materialize them first (module.to_empty(device=...), "
                "then initialize them): the optimizer follows them to that device"
            )
        if len(devices) > 1:
            found = ", ".join(sorted(map(str, devices)))
            raise ValueError(
                f"params were materialized on different devices ({found}); a paged optimizer "
                "pages state for one device: move them to one device"
            )
        device = devices.pop()
        pages = list(self._store.pages)
        self._install_store(device)  # the meta store is closed; its pages were never made
        self._store.add_pages(pages)

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

    def _check_param(self, param: torch.Tensor) -> None:
        """Raise ``TypeError`` for a param this optimizer cannot update (default: none)."""

    def _update(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        """Update params and state in place; lists are parallel flat views, ``steps`` holds
        each param's step count *after* this step's increment (shared between a param's
        segments, so never modify them). A view may span several pages of one param (joined
        when they lie back to back in a slab; capped by ``_view_limit``). The lists themselves
        are reused across steps (``tightfit.optim.update_lists``): never append to or reorder them."""
        raise NotImplementedError

    def _takes_grad_scale(self, group: dict[str, Any]) -> bool:
        """Whether ``_update`` unscales the grads itself by ``self._grad_scale`` (a fused
        kernel's ``grad_scale=``); otherwise the base hands it unscaled copies."""
        return False

    def _export_segment(
        self, group: dict[str, Any], views: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Torch state-dict tensors (flat; fp32, or float64 as stored) of one segment."""
        return {name: v if v.dtype == torch.float64 else v.float() for name, v in views.items()}

    def _import_segment(
        self, group: dict[str, Any], values: dict[str, torch.Tensor], views: dict[str, torch.Tensor]
    ) -> None:
        """Write one segment of torch state-dict tensors (flat) into the page views."""
        for name, view in views.items():
            view.copy_(values[name])

    def _constant_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fixed tensors ``state[param]`` shows besides its paged arrays (none here; an 8-bit
        layout's quantization maps)."""
        return {}

    def _init_kwargs(self) -> dict[str, Any]:
        """Constructor keywords beyond the hyperparameters, for copies (paging and pressure)."""
        return {"paging": self._paging, "target": self._target, "probe": self._probe}

    # ------------------------------------------------------------------ friend API
    # What torch_format/paged8bit/param_state use beyond the public API (typed there as
    # Protocols: they never import this module): the hooks above and these.
    def _validate_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError``/``TypeError`` for bad hyperparameters in a complete group
        (``defaults`` merged in); changes nothing."""
        self._check_group(group)

    def _clear_pending_step(self) -> None:
        """Forget a step that stopped part-way: the whole state was just replaced (a load)."""
        self._pending_step = None

    def _new_param_state(self, param: torch.Tensor, items: dict[str, Any]) -> ParamState:
        """``optimizer.state[param]`` holding the plain entries ``items`` (``step``, ...)."""
        return ParamState(self._access, param, items)

    def _state_replaced(self) -> None:
        """A ``step`` tensor was replaced: cached update lists hold the old one."""
        self._view_cache.clear()
        self._host.clear()

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
            ``state_bytes``, ``resident_bytes``, ``window_bytes``, ``scratch_bytes``,
            ``bytes_paged_in``, ``bytes_paged_out``, ``page_faults``, ``stall_seconds``,
            ``pages``, ``page_bytes``, ``device_budget``, ``host_budget``, ``spill_dir``,
            ``evict_events``, ``restore_events``, ``oom_recoveries``; with a target also
            ``target_bytes``, ``probe_peak_bytes``, ``evictions``, ``restores``,
            ``evicted_bytes``, ``restored_bytes``, ``over_target_reads`` (and ``watch_*``
            while watching).
        """
        return {
            **self._store.stats(),
            "oom_recoveries": self._oom_recoveries,
            **(self._pressure.stats() if self._pressure is not None else {}),
        }

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
        self._check_groups(for_step=True)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._active_params()
        if not active:
            return loss
        self._follow_device("step()")
        if self._scratch_planned != (self._store, len(self._store.pages)):
            upcast.plan_scratch(self._store)  # bf16/fp16 params' fp32 copies, inside the budget
            self._scratch_planned = (self._store, len(self._store.pages))
        # The AMP scaler's attributes (what torch's fused kernels honour): skip on inf/NaN.
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(torch.as_tensor(found_inf).ne(0).any()):
            return loss
        if self._pressure is not None:
            # evict if over the target, else bring pages back (the grads die after the step)
            self._pressure.before_step(sum(p.grad.nbytes for p in active))
        self._store.materialize()
        self._access.flush()  # in-place edits of state copies handed out reach the pages
        get = self.state.get
        steps = []
        for p in active:  # a call per param only when its state starts (LoRA: hundreds)
            st = get(p)
            steps.append(st.plain["step"] if type(st) is ParamState and "step" in st.plain
                         else self._step_tensor(p))  # fmt: skip
        with hold_interrupts():  # Ctrl-C: both or neither (finish_step relies on the counts)
            self._step_id += 1
            self._pending_step = self._step_id
            torch._foreach_add_(steps, 1)
            self._host.begin(steps)
        self._grad_scale = getattr(self, "grad_scale", None)
        try:
            self._run_sweep_or_stream()
        finally:
            self._grad_scale = None
        self._access.refresh()  # copies still held follow the update
        return loss

    def _active_params(self) -> list[torch.Tensor]:
        active: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients; use "
                        "torch.optim.SparseAdam for sparse embeddings or dense gradients"
                    )
                active.append(p)
        return active

    def _step_tensor(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s step count, starting its state (at 0) on its first update."""
        return step_tensor(self.state, self._access, p)

    def _adopt_plain_states(self) -> None:
        """``state[p]`` set to a plain dict (torch code does that) becomes a ParamState."""
        adopt_plain_states(self.state, self._access)

    @torch.no_grad()  # as step(): the update writes params in place (views of leaves)
    def finish_step(self) -> None:
        """Complete a step that stopped part-way, updating only the pages it had not updated."""
        self._check_open()
        if self._pending_step is not None:
            self._run_sweep_or_stream()
            self._access.refresh()

    def _run_sweep_or_stream(self) -> None:
        why = self._sweep_or_oom()
        if why is not None:
            # Out of the handler, so the error and its traceback are gone and with them what
            # the failed attempt held (fp32 copies, staging clones, the sweep's handles).
            # Drain every evictable page and finish by streaming through a one- or two-page
            # window; pages updated before the error carry this step's id and are skipped.
            recover_from_oom(self._store, why)
            self._oom_recoveries += 1
            if self._pressure is None and self._store.device.type == "cuda":
                self._pressure = OccupancyControl(self._store)  # pages come back under 0.9
            try:
                self._run_sweep()
            except torch.OutOfMemoryError as exc:  # the step stays pending: finish_step()
                exc.add_note(
                    f"tightfit: out of memory again while finishing the step by streaming "
                    f"(the first: {why}); the step is pending: free memory, then call "
                    f"finish_step()"
                )
                raise
        if self._pressure is not None:
            self._pressure.after_step()

    def _sweep_or_oom(self) -> str | None:
        """Run the sweep; ``None`` when it completed, else the out-of-memory error's line.

        Only the line leaves the handler: the retry must not run while the error (its
        traceback, the failed attempt's frames and their tensors) is still alive.
        """
        try:
            self._run_sweep()
        except torch.OutOfMemoryError as exc:
            return oom_reason(exc)
        return None

    def _run_sweep(self) -> None:
        pages = [
            page
            for gi, pages in enumerate(self._group_pages)
            for page in pages
            if any(self.param_groups[gi]["params"][s.param].grad is not None
                   for s in page.segments)
        ]  # fmt: skip
        sweep(self._store, pages, self._pending_step, self._update_pages)  # type: ignore[arg-type]
        self._pending_step = None

    def _update_pages(self, items: list[tuple[Page, dict[str, torch.Tensor]]]) -> None:
        # The sweep calls this once per layout (one group, param dtype and state arrays).
        first = items[0][0]
        group = self.param_groups[first.group]
        params = group["params"]
        staged = update_lists.staging(params, items, self._maybe_staged, self._access.orders)

        def lists(bucket: list[tuple[Page, dict[str, torch.Tensor]]]) -> update_lists.Lists | None:
            return update_lists.bucket_lists(
                self.state, params, bucket, self._view_limit,
                self._view_cache.for_step(self._step_id), self._access.orders, staged,
            )  # fmt: skip

        scale = self._grad_scale  # None when the kernel unscales itself:
        scale = None if scale is None or self._takes_grad_scale(group) else scale
        if first.dtype in upcast.LOW_PRECISION:
            # fp32 state for bf16/fp16 params: fp32 copies of a page's worth at a time
            def done(pages: list[Page]) -> None:  # a later run raised: these stay updated
                update_lists.unstage(params, staged, self._access.orders)
                mark_done(pages, self._pending_step)  # type: ignore[arg-type]

            upcast.update_in_runs(items, lists, lambda *a: self._update(group, *a),
                                  grad_scale=scale, done=done)  # fmt: skip
        else:
            got = lists(items)
            if got is None:
                return
            flat, grads, states, steps = got
            if scale is not None:
                grads = [g / scale.to(g.device) for g in grads]  # unscaled copies: never in place
            self._update(group, flat, grads, states, steps)
        update_lists.unstage(params, staged, self._access.orders)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Free every page, stop the copy worker and delete the spill files (idempotent)."""
        if not self._closed:
            self._closed = True
            self._access.forget()
            if self._pressure is not None:
                self._pressure.close()
            if self._finalizer is not None:
                self._finalizer()
            self.state.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed; make a new optimizer")

    def __enter__(self) -> PagedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
