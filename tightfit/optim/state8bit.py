"""Loading state dicts into the paged 8-bit optimizers (native codes or torch's fp32 format).

Everything is checked first — groups, params, each tensor's shape and dtype against the layout
the optimizer gives that param — and only then are groups, steps and pages written, so a bad
state dict leaves the optimizer as it was.

For a DTensor (FSDP2) param the torch format's state may be DTensors (from
``set_optimizer_state_dict``, resharded by DCP): their local shards, checked against the
param's placements and local shape, are quantized into the pages. Native codes and absmax
describe blocks of one layout of the param and are never resharded, so they are taken only as
plain tensors the size of the rank's shard.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tightfit.optim import quant8, state_io
from tightfit.optim.dtensor import is_dtensor, local_state, local_tensor
from tightfit.optim.flat import PLAIN


class Paged8bitState(state_io.PagedState, Protocol):
    """What this module needs of a paged 8-bit optimizer
    (``tightfit.optim.paged8bit.Paged8bitOptimizer``, which imports this module): a
    :class:`~tightfit.optim.state_io.PagedState` with its 8-bit layout's constants."""

    unit: int
    torch_names: tuple[str, ...]

    @property
    def min_8bit_size(self) -> int: ...


# bitsandbytes >= 0.45 nests its codes/absmax under this key (to hide them from FSDP)
_BNB_WRAPPED = "__bnb_optimizer_quant_state__"
# the native arrays and bitsandbytes' maps (constants: never loaded, never kept as entries)
_NATIVE = ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")


def _check_groups(opt: Paged8bitState, state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    saved_groups = state_io.check_saved_groups(
        opt, state_dict, "optimizer.state_dict() or torch_state_dict()"
    )
    merged_groups = []
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        state_io.check_group_params(gi, group, saved)
        keep = {*group, "param_names"}  # a saved group's names are kept, as torch keeps them
        merged = {k: v for k, v in saved.items() if k in keep and k != "params"}
        merged = {**group, **merged, "params": group["params"]}
        if isinstance(merged.get("betas"), list):
            merged["betas"] = tuple(merged["betas"])
        opt._validate_group(merged)
        merged_groups.append(merged)
    return merged_groups


def _check_entry(opt: Paged8bitState, key: Any, p: torch.Tensor, entry: Any) -> str:
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
        state_io.check_state_tensor(key, name, t, p, PLAIN)  # read flat, in row-major order
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
            state_io.check_state_tensor(key, f"absmax{i}", a, p, PLAIN)
    return fmt


def check_and_load(opt: Paged8bitState, state_dict: dict[str, Any]) -> None:
    """Validate ``state_dict`` against ``opt`` completely, then load it into the pages."""
    new_groups = _check_groups(opt, state_dict)
    id_to_param: dict[Any, torch.Tensor] = {}
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        id_to_param.update(zip(saved["params"], group["params"]))
    loaded: dict[int, tuple[str, dict[str, Any]]] = {}
    others = state_io.other_keys(state_dict, id_to_param)
    steps = {}
    for key, entry in state_dict["state"].items():
        if key in others:
            continue
        entry = dict(entry) if isinstance(entry, dict) else entry  # never change the caller's
        p = id_to_param[key]
        fmt = _check_entry(opt, key, p, entry)
        loaded[id(p)] = (fmt, entry)
        consumed = [*_NATIVE, *opt.torch_names, *opt._access.names(p)]
        step = state_io.checked_step(key, entry["step"])
        steps[id(p)] = (step, state_io.plain_entries(entry, consumed))
    # Everything checked: now change things.
    state_io.replace_groups_and_steps(opt, new_groups, steps, others)
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
