"""``optimizer.state[p]`` of a paged optimizer: torch's per-param state, read from the pages.

torch code reads and writes ``optimizer.state[p]["exp_avg"]`` (bitsandbytes-style code
``state[p]["state1"]``, ``["absmax1"]``, ``["qmap1"]``); in a paged optimizer those arrays live
in pages on some tier. :class:`ParamState` is the mapping stored as ``optimizer.state[p]``:
``step`` (and any key you add) are plain entries, the paged arrays are read on demand:

* **a view** when the param's state lies in one page that is on the device tier: reads and
  writes go straight to the page, as with torch's own tensors. A view stays valid until its
  page moves (pressure eviction, an OOM recovery, a re-plan); read ``state[p][name]`` again
  after such a move;
* **a copy** otherwise (the page is on a slower tier, or the param spans several pages),
  shaped like the param, on the param's device, costing the param's state bytes for as long
  as it is held. Reading it reads the param's pages from their tier (one page-size temporary
  at a time for pages off the device); nothing else is loaded, so the paging budget holds.
  In-place edits of a copy are written back to the pages once the copy is dropped (at the
  next access to the optimizer's state: ``state[p]``, ``step()``, ``state_dict()``,
  ``save()``; never from inside a garbage-collector callback) or, for a copy still held, at
  the next ``step()``, ``state_dict()`` or ``save()`` (a load replaces the state: the copy
  then shows the loaded values) (a write to a page off the device is a read-modify-write of that
  page on its tier), and a copy still held after a step or a load is refreshed from the pages,
  so it follows the state at step granularity as torch's tensors do;
* assigning ``state[p][name] = tensor`` writes the values into the pages (the same
  read-modify-write for pages off the device).

``copy.deepcopy`` and pickling of a :class:`ParamState` give a plain ``dict`` of copies.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tightfit.optim.dtensor import like_param, local_tensor
from tightfit.optim.element_order import PLAIN, ElementOrder, real_numel
from tightfit.paging.layout import Page
from tightfit.paging.store import PageStore


class StateOwner(Protocol):
    """What :class:`StateAccess` needs of its optimizer (``tightfit.optim.base``)."""

    @property
    def pager(self) -> PageStore: ...

    def _constant_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def _state_replaced(self) -> None: ...


@dataclass
class _Tracked:
    """A copy handed out: its memory (``shadow`` shares storage and version counter with the
    tensor the caller holds) and the version its values were last in sync with the pages."""

    param: torch.Tensor
    name: str
    shadow: torch.Tensor
    version: int


class StateAccess:
    """Reads and writes the paged arrays of single params for :class:`ParamState`.

    Args:
        owner: the optimizer (held weakly: a copy you hold does not keep it alive).
    """

    def __init__(self, owner: StateOwner) -> None:
        self._owner = weakref.ref(owner)
        self._segments: dict[int, list[tuple[Page, int]]] = {}
        self._orders: dict[int, ElementOrder] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._keys = itertools.count()
        # dropped copies with edits: written back at the next access (a finalizer runs at any
        # moment, e.g. in the middle of a page move, so it only queues them)
        self._deferred: list[_Tracked] = []

    # ------------------------------------------------------------------ index
    def index(self, params: list[torch.Tensor], pages: list[Page], orders: list[ElementOrder]) -> None:
        """Record where the state of ``params`` (one group's, in group order) lives."""
        for p, order in zip(params, orders):
            self._orders[id(p)] = order
        for page in pages:
            for k, seg in enumerate(page.segments):
                self._segments.setdefault(id(params[seg.param]), []).append((page, k))

    def order(self, p: torch.Tensor) -> ElementOrder:
        """The element order of ``p``'s pages."""
        return self._orders.get(id(p), PLAIN)

    @property
    def orders(self) -> dict[int, ElementOrder]:
        """Element order per ``id(param)`` (read by the update's view builder)."""
        return self._orders

    def paged_names(self, p: torch.Tensor) -> list[str]:
        """The names of ``p``'s arrays in its pages (none when it has no pages)."""
        segs = self._segments.get(id(p))
        return list(segs[0][0].arrays) if segs else []

    def names(self, p: torch.Tensor) -> list[str]:
        """The state names ``state[p]`` shows beyond its plain entries: the paged arrays and
        the optimizer's constants (an 8-bit layout's quantization maps)."""
        return self.paged_names(p) + list(self._constants(p))

    def _constants(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        owner = self._owner()
        return {} if owner is None else owner._constant_state(p)

    def _store(self) -> PageStore:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the optimizer of this state was deleted")
        return owner.pager

    # ------------------------------------------------------------------ reads
    def read(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """``name`` of ``p``'s state: a view of a device-tier page, else a tracked copy."""
        constants = self._constants(p)
        if name in constants:
            return constants[name]
        self._write_deferred()
        store = self._store()
        store.engine.synchronize()  # between steps every copy has landed; be sure
        segs = self._segments[id(p)]
        page, k = segs[0]
        if len(segs) == 1 and page.tier == "device":
            flat = page.segment_views(store.arrays(page))[name][k]
            # the spill file's copy (if any) goes stale as soon as the view is written
            page.spill_valid = False
            return self._shape(p, name, flat)
        flat = self._gather(store, p, name)
        out = self._shape(p, name, flat)
        self._track(out, p, name, flat)
        return out

    def _gather(self, store: PageStore, p: torch.Tensor, name: str) -> torch.Tensor:
        segs = self._segments[id(p)]
        _, _, dtype, block = segs[0][0].arrays[name]
        flat = torch.empty(-(-real_numel(p) // block), dtype=dtype, device=p.device)
        self._fill(store, p, name, flat)
        return flat

    def _fill(self, store: PageStore, p: torch.Tensor, name: str, flat: torch.Tensor) -> None:
        for page, k in self._segments[id(p)]:
            data = store.arrays(page) if page.tier == "device" else store.read_page(page)
            view = page.segment_views(data)[name][k]
            lo = page.segments[k].start // page.arrays[name][3]
            flat[lo : lo + view.numel()] = view

    def _shape(self, p: torch.Tensor, name: str, flat: torch.Tensor) -> torch.Tensor:
        block = self._segments[id(p)][0][0].arrays[name][3]
        if block != 1:
            return flat  # per-block values (absmax): one per `block` elements, flat
        return like_param(self.order(p).shaped(flat, p), p)

    # ------------------------------------------------------------------ writes
    def write(self, p: torch.Tensor, name: str, value: Any) -> None:
        """Write ``value`` (shaped like the param, or flat per-block values) into the pages."""
        if name in self._constants(p):
            raise ValueError(
                f"{name!r} is the fixed quantization map of this optimizer (bitsandbytes' "
                "dynamic map) and cannot be changed; write state1/state2/absmax instead"
            )
        flat = self._flat_value(p, name, value)
        self._write_deferred()
        self._write_flat(p, name, flat)

    def _write_flat(self, p: torch.Tensor, name: str, flat: torch.Tensor) -> None:
        store = self._store()
        store.engine.synchronize()
        for page, k in self._segments[id(p)]:
            block = page.arrays[name][3]
            seg = page.segments[k]
            lo = seg.start // block
            part = flat[lo : lo + -(-seg.length // block)]
            if page.tier == "device":
                page.segment_views(store.arrays(page))[name][k].copy_(part)
                page.spill_valid = False
            else:  # read-modify-write of the page on its tier (one page-size temporary)
                buf = store.read_page(page)
                page.segment_views(buf)[name][k].copy_(part)
                store.write_page(page, buf)

    def _flat_value(self, p: torch.Tensor, name: str, value: Any) -> torch.Tensor:
        """``value`` checked against ``p``'s state array ``name``, flat in page order."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state[p][{name!r}] must be a Tensor, got {type(value).__name__}")
        _, _, dtype, block = self._segments[id(p)][0][0].arrays[name]
        value = local_tensor(value.detach())
        if block != 1:
            want = -(-real_numel(p) // block)
            if value.numel() != want:
                raise ValueError(
                    f"state[p][{name!r}] holds {want} values (one per {block} elements); got "
                    f"shape {tuple(value.shape)}: pass a tensor of {want} values"
                )
            return value.reshape(-1).to(dtype)
        order = self.order(p)
        shape = tuple(local_tensor(p).shape)
        if tuple(value.shape) != shape or value.is_complex() != order.complex:
            kind = "complex " if order.complex else ""
            raise ValueError(
                f"state[p][{name!r}] is a {kind}tensor of shape {shape}; got {value.dtype} of "
                f"shape {tuple(value.shape)}: pass a tensor shaped like the param"
            )
        return order.flat(value).to(dtype)

    # ------------------------------------------------------------------ tracked copies
    def _track(self, out: torch.Tensor, p: torch.Tensor, name: str, flat: torch.Tensor) -> None:
        key = next(self._keys)
        self._tracked[key] = _Tracked(p, name, flat.detach(), flat._version)
        weakref.finalize(out, _released, weakref.ref(self), key)

    def released(self, key: int) -> None:
        """A copy was dropped: queue its in-place edits for the next access."""
        rec = self._tracked.pop(key, None)
        if rec is not None and rec.shadow._version != rec.version:
            self._deferred.append(rec)

    def _write_deferred(self) -> None:
        while self._deferred:
            self._write_back(self._deferred.pop(0))

    def _write_back(self, rec: _Tracked) -> None:
        self._write_flat(rec.param, rec.name, rec.shadow)
        rec.version = rec.shadow._version

    def flush(self) -> None:
        """Write the in-place edits of every copy handed out back into the pages."""
        self._write_deferred()
        for rec in list(self._tracked.values()):
            if rec.shadow._version != rec.version:
                self._write_back(rec)

    def refresh(self) -> None:
        """Reload every copy still held from the pages (after a step or a load)."""
        self._deferred = []
        if not self._tracked:
            return
        store = self._store()
        for rec in list(self._tracked.values()):
            if id(rec.param) in self._segments:
                self._fill(store, rec.param, rec.name, rec.shadow)
                rec.version = rec.shadow._version

    def forget(self) -> None:
        """Stop tracking every copy (the optimizer closed: nothing is written back)."""
        self._tracked.clear()
        self._deferred = []


def _released(access_ref: weakref.ref, key: int) -> None:
    access = access_ref()
    if access is not None:
        access.released(key)


class ParamState(MutableMapping):
    """``optimizer.state[p]`` of a paged optimizer (see the module docstring).

    Args:
        access: the optimizer's :class:`StateAccess`.
        param: the param.
        items: the plain entries (``step`` and any other key stored as is).

    Attributes:
        plain: the plain entries, read without touching any page.
    """

    __slots__ = ("_access", "_param", "plain")

    def __init__(self, access: StateAccess, param: torch.Tensor, items: dict[str, Any]) -> None:
        self._access = access
        self._param = param
        self.plain = items

    def _paged(self) -> list[str]:
        return [n for n in self._access.names(self._param) if n not in self.plain]

    def __getitem__(self, key: str) -> Any:
        items = self.plain
        if key in items:
            return items[key]
        if key in self._access.names(self._param):
            return self._access.read(self._param, key)
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._access.names(self._param):
            self._access.write(self._param, key, value)
            return
        if key == "step":
            value = torch.as_tensor(value, dtype=torch.float32).to(self._param.device).clone()
            owner = self._access._owner()
            if owner is not None:
                owner._state_replaced()  # cached update lists hold the old step tensor
        self.plain[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self.plain:
            del self.plain[key]
            return
        if key in self._access.names(self._param):
            raise TypeError(
                f"{key!r} is paged state of this param and cannot be removed; zero it "
                f"(state[p][{key!r}].zero_()) or load a state dict instead"
            )
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self.plain or key in self._access.names(self._param)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.plain, *self._paged()])

    def __len__(self) -> int:
        return len(self.plain) + len(self._paged())

    def __repr__(self) -> str:
        paged = ", ".join(f"{n}=<paged>" for n in self._paged())
        plain = ", ".join(f"{k}={v!r}" for k, v in self.plain.items())
        return f"ParamState({', '.join(s for s in (plain, paged) if s)})"

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self.items()),))


def adopt(state: dict[Any, Any], access: StateAccess, p: torch.Tensor, entry: dict) -> ParamState:
    """``state[p]`` replaced by a :class:`ParamState` holding ``entry``: its paged names are
    written into the pages, the rest is kept as is (torch code sets ``state[p] = {...}``)."""
    st = ParamState(access, p, {})
    for key, value in entry.items():
        st[key] = value
    state[p] = st
    return st


def adopt_plain_states(state: dict[Any, Any], access: StateAccess) -> None:
    """Adopt every ``state[p]`` that is a non-empty plain dict (see :func:`adopt`)."""
    for key, value in list(state.items()):
        if isinstance(key, torch.Tensor) and type(value) is dict and value:
            adopt(state, access, key, value)


def step_tensor(state: dict[Any, Any], access: StateAccess, p: torch.Tensor) -> torch.Tensor:
    """``p``'s step count, starting its state (at 0) on its first update."""
    st = state.get(p)
    if type(st) is not ParamState:
        st = adopt(state, access, p, st or {})
    if "step" not in st.plain:
        st.plain["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    return st.plain["step"]
