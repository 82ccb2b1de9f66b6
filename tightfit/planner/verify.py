"""Prove the memory model: run one real step of a configuration and measure each piece.

``tightfit plan --verify`` and the tests build a small Llama-architecture model from its
shape (random weights, nothing downloaded), stack the pieces a :class:`TrainSetup` names,
run forward + backward + optimizer step under :class:`~tightfit.measure.tracker.MemoryTracker`, and
count tensors:

* weights / constants / LoRA — bytes of the storages of the base weights, of the
  bitsandbytes quantization state, of the adapter parameters;
* grads — bytes of ``p.grad``; optimizer — bytes of the optimizer state after a step
  (a paged optimizer's ``memory_stats()``: ``state_bytes`` and the resident ``device_bytes``);
* activations — the tracker's peak over forward + backward, with the gradients allocated
  before it (as after ``zero_grad(set_to_none=False)``): what the step allocates beyond
  weights and gradients;
* logits/loss — the head + loss run alone on random hidden states, peak minus the
  gradient of those hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NotRequired, TypedDict

import torch
from torch import nn

from tightfit.checkpoint.plan import Segment
from tightfit.measure.dtypes import torch_dtype
from tightfit.measure.tracker import MemoryTracker
from tightfit.planner.activations import head_loss_bytes
from tightfit.planner.estimate import Overhead, estimate
from tightfit.planner.mechanisms import install_segments, install_tiling, unavailable
from tightfit.planner.peak import activation_peak
from tightfit.planner.presets import ModelShape
from tightfit.planner.train_setup import TrainSetup
from tightfit.qlora.prepare_options import LoraOptions

if TYPE_CHECKING:
    from tightfit.planner.table import PlanReport


@dataclass(frozen=True)
class Measurement:
    """Measured bytes per piece of one real training step (tensors only)."""

    weights: int
    constants: int
    lora: int
    grads: int
    optimizer: int
    optimizer_resident: int
    activation_peak: int
    logits_loss: int
    segments: tuple[Segment, ...]


def _hf_model(shape: ModelShape, dtype: torch.dtype) -> nn.Module:
    """A random-weight transformers model of ``shape``'s family and sizes."""
    import transformers

    from tightfit.planner.configs import hf_config

    cls = getattr(transformers, shape.traits.hf_class)
    return cls(hf_config(shape)).to(dtype)


def _quantize_int8(model: nn.Module) -> None:
    """Replace the decoder layers' linears by bitsandbytes LLM.int8 layers."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    continue
                bias = child.bias is not None
                q = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=bias,
                                        has_fp16_weights=False)
                q.weight = bnb.nn.Int8Params(child.weight.data.contiguous(),
                                             requires_grad=False, has_fp16_weights=False)
                q = q.to(child.weight.device)
                if bias:
                    q.bias = nn.Parameter(child.bias.data, requires_grad=False)
                setattr(parent, name, q)


def _worst_case_routing(model: nn.Module) -> None:
    """Zero every MoE router, so that every token goes to the same top-k experts: the
    worst case the memory model assumes (all T tokens at one expert, :mod:`.moe`)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()


def _lora_options(setup: TrainSetup) -> LoraOptions:
    return LoraOptions(r=setup.lora_r, alpha=2 * setup.lora_r, dropout=setup.lora_dropout,
                       target_modules=setup.lora_target_modules, dtype=setup.lora_dtype,
                       compute=setup.lora_compute)


def build_model(shape: ModelShape, setup: TrainSetup, *, seed: int = 0) -> nn.Module:
    """A random-weight model of ``shape``'s family with the pieces of ``setup`` stacked.

    Built by :func:`tightfit.prepare` (NF4 ± double quantization through bitsandbytes, MoE
    experts in NF4 per expert, peft LoRA in the setup's adapter dtype computing as its
    ``lora_compute`` says, the chunked loss;
    MoE routers zeroed: every token at the same experts, the worst case),
    the way ``tightfit train`` builds it; int8 weights, which ``prepare`` does not offer,
    are stacked here with bitsandbytes / peft directly.
    """
    torch.manual_seed(seed)
    dtype = torch_dtype(setup.compute_dtype)
    model = _hf_model(shape, dtype)
    if shape.is_moe:
        _worst_case_routing(model)
    if setup.quant == "int8":
        return _stack_int8(model, setup)
    from tightfit.qlora.prepare import prepare

    model = prepare(
        model, quant="nf4" if setup.quant == "nf4" else None,
        double_quant=setup.double_quant, blocksize=setup.blocksize,
        compute_dtype=setup.compute_dtype, lora=_lora_options(setup),
        checkpoint=None, loss_chunks=setup.loss_chunk_tokens, device="cpu",
        resident_layers=setup.resident_layers,  # the placement the row predicts
    )
    install_tiling(model, setup)
    return model


