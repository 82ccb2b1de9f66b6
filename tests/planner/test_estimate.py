"""The memory model, piece by piece, against real tensors and real training steps.

Done-when of issue 6: on three small Llama-architecture configs of different shapes, every
piece's prediction is within 10 % of its measurement (weights, constants, LoRA, grads,
optimizer state, activations for none/every/sqrt/budget).
"""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from tightfit.planner.activations import plan_peak, policy_segments
from tightfit.planner.estimate import Overhead, estimate, nf4_constant_bytes, optimizer_state_bytes
from tightfit.planner.presets import ModelShape
from tightfit.planner.setup import TrainSetup
from tightfit.planner.verify import compare, relative_error

# three shapes: GQA 2:1, GQA 3:1 with a tied head, plain MHA with a wide MLP and head_dim 32
SHAPES = [
    ModelShape("gqa", hidden=128, intermediate=352, layers=3, heads=4, kv_heads=2, vocab=1000),
    ModelShape("tied", hidden=96, intermediate=256, layers=4, heads=3, kv_heads=1, vocab=2048,
               tie_embeddings=True),
    ModelShape("mha", hidden=192, intermediate=512, layers=3, heads=6, kv_heads=6, vocab=512),
]


@pytest.mark.parametrize("numel", [64, 4096, 352 * 128, 1000 * 17])
@pytest.mark.parametrize("dq", [False, True])
def test_nf4_constants_exact(numel: int, dq: bool) -> None:
    w = torch.randn(numel // 64 if numel % 64 == 0 else 1000, 64 if numel % 64 == 0 else 17)
    p = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=dq, quant_type="nf4")
    p = p._quantize("cpu")
    qs = p.quant_state
    tensors = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if dq else [])
    measured = sum(t.untyped_storage().nbytes() for t in tensors)
    assert nf4_constant_bytes(w.numel(), double_quant=dq) == measured
    assert p.untyped_storage().nbytes() == (w.numel() + 1) // 2


def test_double_quant_bits_per_param() -> None:
    n = 4096 * 11008
    assert 8 * nf4_constant_bytes(n, double_quant=False) / n == pytest.approx(0.5, abs=1e-3)
    assert 8 * nf4_constant_bytes(n, double_quant=True) / n == pytest.approx(0.127, abs=1e-3)


def test_8bit_optimizer_state_matches_bitsandbytes() -> None:
    shape = SHAPES[0]
    setup = TrainSetup(lora_r=32, optimizer="adamw8bit", compute_dtype="fp32")
    params = []
    for _ in range(shape.layers):
        for fi, fo in shape.linear_shapes().values():
            params += [torch.nn.Parameter(torch.zeros(32, fi)), torch.nn.Parameter(torch.zeros(fo, 32))]
    opt = bnb.optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    seen = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
            for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    assert optimizer_state_bytes(shape, setup) == sum(seen.values())


def test_budget_plan_between_none_and_every() -> None:
    shape = SHAPES[1]
    setup = TrainSetup(seq_len=32, batch=2, compute_dtype="fp32", lora_r=8)
    none = sum(plan_peak(shape, setup, policy_segments("none", shape.layers)))
    every = sum(plan_peak(shape, setup, policy_segments("every", shape.layers)))
    budget = (none + every) // 2
    est = estimate(shape, setup.with_(checkpoint="budget", checkpoint_budget=budget), Overhead(0, 0))
    assert est.activation_peak <= budget
    stored = sum(e - s for s, e, ck in est.segments if not ck)
    assert 0 < stored < shape.layers
    # shrinking the budget never lowers the recompute
    smaller = estimate(shape, setup.with_(checkpoint="budget", checkpoint_budget=every + 1),
                       Overhead(0, 0))
    assert smaller.recompute_fraction >= est.recompute_fraction


@pytest.mark.parametrize(
    ("shape", "dtype", "quant", "dq", "chunk", "optimizer"),
    [(SHAPES[0], "fp32", "nf4", True, None, "adamw"),
     (SHAPES[1], "bf16", "nf4", False, None, "adamw8bit"),
     (SHAPES[2], "bf16", "none", False, 16, "paged_adamw8bit")],
    ids=["gqa-fp32-nf4dq-adamw", "tied-bf16-nf4-adamw8bit", "mha-bf16-chunkedloss-paged8bit"],
)
def test_every_piece_within_10_percent(shape: ModelShape, dtype: str, quant: str, dq: bool,
                                       chunk: int | None, optimizer: str) -> None:
    setup = TrainSetup(seq_len=32, batch=2, compute_dtype=dtype, quant=quant, double_quant=dq,
                       lora_r=8, loss_chunk_tokens=chunk, optimizer=optimizer)
    none = sum(plan_peak(shape, setup, policy_segments("none", shape.layers)))
    every = sum(plan_peak(shape, setup, policy_segments("every", shape.layers)))
    setup = setup.with_(checkpoint_budget=(none + every) // 2)
    results = compare(shape, setup, ("none", "every", "sqrt", "budget"))
    seen = set()
    for policy, rows in results.items():
        for piece, predicted, measured in rows:
            seen.add(piece)
            assert relative_error(predicted, measured) <= 0.10, (policy, piece, predicted, measured)
    expected = {"weights", "lora", "grads", "optimizer", "optim_device", "activations",
                "logits_loss"}
    assert expected | ({"constants"} if quant != "none" else set()) == seen
    # the plans really differ: checkpointing lowers the measured activation peak
    acts = {p: dict((n, m) for n, _, m in rows)["activations"] for p, rows in results.items()}
    assert acts["every"] < acts["budget"] < acts["none"]
