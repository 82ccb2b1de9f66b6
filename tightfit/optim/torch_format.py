"""State of a paged optimizer in and out as torch-format state dicts, and what loads share.

Torch format (``{"state": {index: {"step", "exp_avg", ...}}, "param_groups": [...]}``) is what
``torch.optim.AdamW`` reads and writes, so a run can move between the two either way. Page
files (states too big for RAM) are :mod:`tightfit.optim.page_file`'s.

Every load converts and checks everything first — groups against the constructor's checks,
each param's state against its layout, each step count — and only then changes the
optimizer, so a refused load leaves params, state and hyperparameters as they were.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from tightfit.optim.dtensor import is_dtensor, like_param, local_state, local_tensor
from tightfit.optim.element_order import ElementOrder, real_numel
from tightfit.optim.param_state import ParamState, StateAccess
from tightfit.paging.layout import StateSpec
from tightfit.paging.store import PageStore


class PagedState(Protocol):
    """What this module needs of a paged optimizer (``tightfit.optim.base.PagedOptimizer``,
    which is also a ``torch.optim.Optimizer``): torch's groups and state, the page store, and
    the friend API documented there. Typed here so that this module never imports the
    optimizer's (which imports this one)."""

    param_groups: list[dict[str, Any]]
    state: Any  # torch's defaultdict: per param a ParamState, other keys as torch keeps them
    _access: StateAccess

    @property
    def pager(self) -> PageStore: ...

    def _state_specs(self, group: dict[str, Any]) -> list[StateSpec]: ...

    def _export_segment(
        self, group: dict[str, Any], views: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]: ...

    def _import_segment(
        self, group: dict[str, Any], values: dict[str, torch.Tensor], views: dict[str, torch.Tensor]
    ) -> None: ...

    def _validate_group(self, group: dict[str, Any]) -> None: ...

    def _clear_pending_step(self) -> None: ...

    def _new_param_state(self, param: torch.Tensor, items: dict[str, Any]) -> ParamState: ...

    def close(self) -> None: ...


def indexed_params(opt: PagedState) -> dict[int, torch.Tensor]:
    """Each param by its state-dict index (torch's rule: a param listed twice keeps its first)."""
    out: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    i = 0
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out[i] = p
            i += 1
    return out


def has_state(opt: PagedState, p: torch.Tensor) -> bool:
    """Whether ``p`` has started (torch keeps no state for a param that never had a grad)."""
    return type(opt.state.get(p)) is ParamState


def pack(opt: PagedState) -> dict[str, Any]:
    """torch's ``state_dict()`` layout without its hooks and without the paged arrays:
    ``param_groups`` (params as indices, ``param_names`` kept) and the plain state entries
    (``step`` and any key stored as is; keys that are no param pass through, as in torch)."""
    index = {id(p): i for i, p in reversed(list(indexed_params(opt).items()))}
    groups, start = [], 0
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
        start += len(packed["params"])
    state: dict[Any, Any] = {}
    for key, value in opt.state.items():
        if not isinstance(key, torch.Tensor):
            state[key] = value
        elif id(key) in index:
            state[index[id(key)]] = dict(value.plain if type(value) is ParamState else value)
    return {"state": state, "param_groups": groups}


def _params(opt: PagedState) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def to_torch(opt: PagedState) -> dict[str, Any]:
    """Gather the pages into a torch-format state dict (CPU tensors, fp32 state; float64 for
    float64 params; complex for complex params, shaped and strided like the param).

    For a DTensor (FSDP2) param the pages hold its local shard's state; each state tensor is
    returned as a DTensor with the param's placements, as torch's optimizers do, so DCP's
    ``get_optimizer_state_dict`` and ``dcp.save`` see the sharded layout.
    """
    sd = pack(opt)
    params = indexed_params(opt)
    index = {id(p): i for i, p in params.items()}
    full: dict[int, dict[str, torch.Tensor]] = {}
    for page in opt.pager.pages:
        group = opt.param_groups[page.group]
        data = None
        for k, seg in enumerate(page.segments):
            p = group["params"][seg.param]
            if not has_state(opt, p):
                continue  # torch keeps no state for a param that never had a gradient
            if data is None:
                data = page.segment_views(opt.pager.read_page(page))
            values = opt._export_segment(group, {n: vs[k] for n, vs in data.items()})
            slot = full.setdefault(index[id(p)], {})
            for name, v in values.items():
                dst = slot.setdefault(name, torch.empty(real_numel(p), dtype=v.dtype))
                dst[seg.start : seg.start + seg.length] = v[: seg.length]
    # pack() made new entry dicts; the step is copied, never shared with the live state
    steps = step_counts([sd["state"][i]["step"] for i in full])
    for (i, arrays), step in zip(full.items(), steps):
        p = params[i]
        order = opt._access.order(p)
        entry = sd["state"][i]
        entry["step"] = torch.tensor(step, dtype=torch.float32).reshape(entry["step"].shape)
        for name, flat in arrays.items():
            entry[name] = like_param(order.shaped(flat, p), p)
    return sd