def _stack_int8(model: nn.Module, setup: TrainSetup) -> nn.Module:
    """int8 weights, which ``prepare`` does not offer, via bitsandbytes and peft."""
    from peft import LoraConfig, get_peft_model

    _quantize_int8(model)
    targets = setup.lora_target_modules
    lora = LoraConfig(r=setup.lora_r, lora_alpha=2 * setup.lora_r,
                      target_modules=targets if targets == "all-linear" else list(targets),
                      lora_dropout=setup.lora_dropout)
    model = get_peft_model(model, lora, autocast_adapter_dtype=setup.lora_dtype == "float32")
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch_dtype(setup.lora_dtype))
    if setup.lora_compute == "compute_dtype":  # as prepare() does
        from tightfit.qlora.lora_compute import compute_in_compute_dtype

        compute_in_compute_dtype(model, torch_dtype(setup.compute_dtype))
    if setup.loss_chunk_tokens is not None:
        from tightfit.loss import enable_chunked_loss

        enable_chunked_loss(model, chunk_tokens=setup.loss_chunk_tokens)
    install_tiling(model, setup)
    return model


def _storages(tensors) -> int:  # noqa: ANN001
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    from tightfit.qlora.experts import expert_specs, is_4bit_experts

    out: list[torch.Tensor] = []
    for m in model.modules():
        if is_4bit_experts(m):  # MoE experts: each weight's constants are module buffers
            for name in expert_specs(m):
                out += [b for k, b in m.named_buffers(recurse=False)
                        if k.startswith(f"{name}_")]
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            out += [qs.absmax, qs.code]
            if qs.state2 is not None:
                out += [qs.offset, qs.state2.absmax, qs.state2.code]
        scb = getattr(w, "SCB", None)
        if scb is not None:
            out.append(scb)
    return [t for t in out if isinstance(t, torch.Tensor)]


def _remove_segments(model: nn.Module) -> None:
    from tightfit.checkpoint import apply

    apply.uninstall(model)


def _optimizer(model: nn.Module, setup: TrainSetup) -> torch.optim.Optimizer:
    """tightfit's optimizer for the setup, built by the registry as ``tightfit train`` does."""
    from tightfit.optim.registry import optimizer_for

    return optimizer_for(model, kind=setup.optimizer, lr=1e-4,
                         device_budget=setup.optimizer_device_budget)


def _optimizer_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """``(state bytes, device-resident bytes)`` of an optimizer after a step."""
    stats = getattr(opt, "memory_stats", None)
    if stats is not None:
        st = stats()
        return int(st["state_bytes"]), int(st["device_bytes"])
    total = _storages(v for s in opt.state.values() for v in s.values())
    return total, total


