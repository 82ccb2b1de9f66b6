"""Profiling the chain on an example batch: what each block keeps, and when memory peaks.

One training step is run twice without any checkpointing:

* a **memory pass** under :class:`~tightfit.measure.tracker.MemoryTracker` with a phase mark at
  every block boundary in forward and backward (backward boundaries are gradient hooks on the
  blocks' outputs). A saved-tensors hook attributes every storage saved for backward to the
  block (or the prefix, or the tail after the chain) that first saved it — the exact bytes
  checkpointing a block would drop;
* timing passes with forward timers on the blocks (hooks only, no tracking overhead; process
  CPU time on the CPU; on CUDA events recorded on the compute stream around each block and read
  after the step with one synchronize, so a block's time is the GPU's work, not its launches).

The memory pass also times each aten op a selective checkpoint keeps against all the block's
ops (wall time on the CPU, CUDA events on CUDA: a matmul launches in microseconds and runs for
milliseconds, so launch times would make selective recompute look several times dearer).

The tail — final norm, LM head, loss, as the model really runs them (chunked or not) — is
profiled as the chain's last, stored segment: its bytes are often most of the peak.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tightfit.checkpoint import apply
from tightfit.checkpoint.chain import BlockCost, Profile
from tightfit.checkpoint.offload import shared_storages
from tightfit.checkpoint.selective import SAVED_OPS
from tightfit.measure.tracker import MemoryTracker
from tightfit.model.blocks import resolve_blocks


def _on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


class _Clock:
    """Timestamps on one device's clock, read after the pass.

    On the CPU a host clock (``host``); on CUDA events recorded on the current (compute) stream:
    a host clock there times kernel launches, not the GPU's work. :meth:`settle` waits for the
    recorded work once, before :meth:`seconds` reads any pair (an event pair is readable only
    once the GPU has passed both).
    """

    def __init__(self, device: torch.device, host: Any = time.process_time) -> None:
        self.device = device
        self.cuda = _on_cuda(device)
        self._host = host

    def mark(self) -> Any:
        if not self.cuda:
            return self._host()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0 if self.cuda else end - start


class _OpRecorder(TorchDispatchMode):
    """Per block: outputs of the ops selective checkpointing keeps, and their share of time.

    Outputs are recorded as ``[block, nbytes, alive]`` with a finalizer that clears ``alive``
    when the storage is freed: an output dead by the end of the forward is one autograd did
    not save (and selective checkpointing keeps anyway). Pointers alone would not do: the
    allocator reuses a freed output's address for a later one. Op times are marks on ``clock``
    (CUDA events on CUDA), summed by :meth:`finish` after one settle.
    """

    def __init__(self, block_of: list[int], clock: _Clock) -> None:
        super().__init__()
        self.kept: list[list[Any]] = []
        self.op_s: dict[int, float] = {}  # block -> time of all ops
        self.kept_s: dict[int, float] = {}  # block -> time of the kept ops
        self._block_of = block_of
        self._clock = clock
        self._marks: list[tuple[int, bool, Any, Any]] = []  # (block, kept, start, end)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        t0 = self._clock.mark()
        out = func(*args, **(kwargs or {}))
        t1 = self._clock.mark()
        b = self._block_of[0]
        self._marks.append((b, func in SAVED_OPS, t0, t1))
        if func in SAVED_OPS:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel():
                    st = t.untyped_storage()
                    entry = [b, st.nbytes(), True]
                    self.kept.append(entry)
                    weakref.finalize(st, entry.__setitem__, 2, False)
        return out

    def finish(self) -> None:
        """Sum the recorded op times per block (one settle of the clock for the whole pass)."""
        self._clock.settle()
        for b, kept, t0, t1 in self._marks:
            dt = self._clock.seconds(t0, t1)
            self.op_s[b] = self.op_s.get(b, 0.0) + dt
            if kept:
                self.kept_s[b] = self.kept_s.get(b, 0.0) + dt
        self._marks.clear()


def _first_tensor(tree: Any) -> torch.Tensor | None:
    return next((t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)), None)


def step_loss(model: nn.Module, example: Mapping[str, Any] | torch.Tensor | Sequence) -> torch.Tensor:
    """Run ``model`` on ``example`` and return a scalar to backpropagate.

    The model's ``.loss`` when it returns one, else the sum of its (first) output tensor.
    """
    if isinstance(example, Mapping):
        out = model(**example)
    elif isinstance(example, torch.Tensor):
        out = model(example)
    elif isinstance(example, list | tuple):
        out = model(*example)
    else:
        raise TypeError(f"example must be a mapping of keyword arguments, a tensor or a tuple "
                        f"of positional arguments; got {type(example).__name__}.")
    if hasattr(out, "loss") or (isinstance(out, Mapping) and "loss" in out):
        loss = out.loss if hasattr(out, "loss") else out["loss"]
        if loss is None:
            raise ValueError("the model returned no loss for the example; include labels, e.g. "
                             "example={'input_ids': ids, 'labels': ids}.")
        return loss
    t = _first_tensor(out)
    if t is None:
        raise ValueError(f"the model returned no tensor for the example ({type(out).__name__}).")
    return t if t.dim() == 0 else t.float().sum()


def profile(model: nn.Module, example: Mapping[str, Any] | torch.Tensor,
            blocks: Sequence[nn.Module] | None = None, *, repeats: int = 2) -> Profile:
    """Measure what checkpointing each block of ``model`` would save and cost.

    Runs two training steps (forward + backward) on ``example`` without checkpointing. The
    model is left as it was: gradients, RNG state and any installed plan are restored.

    Args:
        model: The model, in the mode it will train in.
        example: One batch, as for :func:`tightfit.checkpoint.enable`.
        blocks: The chain; discovered when ``None``.
        repeats: Timed steps; each block's time is its fastest (the machine may be shared).

    Raises:
        ValueError: The example batch fails in the model (the original error is chained).
    """
    chain = resolve_blocks(model, blocks)
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    grads = [p.grad for p in params]
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with apply.suspended(model), torch.random.fork_rng(devices=rng_devices):
            rng = torch.get_rng_state()
            mem = _memory_pass(model, example, chain, device, params)
            torch.set_rng_state(rng)
            runs = [_timing_pass(model, example, chain, device, params)
                    for _ in range(max(1, repeats))]
            times = [min(r[0][i] for r in runs) for i in range(len(chain))]
            tail_s = min(r[1] for r in runs)
            step_s = min(r[2] for r in runs)
    except (ValueError, TypeError):
        raise
    except Exception as e:  # the example failed inside the model
        raise ValueError(f"the example batch failed in the model: {type(e).__name__}: {e}. "
                         "Pass a batch the model accepts as model(**example) (mapping) or "
                         "model(example) (tensor), producing a .loss or a tensor.") from e
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    costs = []
    for i, fields in enumerate(mem["blocks"]):
        share = fields.pop("kept_share")
        costs.append(BlockCost(forward_s=times[i], selective_forward_s=share * times[i], **fields))
    return Profile(tuple(costs), mem["prefix_peak"], mem["tail_peak"], mem["tail_saved"], tail_s,
                   step_s, mem["peak"], str(device), frame_bytes=mem["frame"])


class _MemoryHooks:
    """The memory pass's hooks: which block runs, what each saves, marks at its boundaries.

    ``block_of[0]`` is the block running now: -1 the prefix before the chain, ``n`` the tail
    after it (the :class:`_OpRecorder` reads the same list).
    """

    def __init__(self, n: int, skip: set[int], mt: MemoryTracker) -> None:
        self.n = n
        self.mt = mt
        self.block_of = [-1]
        self.saved: dict[int, tuple[int, int]] = {}  # storage ptr -> (block, nbytes)
        self.skip = skip  # parameter and buffer storages: saved, but not activations
        self.inputs: list[tuple[int, int]] = [(0, 0)] * n  # (ptr, nbytes) of each block's input
        self.shared: list[set[int]] = [set() for _ in range(n)]  # its other tensor arguments
        # ptr -> bytes of the storages blocks are passed besides their first argument (the
        # first block's input excluded: the chain's input is charged as a segment input)
        self.others: list[dict[int, int]] = [{} for _ in range(n)]
        self.outside: set[int] = set()  # storages alive before the step (the example's)
        self.packs = [0] * (n + 2)  # tensors saved per block (index -1 = prefix, n = tail)
        self.fwd: dict[int, int] = {}  # block -> live bytes when its forward starts
        self.bwd: dict[int, int] = {}  # block -> live bytes when its backward starts

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packs[self.block_of[0]] += 1
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.saved and ptr not in self.skip and st.nbytes() > 0:
            self.saved[ptr] = (self.block_of[0], st.nbytes())
        return t

    def pre(self, i: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self.block_of[0] = i
            self.mt.mark(f"fwd{i}")
            self.fwd[i] = self.mt.current_bytes
            x = _first_tensor((args, kwargs))
            if x is not None:
                self.inputs[i] = (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
            self.shared[i] = shared_storages((args, kwargs), first_block=i == 0)
            others = shared_storages((args, kwargs))
            self.others[i] = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                              for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                              and t.layout == torch.strided
                              and t.untyped_storage().data_ptr() in others}
        return hook

    def post(self, i: int):
        def hook(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
            if i == self.n - 1:
                self.block_of[0] = self.n
                self.mt.mark("tail")
            y = _first_tensor(out)
            if y is not None and y.requires_grad:
                def grad_hook(_g: torch.Tensor) -> None:
                    self.mt.mark(f"bwd{i}")
                    self.bwd[i] = self.mt.current_bytes
                y.register_hook(grad_hook)
        return hook


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2-sharded parameter's local shard (a DTensor has no storage of its own)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _memory_pass(model: nn.Module, example: Any, chain: list[nn.Module], device: torch.device,
                 params: list[nn.Parameter]) -> dict[str, Any]:
    n = len(chain)
    for p in params:
        p.grad = None
    skip = {_local(p).untyped_storage().data_ptr() for p in params}
    skip |= {_local(b).untyped_storage().data_ptr() for b in model.buffers()}
    mt = MemoryTracker(device)
    hooks = _MemoryHooks(n, skip, mt)
    # the example's own tensors (a position_ids the caller passes) are alive anyway
    hooks.outside = {t.untyped_storage().data_ptr() for t in tree_leaves(example)
                     if isinstance(t, torch.Tensor)}
    handles = []
    with mt:
        for i, b in enumerate(chain):
            handles.append(b.register_forward_pre_hook(hooks.pre(i), with_kwargs=True))
            handles.append(b.register_forward_hook(hooks.post(i), with_kwargs=True))
        recorder = _OpRecorder(hooks.block_of, _Clock(device, time.perf_counter))
        try:
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t), recorder:
                loss = step_loss(model, example)
            recorder.finish()
            kept_at_fwd_end = [(b, nb, alive) for b, nb, alive in recorder.kept]
            mt.mark("bwd_tail")
            loss.backward()
        finally:
            for h in handles:
                h.remove()
    if len(hooks.fwd) != n:
        raise ValueError(f"the forward called {len(hooks.fwd)} of the {n} blocks; pass blocks= "
                         "in the order the model calls them.")
    return _memory_summary(hooks, recorder, kept_at_fwd_end)


def _memory_summary(hooks: _MemoryHooks, recorder: _OpRecorder,
                    kept_at_fwd_end: list[tuple[int, int, bool]]) -> dict[str, Any]:
    """Per-block byte fields and the prefix/tail/step peaks from what the pass recorded."""
    n, mt, saved, bwd = hooks.n, hooks.mt, hooks.saved, hooks.bwd
    peaks = mt.phase_peaks
    per_block: list[dict[str, Any]] = []
    tail_peak = max(peaks.get("tail", 0), peaks.get("bwd_tail", 0))
    last_start, last_peak = mt.phases[-1].end_bytes, tail_peak
    bwd_vals: dict[int, tuple[int, int]] = {}
    for i in reversed(range(n)):  # a block whose output needs no grad: inherit the later one
        if i in bwd:
            last_start, last_peak = bwd[i], peaks[f"bwd{i}"]
        bwd_vals[i] = (last_start, last_peak)
    for i in range(n):
        mine = {p: nb for p, (b, nb) in saved.items() if b == i}
        kept = [(nb, alive) for b, nb, alive in kept_at_fwd_end if b == i]
        op_s = recorder.op_s.get(i, 0.0)
        per_block.append({
            "input_bytes": hooks.inputs[i][1],
            "saved_bytes": sum(mine.values()),
            "saves_input": hooks.inputs[i][0] in mine,
            "saved_tensors": hooks.packs[i],
            "selective_bytes": sum(nb for nb, _ in kept),
            "selective_unsaved_bytes": sum(nb for nb, alive in kept if not alive),
            "kept_share": recorder.kept_s.get(i, 0.0) / op_s if op_s > 0 else 0.0,
            "fwd_start_bytes": hooks.fwd[i],
            "fwd_peak_bytes": peaks[f"fwd{i}"],
            "bwd_start_bytes": bwd_vals[i][0],
            "bwd_peak_bytes": bwd_vals[i][1],
            "saved_sizes": tuple(sorted((nb for p, nb in mine.items()
                                         if p not in hooks.shared[i]), reverse=True)),
            "shared_saved_bytes": sum(nb for p, nb in mine.items() if p in hooks.others[i]),
        })
    others = {p: nb for o in hooks.others for p, nb in o.items()}
    return {
        "blocks": per_block,
        "prefix_peak": peaks.get("forward", 0),
        "tail_peak": tail_peak,
        "tail_saved": sum(nb for b, nb in saved.values() if b == n),
        "peak": mt.peak_bytes,
        "frame": sum(nb for p, nb in others.items() if p not in saved and p not in hooks.outside),
    }


def _timing_pass(model: nn.Module, example: Any, chain: list[nn.Module], device: torch.device,
                 params: list[nn.Parameter]) -> tuple[list[float], float, float]:
    n = len(chain)
    # On the CPU, process CPU time: on a shared machine other jobs' load inflates wall time
    # but not the work a block does. On CUDA, events on the compute stream, read after the
    # step with one synchronize: a per-block synchronize would stall the launch queue and a
    # host clock between launches measures the launches.
    clock = _Clock(device)
    for p in params:
        p.grad = None
    spans: list[list[Any]] = [[] for _ in range(n)]  # per block: [start, end] per call
    handles = []

    def pre(i: int):
        def hook(*_: Any) -> None:
            spans[i].append([clock.mark(), None])
        return hook

    def post(i: int):
        def hook(*_: Any) -> None:
            spans[i][-1][1] = clock.mark()
        return hook

    for i, b in enumerate(chain):
        handles += [b.register_forward_pre_hook(pre(i)), b.register_forward_hook(post(i))]
    try:
        t0 = clock.mark()  # an event's time is when the GPU reaches it: queued work is before
        loss = step_loss(model, example)
        forward_end = clock.mark()
        loss.backward()
        end = clock.mark()
        clock.settle()
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.grad = None
    times = [sum(clock.seconds(a, b) for a, b in s if b is not None) for s in spans]
    tail_start = spans[n - 1][-1][1] if n and spans[n - 1] else t0
    return times, clock.seconds(tail_start, forward_end), clock.seconds(t0, end)