def step_counts(steps: list[torch.Tensor]) -> list[float]:
    """The values of per-param step tensors, read with one ``tolist()`` per device: tightfit
    keeps each param's step on its device, and a read per param would be a device sync per
    param (issue 25 finding 12). A DTensor step is read on its own."""
    out: list[float] = [0.0] * len(steps)
    by_device: dict[torch.device, list[int]] = {}
    for k, s in enumerate(steps):
        if type(s) is torch.Tensor and s.numel() == 1:
            by_device.setdefault(s.device, []).append(k)
        else:
            out[k] = float(local_tensor(s).detach().reshape(-1)[0].item())
    for ks in by_device.values():
        values = torch.stack([steps[k].detach().reshape(()).double() for k in ks]).tolist()
        for k, v in zip(ks, values):
            out[k] = v
    return out


def plain_entries(entry: dict[str, Any], consumed: Any) -> dict[str, Any]:
    """The entries of a loaded per-param state that are kept as they are (torch keeps every
    key): all but the paged arrays ``consumed`` and ``step``."""
    return {k: v for k, v in entry.items() if k != "step" and k not in consumed}


def check_saved_groups(
    opt: PagedState, state_dict: Any, how: str = "optimizer.state_dict()"
) -> list[dict[str, Any]]:
    """The saved param groups of ``state_dict``, after checking it is a state dict with as
    many groups as ``opt`` (``how`` names what writes one, for the message)."""
    if not isinstance(state_dict, dict) or {"state", "param_groups"} - set(state_dict):
        raise ValueError(
            "not an optimizer state dict (needs 'state' and 'param_groups'); pass the result "
            f"of {how}"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"state dict has {len(saved_groups)} param groups but this optimizer has "
            f"{len(opt.param_groups)}; build the optimizer with the same groups as the saved one"
        )
    return saved_groups


def check_group_params(gi: int, group: dict[str, Any], saved: dict[str, Any]) -> None:
    """Saved group ``gi`` holds as many params as the optimizer's."""
    if len(saved["params"]) != len(group["params"]):
        raise ValueError(
            f"param group {gi} has {len(group['params'])} params but the state dict has "
            f"{len(saved['params'])}; load a state dict saved for the same model"
        )


def from_torch(opt: PagedState, state_dict: dict[str, Any]) -> None:
    """Load a torch-format state dict into the pages; checks everything before changing any."""
    saved_groups = check_saved_groups(opt, state_dict)
    id_to_param: dict[Any, torch.Tensor] = {}
    new_groups = []
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        check_group_params(gi, group, saved)
        id_to_param.update(zip(saved["params"], group["params"]))
        merged = {**{k: v for k, v in saved.items() if k != "params"}, "params": group["params"]}
        for k, v in group.items():  # keys the saved dict lacks keep their current value
            merged.setdefault(k, v)
        if isinstance(merged.get("betas"), list):
            merged["betas"] = tuple(merged["betas"])
        opt._validate_group(merged)
        specs = opt._state_specs(merged)
        if [s.name for s in specs] != [s.name for s in opt._state_specs(group)]:
            raise ValueError(
                f"param group {gi} was saved with state {[s.name for s in specs]} but this "
                f"optimizer pages {[s.name for s in opt._state_specs(group)]} (e.g. amsgrad "
                "differs); build the optimizer with the saved hyperparameters"
            )
        new_groups.append(merged)
    owner = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    loaded: dict[int, dict[str, Any]] = {}
    plains: dict[int, dict[str, Any]] = {}
    others = other_keys(state_dict, id_to_param)
    steps: dict[int, float] = {}
    for key, entry in state_dict["state"].items():
        if key in others:
            continue
        p = id_to_param[key]
        names = [s.name for s in opt._state_specs(new_groups[owner[id(p)]])]
        missing = [n for n in ["step", *names] if not isinstance(entry, dict) or n not in entry]
        if missing:
            raise ValueError(
                f"state of param {key} lacks {missing}; load a state dict of the same optimizer "
                "type (torch AdamW/Adam for PagedAdamW/PagedAdam)"
            )
        steps[id(p)] = checked_step(key, entry["step"])
        # DTensor state (from set_optimizer_state_dict, resharded by DCP) -> this rank's shard
        entry = {
            k: local_state(v, p) if k in names and is_dtensor(v) else v for k, v in entry.items()
        }
        lp = local_tensor(p)
        for n in names:
            t = entry[n]
            ok = isinstance(t, torch.Tensor) and t.numel() == lp.numel()
            if not ok or local_tensor(t).is_complex() != lp.is_complex():
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"state {n!r} of param {key} has shape {shape} but the param has shape "
                    f"{tuple(lp.shape)} ({lp.dtype}); the state dict is for another parameter "
                    "layout"
                )
            check_state_tensor(key, n, t, p, opt._access.order(p))
        loaded[id(p)] = entry
        plains[id(p)] = plain_entries(entry, [*names, *opt._access.names(p)])
    # Everything checked: now change things.
    replace_groups_and_steps(
        opt, new_groups, {k: (steps[k], plains[k]) for k in loaded}, others
    )
    for page in opt.pager.pages:
        group = opt.param_groups[page.group]
        buf = torch.zeros(page.nbytes, dtype=torch.uint8)
        views = page.segment_views(buf)
        for k, seg in enumerate(page.segments):
            p = group["params"][seg.param]
            entry = loaded.get(id(p))
            if entry is None:
                continue
            end = seg.start + seg.length
            order: ElementOrder = opt._access.order(p)
            values = {
                n: order.flat(entry[n].detach())[seg.start : end].to("cpu", vs[k].dtype)
                for n, vs in views.items()
            }
            opt._import_segment(group, values, {n: vs[k] for n, vs in views.items()})
        opt.pager.write_page(page, buf)
    opt._clear_pending_step()


