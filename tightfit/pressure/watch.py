"""Target occupancy: the limit the pager keeps a device under, and the hooks that watch it.

Optimizer state is not needed during forward and backward, so it is the first thing that can
make room when activations spike (a long sequence, an odd batch, the recompute of a
checkpointed segment). :class:`PressureWatch` installs cheap hooks on a model's blocks — a
forward pre-hook, and a backward "pre-hook" (a hook on the block output's gradient, which fires
before the block's backward runs) — that read a :class:`~tightfit.pressure.probes.Probe` and call
back with the bytes to free when the headroom under the target falls below a margin, i.e.
*before* the next block allocates.

Reading a probe costs system calls (on the CPU ~25-70 µs for the cgroup or RSS on a small,
loaded VM, plus ~26 µs for the high-water mark; measured in docs/pressure.md), so checks are
rate-limited:
at most one per ``min_interval_s`` while the last reading left plenty of headroom, every hook
call once it did not. Without pressure the cost is therefore bounded by
``read_cost / min_interval_s`` plus a few microseconds of Python per hook.

Example::

    watch = PressureWatch(model, probe, target_bytes, on_pressure=pager.evict_bytes)
    ...
    watch.remove()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tightfit.model.blocks import find_blocks
from tightfit.pressure.probes import Probe

__all__ = ["PressureWatch", "WatchStats", "find_watch_blocks"]

#: ``on_pressure(need_bytes, reason) -> freed_bytes``.
PressureCallback = Callable[[int, str], int]


def find_watch_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to watch: the model's chain of blocks, then its output head.

    The blocks are the checkpoint planner's chain (:func:`tightfit.model.blocks.find_blocks`,
    a transformer's decoder layers). The output head (``get_output_embeddings()`` on Hugging
    Face models) is added because its logits are often the largest single allocation of a
    step. A model without a chain of blocks is watched through its direct children.
    """
    try:
        blocks = find_blocks(model)
    except ValueError:
        blocks = list(model.children())
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module) and all(head is not b for b in blocks):
        blocks.append(head)
    return blocks or [model]


@dataclass
class WatchStats:
    """What watching did and cost.

    Attributes:
        hook_calls: Hook invocations (forward and backward).
        reads: Probe readings taken (the rest were skipped by the rate limit).
        triggers: Readings that found the headroom below the margin and called back.
        freed_bytes: Bytes the callback reported freed, in total.
        max_growth_bytes: Largest increase of usage seen between two consecutive readings
            (from the earlier reading to the later one, or to the probe's high-water mark
            in between when it has one: see ``Probe.interval_peak_bytes``).
        time_s: Wall time spent inside the hooks (installing the gradient hooks included),
            callbacks included.
        callback_s: The part of ``time_s`` spent in the callback (the evictions it asked
            for, which the pager also counts as its own time on pressure).
    """

    hook_calls: int = 0
    reads: int = 0
    triggers: int = 0
    freed_bytes: int = 0
    max_growth_bytes: int = 0
    time_s: float = 0.0
    callback_s: float = 0.0