def measure_head_loss(shape: ModelShape, setup: TrainSetup, model: nn.Module) -> int:
    """Peak bytes of the LM head + loss alone (forward + backward) on random hidden states."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = torch_dtype(setup.compute_dtype)
    hidden = torch.randn(setup.batch_size, setup.seq_len, shape.hidden, dtype=dtype,
                         requires_grad=True)
    labels = torch.randint(0, shape.vocab, (setup.batch_size, setup.seq_len))
    cap = shape.final_softcap
    with MemoryTracker("cpu") as mt:
        if setup.loss_chunk_tokens is not None:
            from tightfit.loss import LogitTransform, chunked_cross_entropy

            loss = chunked_cross_entropy(
                hidden, base.lm_head, labels, chunk_tokens=setup.loss_chunk_tokens,
                transform=None if cap is None else LogitTransform(softcap=cap))
        else:
            logits = base.lm_head(hidden)
            if cap is not None:  # as Gemma 2's forward soft-caps them
                logits = torch.tanh(logits / cap) * cap
            loss = ForCausalLMLoss(logits, labels, shape.vocab)
            if not setup.keep_logits:
                del logits
        loss.backward()
        del loss
    return mt.peak_bytes


def measure(shape: ModelShape, setup: TrainSetup,
            plans: dict[str, tuple[Segment, ...]] | None = None, *, seed: int = 0
            ) -> dict[str, Measurement]:
    """Run real training steps of ``setup`` on the CPU and measure every piece.

    One model is built; each checkpoint plan in ``plans`` (name → segments; default: the
    plan the memory model picks for the setup's own policy) gets one forward + backward on
    the same batch. The
    gradients exist before the measured step (as after ``zero_grad(set_to_none=False)``),
    so the activation peak is what the step allocates beyond weights and gradients.

    Args:
        shape: A small architecture (this allocates it for real).
        setup: The pieces and the batch.
        plans: Checkpoint plans to measure, e.g.
            ``{"every": structural_segments("every", None, n)}`` (:mod:`tightfit.checkpoint.plan`).
        seed: Seed of the random weights and batch.
    """
    if plans is None:
        plans = {setup.checkpoint: activation_peak(shape, setup)[2]}
    model = build_model(shape, setup, seed=seed)
    model.train()
    consts = _quant_state_tensors(model)
    const_ptrs = {t.untyped_storage().data_ptr() for t in consts}
    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    lora_ptrs = {p.untyped_storage().data_ptr() for p in lora_params}
    base = [t for t in [*model.parameters(), *model.buffers()]
            if t.untyped_storage().data_ptr() not in lora_ptrs | const_ptrs]
    for p in lora_params:
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, shape.vocab, (setup.batch_size, setup.seq_len))
    peaks: dict[str, int] = {}
    by_plan: dict[tuple[Segment, ...], int] = {}
    for name, segments in plans.items():
        if tuple(segments) in by_plan:  # the same plan under another name: same step
            peaks[name] = by_plan[tuple(segments)]
            continue
        install_segments(model, segments)
        with MemoryTracker("cpu") as mt:
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
            if not setup.keep_logits:
                del out
            mt.mark("backward")
            loss.backward()
            del loss
            if setup.keep_logits:
                del out
        peaks[name] = by_plan[tuple(segments)] = mt.peak_bytes
    _remove_segments(model)
    grads = _storages(p.grad for p in lora_params)
    opt = _optimizer(model, setup)
    opt.step()
    state, resident = _optimizer_bytes(opt)
    close = getattr(opt, "close", None)
    if close is not None:
        close()
    head = measure_head_loss(shape, setup, model)
    return {
        name: Measurement(
            weights=_storages(base),
            constants=_storages(consts),
            lora=_storages(lora_params),
            grads=grads,
            optimizer=state,
            optimizer_resident=resident,
            activation_peak=peaks[name],
            logits_loss=head,
            segments=tuple(plans[name]),
        )
        for name in plans
    }


def compare(shape: ModelShape, setup: TrainSetup, policies: tuple[str, ...] = ("none",)
            ) -> dict[str, list[tuple[str, int, int]]]:
    """``{policy: [(piece, predicted, measured)]}`` — one model, one real step per policy.

    ``"budget"`` uses ``setup.checkpoint_budget`` and the plan the memory model solves for
    it; the others are structural. Pieces that are zero on both sides are left out.
    """
    no_overhead = Overhead(fixed_bytes=0, fraction=0.0)
    ests = {p: estimate(shape, setup.with_(checkpoint=p), no_overhead) for p in policies}
    measured = measure(shape, setup, {p: e.segments for p, e in ests.items()})
    head = head_loss_bytes(shape, setup)
    out: dict[str, list[tuple[str, int, int]]] = {}
    for policy, m in measured.items():
        est = ests[policy]
        rows = [
            ("weights", est.weights, m.weights),
            ("constants", est.constants, m.constants),
            ("lora", est.lora, m.lora),
            ("grads", est.grads, m.grads),
            ("optimizer", est.optimizer + est.optimizer_offloaded, m.optimizer),
            ("optim_device", est.optimizer, m.optimizer_resident),
            ("activations", est.activation_peak, m.activation_peak),
            ("logits_loss", head, m.logits_loss),
        ]
        out[policy] = [r for r in rows if r[1] or r[2]]
    return out


def relative_error(predicted: int, measured: int) -> float:
    """|predicted − measured| ÷ measured (0 when both are 0)."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return abs(predicted - measured) / measured


class Verified(TypedDict):
    """One configuration as :func:`verify_report` measured it (``--verify --json``)."""

    name: str
    pieces: list[tuple[str, int, int]]  # (piece, predicted, measured)
    skipped: NotRequired[str]  # why it was not measured (then no pieces)


def verify_report(report: PlanReport) -> list[Verified]:
    """Measure every configuration of a plan on this machine (small configs only).

    Returns one entry per configuration: its name and ``[piece, predicted, measured]`` rows,
    the configuration's own checkpoint plan (``budget`` as solved for its budget) included.
    A configuration whose mechanisms this checkout lacks (offload, the tiled MLP) gets no
    rows and a ``"skipped"`` reason instead.
    """
    out: list[Verified] = []
    for row in report.rows:
        why = row.not_applicable or unavailable(row.setup)
        if why is not None:
            out.append({"name": row.name, "pieces": [], "skipped": why})
            continue
        policy = row.setup.checkpoint
        rows = compare(report.shape, row.setup, (policy,))[policy]
        out.append({"name": row.name, "pieces": rows})
    return out


def format_verify(verified: list[Verified]) -> str:
    """Predicted vs measured bytes per piece, one block per configuration."""
    from tightfit.measure.sizes import format_bytes

    lines = ["verify: one real step per configuration on this machine (tensor bytes, CPU)"]
    for entry in verified:
        lines.append(f"  {entry['name']}")
        if entry.get("skipped"):
            lines.append(f"    not measured: {entry['skipped']}")
            continue
        lines.append(f"    {'piece':<12}{'predicted':>12}{'measured':>12}{'error':>9}")
        for name, pred, meas in entry["pieces"]:
            err = relative_error(pred, meas)
            lines.append(f"    {name:<12}{format_bytes(pred):>12}{format_bytes(meas):>12}"
                         f"{100 * err:>8.1f}%")
    return "\n".join(lines)
