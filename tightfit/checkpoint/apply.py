"""Installing a plan on a model, and taking it off again exactly.

A checkpointed segment of consecutive blocks is recomputed as one unit although the model's
own loop calls its blocks one by one (``for layer in self.layers: h = layer(h, **kw)``).
Each block's ``forward`` is patched: the segment's first block opens a non-reentrant
checkpoint frame (torch's ``_checkpoint_without_reentrant_generator``, the generator behind
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``), every block's call is
recorded with its keyword arguments (attention masks, position embeddings, …), and the last
block closes the frame. In backward, torch recomputes the frame by replaying the recorded
calls, feeding each block the replayed output of the block before it. RNG state is
preserved by torch, so dropout masks match. Only the first block's inputs are kept.

The replay calls each block as a module (``block(*args, **kwargs)``), so the module hooks on
the blocks run in the recompute as in forward: FSDP2's unshard (``reshard_after_forward=True``),
``PressureWatch``'s pre-forward check, user hooks. While a runner replays, its patched
``forward`` steps aside and runs the original, so the replay opens no frame of its own.

A plan with offloaded segments also gets an :class:`~tightfit.checkpoint.offload.Offloader`:
a ``checkpoint_offload`` frame saves its input through the offloader's hooks, the blocks of
a ``stored_offload`` segment run their forward under them, and schedule hooks on the segment
boundaries (:func:`~tightfit.checkpoint.offload.schedule_hooks`) retire writes and prefetch
one segment ahead.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn

from tightfit.checkpoint.offload import (
    Offloader,
    param_storages,
    schedule_hooks,
    shared_storages,
    stored_forward,
    tier_of,
)
from tightfit.checkpoint.plan import OffloadTier, Plan, Segment
from tightfit.checkpoint.selective import selective_context_fn

STATE_ATTR = "_tightfit_checkpoint"
_MISSING = object()


@dataclass
class _Link:
    """Placeholder for an argument that was output ``index`` of the previous block."""

    index: int


class SegmentRunner:
    """Runs consecutive blocks inside one non-reentrant checkpoint frame.

    With an ``offloader`` (a ``checkpoint_offload`` segment, number ``index`` of the plan),
    the frame's saved input goes to the next tier.
    """

    def __init__(self, segment: Segment, offloader: Offloader | None = None,
                 index: int = 0) -> None:
        self.segment = segment
        self.offloader, self.index = offloader, index
        self._frame_hooks: Any = None
        self.context_fn = selective_context_fn if segment.kind == "selective" else noop_context_fn
        self._gen: Any = None
        self._calls: list[tuple[nn.Module, Any, list[Any] | None]] = []
        self._prev_ids: dict[int, int] = {}
        # Depth of replays in progress (on any thread): while > 0 the patched forwards run the
        # originals, because the call came from torch's recompute through ``block.__call__``.
        self._replaying = 0
        self._replay_out: Any = None
        self._pending: tuple[int, tuple, dict] | None = None

    def capture_for(self, pos: int) -> Callable[..., None]:
        """A forward pre-hook (prepended) keeping the ``pos``-th block's call as made.

        The replay calls the block as a module, so its pre-hooks run again there: it must be
        fed the arguments from before them, not the ones its ``forward`` received, or a
        pre-hook that edits them would act twice.
        """

        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._replaying:
                self._pending = (pos, args, kwargs)

        return hook

    def forward_for(self, pos: int, block: nn.Module, original: Callable) -> Callable:
        """The replacement ``forward`` of the segment's ``pos``-th block ``block``."""

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._replaying:  # torch's recompute, through block.__call__ and its hooks
                self._replay_out = original(*args, **kwargs)
                return self._replay_out
            raw, self._pending = self._pending, None
            if raw is None or raw[0] != pos:  # forward called directly, past the hooks
                raw = (pos, args, kwargs)
            return self._call(pos, block, original, args, kwargs, raw[1], raw[2])

        forward.__tightfit_original__ = original  # type: ignore[attr-defined]
        return forward

    def _call(self, pos: int, block: nn.Module, fn: Callable, args: tuple, kwargs: dict,
              call_args: tuple, call_kwargs: dict) -> Any:
        # args/kwargs: what the block's forward gets; call_*: what the block was called with
        # (before its pre-hooks), which the replay passes to block.__call__.
        if pos == 0:
            self.finish()  # a frame left open by an interrupted forward
            if torch.is_grad_enabled():
                self._open(block, call_args, call_kwargs)
        if self._gen is None:  # no grad (eval / inference): nothing to checkpoint
            return fn(*args, **kwargs)
        if pos == 0:
            self._calls.append((block, None, None))
        else:
            leaves, spec = tree_flatten((call_args, call_kwargs))
            # Never hold the previous block's output here: that would keep the activations
            # checkpointing is meant to drop. The replay feeds the recomputed one instead.
            leaves = [_Link(self._prev_ids[id(x)]) if id(x) in self._prev_ids else x
                      for x in leaves]
            self._calls.append((block, spec, leaves))
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            self.abort()
            raise
        if pos == len(self.segment) - 1:
            self.finish()
        else:
            outs, _ = tree_flatten(out)
            self._prev_ids = {id(t): i for i, t in enumerate(outs) if isinstance(t, torch.Tensor)}
        return out

    def _open(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        calls: list[tuple[nn.Module, Any, list[Any] | None]] = []
        # early_stop=False: the replay runs every block to its end, so the hooks that follow
        # a block's forward run in the recompute too (torch would otherwise stop inside the
        # segment's last block, after its last saved tensor; what is left is a residual add).
        gen = _checkpoint_without_reentrant_generator(
            functools.partial(self._replay, calls), True, self.context_fn, "default", False,
            False, *args, **kwargs,
        )
        # The frame saves the segment's (positional) inputs when it opens, under the hooks
        # on top of the stack then: the offloader's, for a checkpoint_offload segment. The
        # frame pushes its own hooks above them for the segment's forward, and pops them
        # when it closes; ours are popped after that (finish / abort), keeping the stack in
        # order. (Exiting ours right after the open would pop the frame's instead.)
        if self.offloader is not None:
            self._frame_hooks = self.offloader.hooks(self.index, param_storages(block)
                                                     | shared_storages((args, kwargs),
                                                                       self.segment.start == 0))
            self._frame_hooks.__enter__()
        try:
            next(gen)
        except BaseException:
            self._pop_frame_hooks()
            raise
        self._gen, self._calls, self._prev_ids = gen, calls, {}

    def _pop_frame_hooks(self) -> None:
        hooks, self._frame_hooks = self._frame_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def finish(self) -> None:
        """Close the open frame normally (its forward is complete)."""
        gen, self._gen, self._prev_ids, self._pending = self._gen, None, {}, None
        if gen is not None:
            try:
                with contextlib.suppress(StopIteration):
                    next(gen)
            finally:
                self._pop_frame_hooks()

    def abort(self) -> None:
        """Close the open frame after an exception in its forward."""
        gen, self._gen, self._prev_ids, self._pending = self._gen, None, {}, None
        if gen is not None:
            try:
                gen.close()
            finally:
                self._pop_frame_hooks()

    def _replay(self, calls: list[tuple[nn.Module, Any, list[Any] | None]], *args: Any,
                **kwargs: Any) -> Any:
        """Recompute a segment: the recorded block calls, chained through their outputs.

        Each block is called as a module, so its hooks run; the patched forward sees
        ``_replaying`` and runs the original block forward.
        """
        out: Any = None  # the previous block's forward output (before its forward hooks)
        self._replaying += 1
        try:
            for block, spec, leaves in calls:
                if spec is None:
                    block(*args, **kwargs)
                else:
                    prev, _ = tree_flatten(out)
                    a, kw = tree_unflatten(
                        [prev[x.index] if isinstance(x, _Link) else x for x in leaves], spec
                    )
                    block(*a, **kw)
                out, self._replay_out = self._replay_out, None
        finally:
            self._replaying -= 1
        return out


@dataclass
class _Applied:
    plan: Plan
    blocks: list[nn.Module]
    saved_forwards: list[Any]
    runners: list[SegmentRunner]
    hook: Any
    capture_hooks: list[Any]
    config_use_cache: Any = _MISSING
    offloader: Offloader | None = None
    schedule: list[Any] = field(default_factory=list)


def is_enabled(model: nn.Module) -> bool:
    """Whether a tightfit checkpoint plan is installed on ``model``."""
    return isinstance(getattr(model, STATE_ATTR, None), _Applied)


def install(model: nn.Module, blocks: list[nn.Module], plan: Plan) -> None:
    """Patch ``blocks`` so the checkpointed segments of ``plan`` recompute in backward."""
    saved = [b.__dict__.get("forward", _MISSING) for b in blocks]
    runners: list[SegmentRunner] = []
    captures: list[Any] = []
    offloader = _offloader_for(plan, blocks) if plan.offload else None
    for j, seg in enumerate(plan.segments):
        if seg.kind == "stored":
            continue
        if seg.kind == "stored_offload":
            assert offloader is not None
            for i in range(seg.start, seg.stop):
                blocks[i].forward = stored_forward(offloader, j, blocks[i], blocks[i].forward,
                                                   first_block=i == 0)
            continue
        runner = SegmentRunner(seg, offloader if seg.kind == "checkpoint_offload" else None, j)
        runners.append(runner)
        for pos, i in enumerate(range(seg.start, seg.stop)):
            blocks[i].forward = runner.forward_for(pos, blocks[i], blocks[i].forward)
            captures.append(blocks[i].register_forward_pre_hook(
                runner.capture_for(pos), prepend=True, with_kwargs=True))

    def _close_frames(*_: Any) -> None:
        # The model's forward has returned (or raised): no frame may stay open, even when
        # the loop skipped the segment's last block.
        for r in runners:
            r.finish()

    hook = model.register_forward_hook(_close_frames, always_call=True)
    state = _Applied(plan, blocks, saved, runners, hook, captures, offloader=offloader)
    if offloader is not None:
        state.schedule = schedule_hooks(offloader, model, blocks, plan.segments,
                                        lambda: any(r._replaying for r in runners))
    config = getattr(model, "config", None)
    moves = plan.checkpointed_blocks or plan.offload
    if moves and config is not None and getattr(config, "use_cache", False):
        # (and a KV cache keeps the keys and values an offloaded segment saves alive on the
        # device until the forward ends: offloading them would free nothing)
        warnings.warn(
            "tightfit.checkpoint: setting model.config.use_cache=False — a KV cache written in "
            "forward would be written again by the recompute, and would keep offloaded keys and "
            "values on the device; disable() restores it.",
            stacklevel=3,
        )
        state.config_use_cache = config.use_cache
        config.use_cache = False
    object.__setattr__(model, STATE_ATTR, state)


def _offloader_for(plan: Plan, blocks: list[nn.Module]) -> Offloader:
    device = next((p.device for b in blocks for p in b.parameters()), torch.device("cpu"))
    tier = plan.tier
    if tier is None:  # a fixed plan made without a profile: the device's next tier
        name, overlap = tier_of(device)
        tier = OffloadTier(name, 0.0, overlap)
    return Offloader(device, tier, len(plan.segments), plan.host_bytes)


def installed(model: nn.Module) -> tuple[Plan, list[nn.Module]] | None:
    """The installed plan and the blocks it is installed on (``None`` if none)."""
    state = getattr(model, STATE_ATTR, None)
    return (state.plan, state.blocks) if isinstance(state, _Applied) else None


@contextlib.contextmanager
def suspended(model: nn.Module) -> Iterator[Plan | None]:
    """Take the installed plan off for the block and put it back on the same blocks."""
    previous = installed(model)
    uninstall(model)
    try:
        yield None if previous is None else previous[0]
    finally:
        if previous is not None:
            install(model, previous[1], previous[0])


def uninstall(model: nn.Module) -> Plan | None:
    """Undo :func:`install` exactly; return the plan that was installed (``None`` if none)."""
    state = getattr(model, STATE_ATTR, None)
    if not isinstance(state, _Applied):
        return None
    for r in state.runners:
        r.abort()
    for block, fwd in zip(state.blocks, state.saved_forwards):
        if fwd is _MISSING:
            block.__dict__.pop("forward", None)
        else:
            block.forward = fwd
    state.hook.remove()
    for h in (*state.capture_hooks, *state.schedule):
        h.remove()
    if state.offloader is not None:
        state.offloader.close()  # its buffers and spill files go
    if state.config_use_cache is not _MISSING:
        model.config.use_cache = state.config_use_cache
    object.__delattr__(model, STATE_ATTR)
    return state.plan
