"""Paged8bitOptimizer: bitsandbytes-style blockwise 8-bit state on the paged optimizer core.

Layout per param (bitsandbytes' own, with its names): a param of at least ``min_8bit_size``
elements gets ``state1``/``state2`` as uint8 codes plus ``absmax1``/``absmax2`` (one fp32 per
256 elements), all in the same page, so a page moves and is updated with its scales; a smaller
param keeps ``state1``/``state2`` in fp32. Pages align to 256-element blocks (``unit``).

The update of an 8-bit segment is bitsandbytes' ``optimizer_update_8bit_blockwise`` kernel
called on the page views (dequantize → update → requantize, bitsandbytes' numerics), or, with
``backend="torch"`` (automatic where bitsandbytes has no kernel), dequantize in torch → the
subclass's fp32 math on all segments at once (torch's fused/foreach kernels) → quantize in
torch. 32-bit segments always take the fp32 math.

State dicts: :meth:`state_dict` returns the codes and absmax themselves (uint8/fp32 tensors;
a round trip is bit-exact); :meth:`torch_state_dict` returns torch's fp32 format
(dequantized, e.g. ``exp_avg``/``exp_avg_sq``); :meth:`load_state_dict` takes either, and
checks everything first — groups, params, each tensor's shape and dtype against the layout the
optimizer gives that param — before groups, steps and pages are written, so a bad state dict
leaves the optimizer as it was.
``optimizer.state[p]`` shows bitsandbytes' names: ``state1``/``state2`` (codes shaped like
the param, or fp32), ``absmax1``/``absmax2`` and, for 8-bit params, the maps ``qmap1``/``qmap2``.

torch's flags: ``foreach``/``fused`` choose torch's kernels for the fp32 math (small params,
and the ``backend="torch"`` path); the 8-bit update is bitsandbytes' kernel either way.
``capturable``/``differentiable`` cannot be honoured and raise. Complex and float64 params are
refused (``TypeError``), as bitsandbytes' 8-bit optimizers have no kernel for them.

FSDP2 (DTensor) params: the 8-bit-or-fp32 decision uses the param's global size (every rank and
a single process decide alike); the pages hold the rank's local shard in 256-element blocks of
the flattened shard, and the update runs on local views. Block scales of local shards cannot
follow the param's placements, so with any DTensor param :meth:`state_dict` returns torch's
fp32 format with each state tensor a DTensor laid out like its param (what DCP reshards).
Loaded torch-format DTensor state (from ``set_optimizer_state_dict``, resharded by DCP) is
checked against the param's placements and local shape and quantized into the pages; native
codes and absmax describe blocks of one layout of the param and are never resharded, so they
are taken only as plain tensors the size of the rank's shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from tightfit.optim import quant8, torch_format
from tightfit.optim.base import PagedOptimizer
from tightfit.optim.dtensor import is_dtensor, like_param, local_state, local_tensor
from tightfit.optim.element_order import PLAIN
from tightfit.optim.optimizer_options import check_keywords
from tightfit.optim.param_groups import common_device, intake
from tightfit.optim.update_lists import Group, StateLists, Tensors
from tightfit.paging.layout import StateSpec

# bitsandbytes >= 0.45 nests its codes/absmax under this key (to hide them from FSDP)
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"
# the native arrays and bitsandbytes' maps (constants: never loaded, never kept as entries)
_NATIVE = ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")


class Paged8bitOptimizer(PagedOptimizer):
    """Base of the paged 8-bit optimizers; subclasses set the class attributes and the math.

    Subclass contract: ``kernel`` (bitsandbytes' optimizer name, ``"adam"``/``"lion"``),
    ``torch_names`` (torch state names of state1[, state2]), ``_check_group`` and
    ``_update_fp32(group, params, grads, states, steps)`` on fp32 lists (states keyed
    ``state1``/``state2``), and ``_kernel_args(group) -> (beta1, beta2, eps, weight_decay)``.

    Args:
        params: params or param-group dicts.
        defaults: the subclass's default hyperparameters.
        min_8bit_size: params with fewer elements keep fp32 state (bitsandbytes: 4096).
        backend: ``"auto"`` (bitsandbytes' kernel where it has one, else torch),
            ``"bitsandbytes"`` or ``"torch"``.
        **paging_kw: the paging and pressure keywords of
            :class:`~tightfit.optim.base.PagedOptimizer` (``paging=PagingOptions(...)`` or
            its fields, ``target``, ``probe``).
    """

    unit = quant8.BLOCKSIZE
    kernel: ClassVar[str] = "adam"
    torch_names: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        min_8bit_size: int = quant8.MIN_8BIT_SIZE,
        backend: quant8.Backend = "auto",
        **paging_kw: Any,
    ) -> None:
        check_keywords(type(self).__name__, paging_kw)  # an unknown keyword raises first
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int):
            raise TypeError(f"min_8bit_size={min_8bit_size!r} must be an int (e.g. 4096)")
        if min_8bit_size < 0:
            raise ValueError(f"min_8bit_size={min_8bit_size} is negative; pass e.g. 4096")
        self._check_group(defaults)  # before the backend is resolved (the base checks again)
        params = intake(params)
        self._backend = quant8.resolve_backend(backend, common_device(params))
        self._min_8bit_size = min_8bit_size
        super().__init__(params, defaults, **paging_kw)
        if self._backend == "torch":  # its fp32 temporaries stay about one page in size
            self._view_limit = max(self._paging.page_bytes // 2, quant8.BLOCKSIZE)

    @property
    def _maps(self) -> list[torch.Tensor]:
        """bitsandbytes' signed and unsigned maps on the pages' device (cached per device)."""
        device = self._store.device
        return [quant8.dynamic_map(True, device), quant8.dynamic_map(False, device)]

    @property
    def backend(self) -> str:
        """The kernel family in use: ``"bitsandbytes"`` or ``"torch"``."""
        return self._backend

    @property
    def min_8bit_size(self) -> int:
        """Params with fewer elements keep fp32 state."""
        return self._min_8bit_size

    # ------------------------------------------------------------------ layout
    def _check_param(self, param: torch.Tensor) -> None:
        if param.is_complex() or param.dtype == torch.float64:
            raise TypeError(
                f"{type(self).__name__} keeps 8-bit state for float32/bfloat16/float16 params "
                f"(bitsandbytes has no kernel for {param.dtype}); use PagedAdamW / PagedLion "
                "for it, or cast the param"
            )

    def _constant_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        if not quant8.is_8bit(param.numel(), self._min_8bit_size):
            return {}
        return {f"qmap{i}": self._maps[i - 1] for i in range(1, self._n_states() + 1)}

    def _init_kwargs(self) -> dict[str, Any]:
        return {**super()._init_kwargs(), "min_8bit_size": self._min_8bit_size,
                "backend": self._backend}  # fmt: skip

    def _n_states(self) -> int:
        return len(self.torch_names)

    def _state_specs(self, group: dict[str, Any]) -> list[StateSpec]:
        specs = []
        for i in range(1, self._n_states() + 1):
            specs += [
                StateSpec(f"state{i}", torch.uint8),
                StateSpec(f"absmax{i}", torch.float32, quant8.BLOCKSIZE),
            ]
        return specs

    def _param_specs(self, group: dict[str, Any], param: torch.Tensor) -> list[StateSpec]:
        # A DTensor's numel() is the global size: every rank (and a single process) gives the
        # param the same layout, so a state dict means the same on any number of ranks.
        if quant8.is_8bit(param.numel(), self._min_8bit_size):
            return self._state_specs(group)
        return [StateSpec(f"state{i}", torch.float32) for i in range(1, self._n_states() + 1)]

    # ------------------------------------------------------------------ the update
    def _kernel_args(self, group: dict[str, Any]) -> tuple[float, float, float, float]:
        raise NotImplementedError

    def _update_fp32(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        raise NotImplementedError

    def _kernel_grad(
        self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor
    ) -> torch.Tensor:
        """The gradient handed to bitsandbytes' kernel (a subclass may fold in L2 decay)."""
        return grad

    def _update(
        self, group: Group, params: Tensors, grads: Tensors, states: StateLists, steps: Tensors
    ) -> None:
        if "absmax1" not in states:  # params below min_8bit_size: fp32 state
            self._update_fp32(group, params, grads, states, steps)
            return
        if self._backend == "torch":
            # Dequantized fp32 copies exist for at most about one page of elements at a time,
            # so the torch path never holds the whole resident state in fp32.
            limit = max(self._paging.page_bytes // 2, quant8.BLOCKSIZE)
            chunk: list[int] = []
            size = 0
            for k, p in enumerate(params):
                chunk.append(k)
                size += p.numel()
                if size >= limit or k == len(params) - 1:
                    self._update_torch_chunk(group, chunk, params, grads, states, steps)
                    chunk, size = [], 0
            return
        n = self._n_states()
        ops = quant8.bnb_ops()
        beta1, beta2, eps, wd = self._kernel_args(group)
        lr = self._host.scalar(group["lr"])
        counts = self._host_counts(steps)
        two = n == 2
        qmap1, qmap2 = self._maps
        with quant8.bnb_stream_order(params[0].device):  # bnb launches on the legacy stream
            for k, (p, g) in enumerate(zip(params, grads)):
                ops.optimizer_update_8bit_blockwise(
                    self.kernel, self._kernel_grad(group, p, g), p,
                    states["state1"][k], states["state2"][k] if two else None,
                    beta1, beta2, 0.0, 0.0, eps, int(counts[k]), lr,
                    qmap1, qmap2 if two else None,
                    states["absmax1"][k], states["absmax2"][k] if two else None,
                    wd, 1.0, False,
                )  # fmt: skip

    def _host_counts(self, steps: list[torch.Tensor]) -> list[int]:
        """Each step tensor's count as an int, read from the device once per optimizer step
        (:class:`~tightfit.optim.host_reads.HostReads`): bitsandbytes' kernel takes the count
        as a number, and a read per update call would synchronize a GPU once per streamed
        page, stalling the copies behind it."""
        return [int(c) for c in self._host.counts(steps)]

    def _update_torch_chunk(
        self, group: Group, idx: list[int], params: Tensors, grads: Tensors, states: StateLists,
        steps: Tensors,
    ) -> None:  # fmt: skip
        """Dequantize segments ``idx`` in torch, run the fp32 math on them, quantize back."""
        names = [f"state{i}" for i in range(1, self._n_states() + 1)]
        fp32 = {
            name: [
                quant8.dequantize_torch(states[name][k], states[f"absmax{i}"][k], self._maps[i - 1])
                for k in idx
            ]
            for i, name in enumerate(names, 1)
        }
        self._update_fp32(
            group, [params[k] for k in idx], [grads[k] for k in idx], fp32, [steps[k] for k in idx]
        )
        for i, name in enumerate(names, 1):
            for v, k in zip(fp32[name], idx):
                quant8.quantize_torch(v, self._maps[i - 1], states[name][k], states[f"absmax{i}"][k])

    # ------------------------------------------------------------------ state dicts
    def _gather(self, dequantized: bool) -> dict[int, dict[str, torch.Tensor]]:
        """Per param index: its state arrays, native (codes/absmax) or dequantized fp32."""
        index = {id(p): i for i, p in torch_format.indexed_params(self).items()}
        out: dict[int, dict[str, torch.Tensor]] = {}
        n = self._n_states()
        cpu_maps = [quant8.dynamic_map(True), quant8.dynamic_map(False)]  # pages are read to CPU
        for page in self._store.pages:
            group = self.param_groups[page.group]
            live = [s for s in page.segments if torch_format.has_state(self, group["params"][s.param])]
            if not live:
                continue  # torch keeps no state for a param that never had a gradient
            views = page.segment_views(self._store.read_page(page))
            for k, seg in enumerate(page.segments):
                p = group["params"][seg.param]
                if not torch_format.has_state(self, p):
                    continue
                numel = local_tensor(p).numel()  # the pages hold this rank's shard
                slot = out.setdefault(index[id(p)], {})
                lo, hi = seg.start, seg.start + seg.length
                eight = "absmax1" in views
                for i in range(1, n + 1):
                    codes = views[f"state{i}"][k]
                    if dequantized:
                        name = self.torch_names[i - 1]
                        dst = slot.setdefault(name, torch.empty(numel))
                        dst[lo:hi] = (
                            quant8.dequantize_torch(codes, views[f"absmax{i}"][k], cpu_maps[i - 1])
                            if eight
                            else codes
                        )
                        continue
                    dst = slot.setdefault(f"state{i}", torch.empty(numel, dtype=codes.dtype))
                    dst[lo:hi] = codes
                    if eight:
                        am = slot.setdefault(f"absmax{i}", torch.empty(quant8.blocks(numel)))
                        am[lo // self.unit : lo // self.unit + quant8.blocks(seg.length)] = views[
                            f"absmax{i}"
                        ][k]
        return out

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _state_dict_as(self, dequantized: bool) -> dict[str, Any]:
        sd = torch_format.pack(self)  # param_groups + the plain entries (step, ...), no hooks
        params = torch_format.indexed_params(self)
        for i, arrays in self._gather(dequantized).items():
            entry = sd["state"][i]
            entry["step"] = entry["step"].detach().to("cpu", torch.float32, copy=True)
            shape = local_tensor(params[i]).shape
            for name, t in arrays.items():
                if name.startswith("absmax"):
                    entry[name] = t
                elif dequantized:  # a DTensor with the param's placements (identity if plain)
                    entry[name] = like_param(t.view(shape), params[i])
                else:
                    entry[name] = t.view(shape)
        return sd

    def _has_dtensor(self) -> bool:
        """Whether any param is a DTensor (then state dicts must be in torch's format)."""
        return any(is_dtensor(p) for p in self._all_params())

    def state_dict(self) -> dict[str, Any]:  # the hooks run in the base; this documents it
        """Native state dict: per param ``step``, ``state1``/``state2`` (uint8 codes shaped like
        the param, or fp32 below ``min_8bit_size``) and ``absmax1``/``absmax2`` (fp32, one per
        256 elements). Loading it into the same class continues bit-identically.

        With any DTensor (FSDP2) param it is :meth:`torch_state_dict` instead: the absmax of
        blocks of a local shard cannot follow the param's placements, so DCP could not reshard
        native state; dequantized fp32 DTensor state it can. torch's state-dict hooks run.
        """
        return super().state_dict()

    def _state_dict(self) -> dict[str, Any]:
        return self._state_dict_as(dequantized=self._has_dtensor())

    def torch_state_dict(self) -> dict[str, Any]:
        """The state in torch's fp32 format, dequantized (e.g. ``torch.optim.AdamW``'s
        ``exp_avg``/``exp_avg_sq``); :meth:`load_state_dict` takes it back (quantizing). For a
        DTensor param each state tensor is a DTensor with the param's placements; ``step`` is
        a plain tensor, as in torch's optimizers."""
        self._check_open()
        self._access.flush()
        return self._state_dict_as(dequantized=True)

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Load a native (:meth:`state_dict`) or torch-format (:meth:`torch_state_dict`, or a
        torch optimizer's) state dict; everything is checked before anything changes."""
        _check_and_load(self, state_dict)


# ---------------------------------------------------------------------------- loading
def _merged_groups(opt: Paged8bitOptimizer, state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    saved_groups = torch_format.check_saved_groups(
        opt, state_dict, "optimizer.state_dict() or torch_state_dict()"
    )
    merged_groups = []
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        torch_format.check_group_params(gi, group, saved)
        keep = {*group, "param_names"}  # a saved group's names are kept, as torch keeps them
        merged = {k: v for k, v in saved.items() if k in keep and k != "params"}
        merged = {**group, **merged, "params": group["params"]}
        if isinstance(merged.get("betas"), list):
            merged["betas"] = tuple(merged["betas"])
        opt._validate_group(merged)
        merged_groups.append(merged)
    return merged_groups


def _check_entry(opt: Paged8bitOptimizer, key: Any, p: torch.Tensor, entry: Any) -> str:
    """The entry's format (``"native"`` or ``"torch"``), or ValueError naming what is wrong."""
    if not isinstance(entry, dict) or "step" not in entry:
        raise ValueError(f"state of param {key} lacks 'step'; pass a full optimizer state dict")
    if isinstance(entry.get(_BNB_WRAPPED), dict):  # a bitsandbytes 8-bit optimizer's state dict
        entry.update(entry.pop(_BNB_WRAPPED))
    n = len(opt.torch_names)
    eight = quant8.is_8bit(p.numel(), opt.min_8bit_size)  # global size, as the layout decides
    numel = local_tensor(p).numel()  # what the pages hold (the whole param unless a DTensor)
    if "state1" in entry:
        fmt, names = "native", [f"state{i}" for i in range(1, n + 1)]
    elif all(t in entry for t in opt.torch_names):
        fmt, names = "torch", list(opt.torch_names)
    else:
        raise ValueError(
            f"state of param {key} has keys {sorted(entry)}; expected {type(opt).__name__}'s "
            f"native keys (state1, absmax1, ...) or torch's {list(opt.torch_names)}"
        )
    want = torch.uint8 if (fmt == "native" and eight) else None
    if fmt == "native" and any(is_dtensor(v) for v in entry.values()):
        raise ValueError(
            f"state of param {key} holds DTensor 8-bit codes/absmax, which cannot be resharded; "
            f"load the torch format ({type(opt).__name__}.state_dict() under FSDP2 writes it)"
        )
    for name in names:
        t = entry.get(name)
        if fmt == "torch" and is_dtensor(t):
            # DCP resharded it to this rank: the local shard (placements and shape checked)
            t = entry[name] = local_state(t, p)
        if not isinstance(t, torch.Tensor) or t.numel() != numel:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"state {name!r} of param {key} has shape {shape} but the param has shape "
                f"{tuple(local_tensor(p).shape)}; the state dict is for another parameter layout"
            )
        torch_format.check_state_tensor(key, name, t, p, PLAIN)  # read flat, in row-major order
        if fmt == "native" and (t.dtype == torch.uint8) != (want == torch.uint8):
            raise ValueError(
                f"state {name!r} of param {key} is {t.dtype} but this optimizer keeps "
                f"{'8-bit' if eight else 'fp32'} state for it; build the optimizer with the "
                "saved min_8bit_size"
            )
    if fmt == "native" and eight:
        for i in range(1, n + 1):
            a = entry.get(f"absmax{i}")
            if not isinstance(a, torch.Tensor) or a.numel() != quant8.blocks(numel):
                raise ValueError(
                    f"state of param {key} needs absmax{i} with {quant8.blocks(numel)} "
                    "values (one per 256 elements); the state dict is for another layout"
                )
            torch_format.check_state_tensor(key, f"absmax{i}", a, p, PLAIN)
    return fmt


def _check_and_load(opt: Paged8bitOptimizer, state_dict: dict[str, Any]) -> None:
    """Validate ``state_dict`` against ``opt`` completely, then load it into the pages."""
    new_groups = _merged_groups(opt, state_dict)
    id_to_param: dict[Any, torch.Tensor] = {}
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        id_to_param.update(zip(saved["params"], group["params"]))
    loaded: dict[int, tuple[str, dict[str, Any]]] = {}
    others = torch_format.other_keys(state_dict, id_to_param)
    steps = {}
    for key, entry in state_dict["state"].items():
        if key in others:
            continue
        entry = dict(entry) if isinstance(entry, dict) else entry  # never change the caller's
        p = id_to_param[key]
        fmt = _check_entry(opt, key, p, entry)
        loaded[id(p)] = (fmt, entry)
        consumed = [*_NATIVE, *opt.torch_names, *opt._access.names(p)]
        step = torch_format.checked_step(key, entry["step"])
        steps[id(p)] = (step, torch_format.plain_entries(entry, consumed))
    # Everything checked: now change things.
    torch_format.replace_groups_and_steps(opt, new_groups, steps, others)
    store = opt.pager
    n = len(opt.torch_names)
    maps = [quant8.dynamic_map(True), quant8.dynamic_map(False)]
    for page in store.pages:
        group = opt.param_groups[page.group]
        buf = torch.zeros(page.nbytes, dtype=torch.uint8)
        views = page.segment_views(buf)
        eight = "absmax1" in views
        for k, seg in enumerate(page.segments):
            item = loaded.get(id(group["params"][seg.param]))
            if item is None:
                continue
            fmt, entry = item
            lo, hi = seg.start, seg.start + seg.length
            b0 = lo // opt.unit
            for i in range(1, n + 1):
                codes = views[f"state{i}"][k]
                if fmt == "native":
                    codes.copy_(entry[f"state{i}"].detach().reshape(-1)[lo:hi].cpu())
                    if eight:
                        am = views[f"absmax{i}"][k]
                        am.copy_(entry[f"absmax{i}"].detach().reshape(-1)[b0 : b0 + am.numel()])
                    continue
                values = entry[opt.torch_names[i - 1]].detach().reshape(-1)[lo:hi]
                values = values.to("cpu", torch.float32)
                if eight:
                    quant8.quantize_torch(values, maps[i - 1], codes, views[f"absmax{i}"][k])
                else:
                    codes.copy_(values)
        store.write_page(page, buf)
    opt._clear_pending_step()