class PressureWatch:
    """Hooks on a model's blocks that free memory before the device passes its target.

    Args:
        model: The model to watch.
        probe: Reads the device's usage.
        target_bytes: Usage the device should stay under.
        on_pressure: Called as ``on_pressure(need_bytes, reason)`` when a reading leaves less
            than ``margin`` under the target; returns the bytes it freed. ``reason`` names the
            hook, e.g. ``"forward:model.layers.3"`` or ``"backward:model.layers.3"``.
        margin_bytes: Headroom to keep under the target at each check — it must cover what the
            model allocates between two checks. ``None`` adapts: the larger of 1/16 of the
            target and twice the largest growth seen between consecutive readings.
        min_interval_s: Minimum time between readings while headroom is plentiful (more than
            twice the margin). Readings are never skipped below that.
        blocks: Modules to hook; ``None`` uses :func:`find_watch_blocks`.

    Raises:
        ValueError: ``target_bytes`` is not positive, ``margin_bytes`` is negative or not below
            the target, or ``min_interval_s`` is negative.
        TypeError: ``model`` is not an ``nn.Module`` or ``on_pressure`` is not callable.
    """

    def __init__(
        self,
        model: nn.Module,
        probe: Probe,
        target_bytes: int,
        on_pressure: PressureCallback,
        *,
        margin_bytes: int | None = None,
        min_interval_s: float = 0.005,
        blocks: Iterable[nn.Module] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch() needs an nn.Module, got {type(model).__name__}.")
        if not callable(on_pressure):
            raise TypeError("on_pressure must be callable as on_pressure(need_bytes, reason).")
        if int(target_bytes) <= 0:
            raise ValueError(f"target_bytes must be positive, got {target_bytes}.")
        if margin_bytes is not None and not 0 <= int(margin_bytes) < int(target_bytes):
            raise ValueError(
                f"margin_bytes must be in [0, target_bytes={target_bytes}), got {margin_bytes}; "
                "it is the headroom kept under the target, or None to adapt it."
            )
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}.")
        self.probe = probe
        self.target_bytes = int(target_bytes)
        self.on_pressure = on_pressure
        self.fixed_margin = None if margin_bytes is None else int(margin_bytes)
        self.min_interval_s = float(min_interval_s)
        self.stats = WatchStats()
        self._last_read_t = -float("inf")
        self._last_used: int | None = None
        # since end_step(): the least room a reading left above its margin, less what the
        # step had freed before it (so: relative to the state resident when the step began),
        # and the bytes freed; the pager learns from it how much state a step like it holds
        self._step_slack: int | None = None
        self._step_freed = 0
        # Growth is learned per interval (named by the check that starts it) and per size of
        # step (tokens, from a watched block's [..., T, hidden] input): the interval that
        # allocates the head's gradient needs its headroom, the others do not, and a long
        # batch's growth does not make every short step keep its headroom.
        self._tokens = 0  # this step's (since end_step), 0 when the inputs do not say
        self._growth: dict[str, dict[int, int]] = {}  # reason -> {token bucket: growth}
        self._last_reason: str | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        names = {id(m): n for n, m in model.named_modules()}
        for block in find_watch_blocks(model) if blocks is None else blocks:
            name = names.get(id(block), type(block).__name__) or "model"
            self._handles.append(block.register_forward_pre_hook(self._forward_pre(name)))
            self._handles.append(block.register_forward_hook(self._forward_post(name)))

    # -- policy ------------------------------------------------------------------------
    @property
    def margin_bytes(self) -> int:
        """The step-wide margin: fixed, or the larger of 1/16 of the target and twice the
        largest growth seen between two readings. Checks keep it for an interval they know
        nothing of yet (:meth:`margin_at`)."""
        return self.margin_for(0)

    def margin_for(self, tokens: int) -> int:
        """The largest margin any check of a step of ``tokens`` tokens (0: unknown) keeps.

        Fixed when ``margin_bytes`` was given; else the larger of 1/16 of the target and twice
        the largest growth forecast for an interval of such a step (:meth:`margin_at`), or
        twice the largest growth seen while nothing is known of that size.
        """
        if self.fixed_margin is not None:
            return self.fixed_margin
        forecasts = [self._forecast(r, tokens) for r in self._growth] if tokens else []
        grows = [_cushion(g, exact) for g, exact in filter(None, forecasts)]
        grow = max(grows) if grows else 2 * self.stats.max_growth_bytes
        return max(self.target_bytes // 16, grow)

    def margin_at(self, reason: str) -> int:
        """Headroom a check of ``reason`` keeps for the step in progress: the growth forecast
        until the next check (:meth:`_forecast`) with a cushion (a quarter for a size seen
        before, as much again for one extrapolated), at least 1/16 of the target; for an
        interval never read, the largest of any interval (:meth:`margin_for`)."""
        if self.fixed_margin is not None:
            return self.fixed_margin
        f = self._forecast(reason, self._tokens) if self._tokens else None
        if f is None:  # an interval not read yet (the rate limit skips some)
            return self.margin_for(self._tokens)
        return max(self.target_bytes // 16, _cushion(*f))

    def _forecast(self, reason: str, tokens: int) -> tuple[int, bool] | None:
        """``(growth, seen at this size)`` expected in the interval after ``reason`` for a
        step of ``tokens`` tokens: the largest seen at that size (power-of-two bucket), else
        the nearest smaller size scaled up by tokens, else the nearest larger size as seen
        (never scaled down)."""
        seen = self._growth.get(reason)
        if not seen or not tokens:
            return None
        b = _bucket(tokens)
        if b in seen:
            return seen[b], True
        lower = [k for k in seen if k < b]
        if lower:
            k = max(lower)
            return int(seen[k] * tokens / k), False
        return seen[min(seen)], False

    def check(self, reason: str, *, force: bool = False) -> int:
        """Read the probe (unless rate-limited) and call back if headroom is short.

        Args:
            reason: Recorded with any eviction, e.g. ``"forward:model.layers.3"``.
            force: Read even inside the rate limit.

        Returns:
            Bytes freed by the callback (0 when no reading or no pressure).
        """
        t0 = time.perf_counter()
        st = self.stats
        st.hook_calls += 1
        margin = self.margin_at(reason)
        plenty = self._last_used is None or (
            self.target_bytes - self._last_used > 2 * margin
        )
        if not force and plenty and t0 - self._last_read_t < self.min_interval_s:
            st.time_s += time.perf_counter() - t0
            return 0
        used = self.probe.used_bytes()
        st.reads += 1
        # growth since the last reading, including a transient peak in between when the probe
        # has a high-water mark that saw one (a block's temporaries freed before this hook)
        high = max(used, self.probe.interval_peak_bytes() or 0)
        if self._last_used is not None and high > self._last_used:
            growth = high - self._last_used
            st.max_growth_bytes = max(st.max_growth_bytes, growth)
            if self._tokens and self._last_reason is not None:
                seen = self._growth.setdefault(self._last_reason, {})
                b = _bucket(self._tokens)
                seen[b] = max(seen.get(b, 0), growth)
            margin = self.margin_at(reason)
        freed = 0
        room = self.target_bytes - margin - used
        rel = room - self._step_freed
        self._step_slack = rel if self._step_slack is None else min(self._step_slack, rel)
        need = -room
        if need > 0:
            st.triggers += 1
            t_cb = time.perf_counter()
            freed = int(self.on_pressure(int(need), reason))
            st.callback_s += time.perf_counter() - t_cb
            st.freed_bytes += freed
            self._step_freed += freed
            used -= freed
        self._last_used = used
        self._last_reason = reason
        self._last_read_t = time.perf_counter()
        st.time_s += self._last_read_t - t0
        return freed

    def reset(self) -> None:
        """Forget the last reading (call between steps so growth is measured within one)."""
        self._last_used = None
        self._last_reason = None
        self._last_read_t = -float("inf")

    def end_step(self) -> tuple[int | None, int]:
        """``(room, bytes freed)`` of the step since the previous call; starts
        counting again. The room is the smallest ``target - margin - reading`` of its checks,
        each less the bytes freed before it (``None`` without a reading): how many more bytes
        of state than it began with a step like it could have held without evicting.

        The pager calls it between backward and the update.
        """
        out = (self._step_slack, self._step_freed)
        self._step_slack, self._step_freed, self._tokens = None, 0, 0
        return out

    # -- hooks -------------------------------------------------------------------------
    def _forward_pre(self, name: str) -> Callable[..., None]:
        reason = f"forward:{name}"

        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.dim() >= 2:
                # [batch, T, hidden] or [T, hidden]: the tokens this step runs through
                self._tokens = max(self._tokens, x.numel() // x.shape[-1])
            self.check(reason)

        return hook

    def _forward_post(self, name: str) -> Callable[..., None]:
        # A hook on the output's gradient runs when the gradient reaches the block, before the
        # block's own backward (and, for a checkpointed block, before its recompute): a
        # backward pre-hook without the input/output wrapping of register_full_backward_pre_hook.
        reason = f"backward:{name}"

        def grad_hook(grad: torch.Tensor) -> None:
            self.check(reason)

        def hook(module: nn.Module, args: object, output: object) -> None:
            if not torch.is_grad_enabled():
                return
            t0 = time.perf_counter()
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(grad_hook)
                    break
            self.stats.time_s += time.perf_counter() - t0

        return hook

    @property
    def active(self) -> bool:
        """Whether the hooks are installed (until :meth:`remove`)."""
        return bool(self._handles)

    def remove(self) -> None:
        """Remove every hook this watch installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> PressureWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _cushion(growth: int, seen: bool) -> int:
    """The margin for a forecast growth: +25 % when that size was seen, x2 when guessed."""
    return growth + growth // 4 if seen else 2 * growth


def _bucket(tokens: int) -> int:
    """The power of two at or above ``tokens``: steps of similar size share what is learned."""
    return 1 << max(int(tokens) - 1, 0).bit_length()
