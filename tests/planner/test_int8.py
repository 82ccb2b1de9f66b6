"""An int8 (LLM.int8) base under checkpointing: what bitsandbytes' int8 matmul keeps outside
the saved-tensor hooks, counted by hand and against measured steps."""

from __future__ import annotations

import pytest

from tightfit.planner.activations import int8_held_bytes
from tightfit.planner.shapes import ModelShape
from tightfit.planner.train_setup import TrainSetup
from tightfit.planner.verify import compare

LLAMA = ModelShape("llama", 128, 352, 3, 4, 2, 1000)


def test_int8_held_inputs_by_hand() -> None:
    """A recomputed layer holds every int8 linear's input that requires grad (q/k/v share
    one, gate/up one; layer 0's q/k/v input comes from the frozen embedding: none); a stored
    one only those no adapter saves as the same tensor; NF4 holds nothing."""
    setup = TrainSetup(seq_len=32, batch_size=2, lora_r=8, compute_dtype="float32", quant="int8")
    t, d, h, i, q = setup.tokens, setup.d, LLAMA.hidden, LLAMA.intermediate, LLAMA.q_size
    assert int8_held_bytes(LLAMA, setup, 0, recomputed=True) == t * (q + h + i) * d
    assert int8_held_bytes(LLAMA, setup, 1, recomputed=True) == t * (2 * h + q + i) * d
    assert int8_held_bytes(LLAMA, setup, 1, recomputed=False) == 0  # adapters save them
    qv = setup.with_(lora_target_modules=("q_proj", "v_proj"))
    # o, gate/up and down have no adapter to save their inputs: held on top
    assert int8_held_bytes(LLAMA, qv, 1, recomputed=False) == t * (q + h + i) * d
    assert int8_held_bytes(LLAMA, setup.with_(quant="nf4"), 1, recomputed=True) == 0


@pytest.mark.slow
@pytest.mark.parametrize("shape, kw", [
    (ModelShape("qwen3-h96-hd40", 96, 288, 3, 4, 2, 1536, family="qwen3", head_dim=40),
     dict(compute_dtype="float32")),
    (ModelShape("llama-h160-kv1", 160, 432, 4, 5, 1, 3001),
     dict(compute_dtype="bfloat16", lora_dtype="bfloat16", loss_chunk_tokens=32)),
])
def test_int8_checkpointed_peak_against_a_measured_step(shape: ModelShape, kw: dict) -> None:
    """Every-layer and sqrt checkpointing of an int8 base, on shapes the held inputs were
    not listed on: never under by more than 2 %, over by at most 10 % (measured within
    1 %). Before the held inputs were counted these were 21-27 % under."""
    setup = TrainSetup(seq_len=48, batch_size=2, lora_r=8, quant="int8", **kw)
    for policy, rows in compare(shape, setup, ("every", "sqrt")).items():
        (_, predicted, measured), = [r for r in rows if r[0] == "activations"]
        assert 0.98 * measured <= predicted <= 1.10 * measured, (policy, predicted, measured)
