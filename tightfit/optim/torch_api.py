"""torch.optim.Optimizer's state API on a paged optimizer: state dicts with their hooks,
page files, and copying or pickling the optimizer.

A mixin of :class:`~tightfit.optim.base.PagedOptimizer`. ``state_dict()`` and
``load_state_dict()`` run every hook registered with torch's
``register_state_dict_pre_hook`` / ``_post_hook`` and ``register_load_state_dict_pre_hook`` /
``_post_hook`` (``prepend=True`` included) in torch's order, around the paged work the
subclass supplies (:meth:`TorchAPI._state_dict` / :meth:`TorchAPI._load`). ``copy.deepcopy``
and ``pickle`` rebuild a working optimizer: the same class with the same paging options over the
copied params, loaded with the state (step hooks, like torch's, are not copied).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tightfit.optim import page_file, torch_format
from tightfit.optim.dtensor import local_tensor
from tightfit.optim.param_state import StateAccess

Hooks = dict[int, Any]


class TorchAPI:
    """``state_dict``/``load_state_dict`` (hooks run), ``save``/``load``, pickling."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    _access: StateAccess
    _view_cache: dict[Any, Any]
    _optimizer_state_dict_pre_hooks: Hooks
    _optimizer_state_dict_post_hooks: Hooks
    _optimizer_load_state_dict_pre_hooks: Hooks
    _optimizer_load_state_dict_post_hooks: Hooks

    def _check_open(self) -> None:  # pragma: no cover - the base defines these
        raise NotImplementedError

    def _check_groups(self, for_step: bool) -> None:  # pragma: no cover
        raise NotImplementedError

    def _follow_device(self, action: str | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def _adopt_plain_states(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def _init_kwargs(self) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------ subclass hooks
    def _state_dict(self) -> dict[str, Any]:
        """The state dict itself, without hooks (default: torch's format from the pages)."""
        return torch_format.to_torch(self)  # type: ignore[arg-type]

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Validate ``state_dict`` completely, then load it (no hooks; default: torch's
        format into the pages)."""
        torch_format.from_torch(self, state_dict)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """Torch-format state dict (e.g. ``torch.optim.AdamW``'s), gathered from the pages.

        A snapshot: CPU tensors, not the live state (``optimizer.state[p]`` is that). The
        state-dict pre hooks run first, then the post hooks; in-place edits a post hook makes
        to the paged tensors are written back into the pages, as they would reach torch's
        live state.
        """
        self._check_open()
        self._check_groups(for_step=False)
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._adopt_plain_states()
        self._access.flush()
        sd = self._state_dict()
        if self._optimizer_state_dict_post_hooks:
            versions = _versions(self, sd)
            for post_hook in self._optimizer_state_dict_post_hooks.values():
                result = post_hook(self, sd)
                if result is not None:
                    sd = result
            self._write_back_edits(versions)
        return sd

    def _write_back_edits(self, versions: list[tuple[torch.Tensor, str, torch.Tensor, int]]) -> None:
        for p, name, t, version in versions:
            if local_tensor(t)._version != version:
                self._access.write(p, name, t)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format state dict (torch's or a paged optimizer's); paging is kept.

        Runs the load-state-dict pre hooks (which may return a replacement), checks the whole
        state dict before changing anything, loads it, then runs the post hooks.
        """
        self._check_open()
        self._check_groups(for_step=True)
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch: hooks may edit the top level
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._follow_device("load_state_dict()")
        self._view_cache.clear()  # the step tensors are replaced
        self._load(state_dict)
        self._access.refresh()  # copies still held follow the loaded state
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ------------------------------------------------------------------ page files
    def save(self, path: str | os.PathLike) -> None:
        """Write the state page by page to ``path`` (atomically: temp file + rename)."""
        self._check_open()
        self._check_groups(for_step=True)
        self._adopt_plain_states()
        self._access.flush()
        page_file.save(self, path)  # type: ignore[arg-type]

    def load(self, path: str | os.PathLike) -> None:
        """Read a file written by :meth:`save` for the same params, page by page.

        The file is refused whole (``ValueError`` for another layout or hyperparameters the
        constructor refuses, :class:`~tightfit.integrity.checksums.CorruptStateError` for bytes
        that do not match their checksums) before anything changes; see
        :mod:`tightfit.optim.page_file`.
        """
        self._check_open()
        self._check_groups(for_step=True)
        self._follow_device("load()")
        self._view_cache.clear()  # the step tensors are replaced
        page_file.load(self, path)  # type: ignore[arg-type]
        self._access.refresh()

    # ------------------------------------------------------------------ copy and pickle
    def __getstate__(self) -> dict[str, Any]:
        self._check_open()
        self._check_groups(for_step=True)
        self._adopt_plain_states()
        self._access.flush()
        return {
            "tightfit": self._init_kwargs(),  # paging options and the subclass's own
            "defaults": self.defaults,
            "param_groups": self.param_groups,  # with the params (copied with the optimizer)
            "state_dict": self._state_dict(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "tightfit" not in state:
            raise TypeError(
                f"not a pickled {type(self).__name__} (no paging options); rebuild the "
                "optimizer and load its state_dict() instead"
            )
        groups = [dict(g) for g in state["param_groups"]]
        type(self).__init__(self, groups, **state["tightfit"])  # type: ignore[misc]
        self.defaults = state["defaults"]
        self._load(state["state_dict"])


def _versions(
    opt: TorchAPI, sd: dict[str, Any]
) -> list[tuple[torch.Tensor, str, torch.Tensor, int]]:
    """``(param, name, tensor, version)`` of every paged tensor of state dict ``sd``."""
    params = torch_format.indexed_params(opt)  # type: ignore[arg-type]
    out = []
    for key, entry in sd["state"].items():
        p = params.get(key) if isinstance(key, int) else None
        if p is None or not isinstance(entry, dict):
            continue
        for name in opt._access.paged_names(p):
            t = entry.get(name)
            if isinstance(t, torch.Tensor):
                out.append((p, name, t, local_tensor(t)._version))
    return out