def other_keys(state_dict: dict[str, Any], id_to_param: dict[Any, torch.Tensor]) -> dict[Any, Any]:
    """The state entries not keyed by a param, kept as they are (torch copies them as is);
    an int key that no group lists is a state dict for other params: ``ValueError``."""
    others = {}
    for key, entry in state_dict["state"].items():
        if key in id_to_param:
            continue
        if isinstance(key, int):
            raise ValueError(
                f"state dict has state for param {key!r}, which no group lists; load a state "
                "dict saved for the same params"
            )
        others[key] = entry
    return others


def checked_step(key: Any, step: Any) -> float:
    """A loaded step count as a float: a number or one-element real tensor, finite, >= 0.

    Raises:
        ValueError: anything else (``None``, text, NaN, a negative count), naming the param;
            a ``None`` taken as 0 would silently restart that param's bias correction.
    """
    value = step
    if isinstance(step, torch.Tensor):
        ok = step.numel() == 1 and step.device.type != "meta"
        ok = ok and not step.is_complex() and step.dtype != torch.bool
        value = step.item() if ok else None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value) and value >= 0:
        return float(value)
    shown = f"a tensor {tuple(step.shape)} {step.dtype}" if isinstance(step, torch.Tensor) else (
        repr(step) if len(repr(step)) < 40 else type(step).__name__)
    raise ValueError(
        f"state of param {key} has step {shown}; a step count must be a finite number >= 0 "
        "(a float or a one-element tensor, as torch saves it; a param that never stepped has "
        "no state entry at all): the saved state is damaged or was edited, load one the "
        "optimizer saved"
    )


def check_state_tensor(
    key: Any, name: str, t: torch.Tensor, p: torch.Tensor, order: ElementOrder
) -> None:
    """``t`` (state ``name`` of param ``key``, its size already checked) can be read into the
    pages in ``order``: real numbers in memory, shaped like the param where the pages permute
    its dims (``ValueError`` otherwise, so that loading never fails half done)."""
    lt = local_tensor(t)
    if lt.device.type == "meta" or lt.dtype == torch.bool or lt.is_quantized:
        raise ValueError(
            f"state {name!r} of param {key} is a {lt.dtype} tensor on {lt.device}, which holds "
            "no state values; load a state dict saved by an optimizer that stepped"
        )
    if order.perm is not None and tuple(lt.shape) != tuple(local_tensor(p).shape):
        raise ValueError(
            f"state {name!r} of param {key} has shape {tuple(lt.shape)} but the param has shape "
            f"{tuple(local_tensor(p).shape)}; state tensors must be shaped like their param"
        )


def replace_groups_and_steps(
    opt: PagedState,
    groups: list[dict[str, Any]],
    steps: dict[int, tuple[float, dict[str, Any]]],
    others: dict[Any, Any] | None = None,
) -> None:
    """Allocate the pages, then install checked ``groups``, each param's step count and
    plain entries (``steps`` keyed by ``id(param)``: ``(step, entries)``, the step checked by
    :func:`checked_step`; a param without one gets no state, as in torch) and the state kept
    under other keys (``others``). Nothing here can refuse: call it once all is checked."""
    opt.pager.materialize()
    for gi, merged in enumerate(groups):
        opt.param_groups[gi].clear()
        opt.param_groups[gi].update(merged)
    opt.state.clear()
    for key, value in (others or {}).items():
        opt.state[key] = value
    for p in _params(opt):
        item = steps.get(id(p))
        if item is not None:
            step, entries = item
            step_t = torch.tensor(step, dtype=torch.float32, device=p.device)
            opt.state[p] = opt._new_param_state(p, {"step": step_t, **entries})
