"""Params and param groups of a paged optimizer: what the constructor and ``add_param_group``
take, and how a group's state is cut into pages.

The checks (:func:`intake`, :func:`group_params`, :func:`common_device`,
:func:`check_group_params`) raise before anything changes (no page, no param group), where
torch refuses the same input with torch's exception type and words, then the fix.
:class:`GroupLayout`, a mixin of :class:`~tightfit.optim.base.PagedOptimizer`:
:meth:`GroupLayout.add_param_group` validates a group (torch's rules and words first, then
the optimizer's), takes ``(name, param)`` pairs as torch does (``param_names``), and cuts the
group's state into pages, one run per state layout; :meth:`GroupLayout._check_groups` adopts
groups appended to ``param_groups`` behind the optimizer's back.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tightfit.optim.dtensor import check_param
from tightfit.optim.element_order import order_of, real_numel
from tightfit.optim.param_state import StateAccess
from tightfit.paging.layout import Page, StateSpec, build_pages
from tightfit.paging.paging_options import PagingOptions
from tightfit.paging.store import PageStore

_WIDE = (torch.float64, torch.complex128)  # torch keeps their state in float64


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
    allowed; any strides: :mod:`tightfit.optim.element_order` decides their element order)."""
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


class GroupLayout:
    """``add_param_group`` with page layout, and the check of ``param_groups``."""

    unit: ClassVar[int]
    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    _store: PageStore
    _access: StateAccess
    _paging: PagingOptions
    _group_pages: list[list[Page]]
    _group_params: list[list[torch.Tensor]]
    _maybe_staged: set[int]

    def _follow_device(self, action: str | None) -> None:  # pragma: no cover - the base's
        raise NotImplementedError

    def _param_specs(self, group: dict[str, Any], param: torch.Tensor) -> list[StateSpec]:
        raise NotImplementedError  # pragma: no cover - the base's

    def _check_group(self, group: dict[str, Any]) -> None:  # pragma: no cover - the base's
        raise NotImplementedError

    def _check_param(self, param: torch.Tensor) -> None:  # pragma: no cover - the base's
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated first) and lay out its state pages."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        params, names = group_params(group["params"])
        group["params"] = params
        if names is not None:
            group["param_names"] = names
        self._follow_device(None)
        merged = {**self.defaults, **group}
        check_group_params(params, self._store.device)
        for p in params:
            self._check_param(p)
        self._check_group(merged)
        # Params may need different state arrays (an 8-bit layout keeps small params in 32
        # bit): one run of pages per distinct layout; a layout without arrays gets no pages.
        layouts = [tuple(self._layout_specs(merged, p)) for p in params]
        orders = [order_of(p) for p in params]
        n_before = len(self.param_groups)
        super().add_param_group(group)  # type: ignore[misc]  # torch's Optimizer's
        if len(self.param_groups) == n_before:  # pragma: no cover - torch raised instead
            return
        g = len(self.param_groups) - 1
        pg = self.param_groups[g]
        pages: list[Page] = []
        for layout in dict.fromkeys(layouts):
            if not layout:
                continue
            numels = [real_numel(p) if k == layout else 0 for p, k in zip(pg["params"], layouts)]
            pages += build_pages(
                g, numels, [p.dtype for p in pg["params"]], list(layout), self.unit,
                self._paging.page_bytes, first_index=len(self._store.pages) + len(pages),
            )  # fmt: skip
        self._group_pages.append(pages)
        self._group_params.append(pg["params"])
        self._access.index(pg["params"], pages, orders)
        self._maybe_staged.update(
            id(p) for p, o in zip(params, orders) if not (o.plain and p.is_contiguous())
        )
        self._store.add_pages(pages)

    def _layout_specs(self, group: dict[str, Any], param: torch.Tensor) -> list[StateSpec]:
        specs = self._param_specs(group, param)
        if param.dtype not in _WIDE:
            return specs
        wide = torch.float64
        return [StateSpec(s.name, wide if s.dtype == torch.float32 else s.dtype, s.block)
                for s in specs]  # fmt: skip

    def _check_groups(self, for_step: bool) -> None:
        """``param_groups`` edited directly: a group appended with new params is laid out
        (as :meth:`add_param_group` would); what cannot be paged raises."""
        groups, n = self.param_groups, len(self._group_pages)
        if len(groups) < n:
            raise ValueError(
                f"param_groups has {len(groups)} groups but this optimizer laid out {n}: groups "
                "cannot be removed from a paged optimizer; build a new optimizer instead"
            )
        for i in range(n):
            if groups[i]["params"] is not self._group_params[i]:
                if [id(p) for p in groups[i]["params"]] != [id(p) for p in self._group_params[i]]:
                    raise ValueError(
                        f"param_groups[{i}]['params'] was replaced by other params; the pages "
                        "are laid out for the old ones: add new params with add_param_group() "
                        "or build a new optimizer"
                    )
                self._group_params[i] = groups[i]["params"]
        if len(groups) == n:
            return
        known = {id(p) for g in groups[:n] for p in g["params"]}
        extra = groups[n:]
        if any(id(p) in known for g in extra for p in group_params(g["params"])[0]):
            if for_step:
                raise ValueError(
                    f"param_groups[{n}:] list params of earlier groups (was param_groups "
                    "extended with its own groups?): a paged param belongs to one group; "
                    "remove those groups, or add new params with add_param_group()"
                )
            return  # state_dict() packs them as torch does (repeated params: first index)
        del groups[n:]
        for g in extra:  # appended directly: validate and lay out as add_param_group does
            self.add_param_group(g)

