"""tightfit plan --gpus N: one rank's bytes under FSDP2 (tightfit.planner.ranks), the fewest
GPUs that fit, and the per-rank prediction beside the runtime's measured per-rank base."""

from __future__ import annotations

import pytest

from tightfit.planner.ladder import plan
from tightfit.planner.presets import load_shape
from tightfit.planner.ranks import (
    GATHERED_BLOCKS,
    RankEstimate,
    ddp_only,
    global_batch,
    rank_estimate,
    unit_bytes,
)
from tightfit.planner.train_setup import TrainSetup
from tightfit.qlora.shardable import REPLICATED_BYTES

# benchmarks/fsdp_qlora.py's model (tightfit.distributed.qlora_check.write_tiny_model at
# --layers 8 --hidden 256) and its per-rank base bytes, benchmarks/results/fsdp_qlora.md
# (commit aaf0c84): rank 0's held shards on 2 and 4 gloo ranks, the whole base, the most
# base bytes gathered at once
TINY = {"model_type": "llama", "vocab_size": 67, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": False}
KIB = 1024
MEASURED_HELD = {2: 1188.6 * KIB, 4: 594.3 * KIB}
MEASURED_WHOLE = 2377.1 * KIB
MEASURED_GATHERED = {2: 297.1 * KIB, 4: 297.2 * KIB}


def _base_only(shape, setup, ranks):  # noqa: ANN001, ANN202
    """Predicted 4-bit base bytes (codes, absmax, nested absmax): a rank's, one block's."""
    u = unit_bytes(shape, setup)
    norms = shape.traits.norms * shape.hidden * setup.d  # a block's unquantized weights
    est = rank_estimate(shape, setup, None, ranks)
    non_base = (u.rotary + -(-u.head // ranks) + -(-u.embed // ranks)
                + shape.layers * (-(-norms // ranks) + u.replicated))
    return est.weights + est.constants - non_base, u.weights - norms + u.constants


@pytest.mark.parametrize("ranks", [2, 4])
def test_per_rank_base_within_10_percent_of_the_measured(ranks: int) -> None:
    shape = load_shape(TINY)
    setup = TrainSetup(seq_len=16, batch_size=4 // ranks, lora_r=4)
    held, block = _base_only(shape, setup, ranks)
    assert held == pytest.approx(MEASURED_HELD[ranks], rel=0.10)
    assert block == pytest.approx(MEASURED_GATHERED[ranks], rel=0.10)
    assert shape.layers * block == pytest.approx(MEASURED_WHOLE, rel=0.01)
    # (exact here: 1188.56 / 594.28 KiB held, 297.14 KiB a block)
    assert abs(held - MEASURED_HELD[ranks]) < 0.1 * KIB


def test_replicated_constants_are_the_runtimes() -> None:
    shape = load_shape(TINY)
    u = unit_bytes(shape, TrainSetup(seq_len=16, lora_r=4))
    assert u.replicated == len(shape.weight_shapes()) * REPLICATED_BYTES


def test_one_gpu_is_todays_plan() -> None:
    a = plan("llama-3.1-8b", "24GiB", seq_len=4096)
    b = plan("llama-3.1-8b", "24GiB", seq_len=4096, gpus=1)
    assert str(a) == str(b)
    assert [r.estimate.pieces() for r in a.rows] == [r.estimate.pieces() for r in b.rows]
    assert not any(isinstance(r.estimate, RankEstimate) for r in b.rows)
    assert b.fewest is None  # it fits one GPU: nothing searched, nothing printed


def test_two_ranks_shard_and_gather() -> None:
    shape = load_shape("llama-3.1-8b")
    setup = TrainSetup(seq_len=2048, checkpoint="every")
    one = rank_estimate(shape, setup, None, 1)
    two = rank_estimate(shape, setup, None, 2)
    u = unit_bytes(shape, setup)
    assert two.weights == pytest.approx(one.weights / 2, rel=0.01)
    assert two.lora == pytest.approx(one.lora / 2, rel=0.01)
    assert two.optimizer == pytest.approx(one.optimizer / 2, rel=0.01)
    assert two.gathered == u.head + GATHERED_BLOCKS * u.block
    assert two.grads == two.lora + u.lora and two.comm == u.lora
    assert two.activations == one.activations  # the same rows per rank
    assert two.total < one.total - 3 * 2**30  # half of the 5.2 GiB base + more
    # the start of forward: the untied embedding gathered beside the root, twice
    assert two.start_peak > two.weights + two.constants + u.head + 2 * u.embed


def test_70b_needs_three_24gib_gpus_with_a_small_host_and_the_plan_says_so() -> None:
    # 16 GiB of RAM pins 8: too little for the shards on the host (--fsdp-offload)
    one = plan("llama-3.3-70b", "24GiB", seq_len=2048, host_ram="16GiB")
    assert one.recommended is None and one.fewest is not None and one.fewest.gpus == 3
    text = str(one)
    assert "fewest GPUs: 3 x 24.0 GiB" in text
    assert "torchrun --nproc_per_node 3 -m tightfit.cli train --fsdp --model DIR" in text
    two = plan("llama-3.3-70b", "24GiB", seq_len=2048, gpus=2, host_ram="16GiB")
    assert two.recommended is None and two.fewest.gpus == 3
    assert "per rank" in str(two) and "gather" in str(two)


def test_70b_fits_two_24gib_gpus_with_the_shards_on_the_host() -> None:
    report = plan("llama-3.3-70b", "24GiB", seq_len=2048, gpus=2, host_ram="128GiB")
    row = report.recommended
    assert row is not None and row.setup.fsdp_offload and row.estimate.sharded
    e = row.estimate
    assert e.total <= 24 * 2**30 and e.fits_host
    # the rank's shards (half the 35.8 GiB base, LoRA, grads) are the host's, not the GPU's
    assert e.weights + e.constants + e.lora < 2**30
    assert 19 * 2**30 < e.host_weights < 20 * 2**30
    text = str(report)
    assert "--fsdp" in text and "--fsdp-offload" in text and "torchrun --nproc_per_node 2" in text
    # the rows that keep the shards on the GPU do not fit
    assert not any(r.fits for r in report.rows if not r.setup.fsdp_offload)


def test_fsdp_offload_moves_the_shards_not_what_is_gathered() -> None:
    shape = load_shape("llama-3.1-8b")
    setup = TrainSetup(seq_len=2048, checkpoint="every")
    on, off = (rank_estimate(shape, setup.with_(fsdp_offload=f), None, 2) for f in (False, True))
    u = unit_bytes(shape, setup)
    assert off.gathered == on.gathered and off.activations == on.activations
    assert off.lora == 0 and off.optimizer == 0 and off.grads == u.lora
    moved = on.weights + on.constants + on.lora + on.lora - off.weights - off.constants
    assert off.host_weights == moved and off.optimizer_offloaded == on.optimizer
    assert off.total < on.total - 2 * 2**30


def test_global_batch_splits_per_rank_and_the_command_is_torchruns() -> None:
    report = plan("llama-3.1-8b", "24GiB", seq_len=4096, batch_size=4, gpus=2)
    r = report.recommended
    assert r is not None and r.setup.batch_size == 2
    args = list(r.train_args)
    assert args[0] == "--fsdp" and args[args.index("--batch-size") + 1] == "4"
    assert "torchrun --nproc_per_node 2 -m tightfit.cli train --fsdp" in str(report)
    assert "fewest GPUs: 1 x 24.0 GiB" in str(report)
    d = report.to_dict()
    assert d["gpus"] == 2 and d["rows"][0]["ranks"] == 2 and d["fewest"]["gpus"] == 1


def test_moe_rows_are_ddp_only() -> None:
    # tightfit train --fsdp refuses MoE experts before any weight is read, 4-bit or not
    report = plan("mixtral-8x7b", "80GiB", seq_len=1024, gpus=2)
    by_quant = {r.setup.quant: r for r in report.rows}
    for quant in ("nf4", "none"):
        ddp = by_quant[quant].estimate
        assert isinstance(ddp, RankEstimate) and not ddp.sharded and "MoE" in ddp.ddp
        assert "--fsdp" not in by_quant[quant].train_args
    assert "DDP only" in str(report)
    mixtral = load_shape("mixtral-8x7b")
    for quant in ("nf4", "none"):
        assert "MoE" in (ddp_only(mixtral, TrainSetup(seq_len=16, quant=quant)) or "")
    assert ddp_only(load_shape("llama-3.1-8b"), TrainSetup(seq_len=16, quant="none")) is None


def test_max_batch_counts_the_global_batch_in_multiples_of_the_gpus() -> None:
    report = plan("llama-3.1-8b", "24GiB", seq_len=2048, maximize="batch", gpus=2)
    for r in report.rows:
        assert r.maximum % 2 == 0 and r.setup.batch_size * 2 == max(r.maximum, 2)


def test_max_seq_on_two_gpus() -> None:
    report = plan("qwen3-0.6b", "8GiB", maximize="seq", gpus=2, host_ram="64GiB")
    assert report.recommended is not None and report.recommended.maximum > 0
    assert all(r.setup.batch_size == 1 for r in report.rows)


@pytest.mark.parametrize("gpus", [0, -2, 1.5, "2", True])
def test_bad_gpus_refused_naming_the_fix(gpus: object) -> None:
    with pytest.raises(ValueError, match="gpus"):
        plan("qwen3-0.6b", "24GiB", gpus=gpus)  # type: ignore[arg-type]


def test_a_batch_that_does_not_split_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"--batch-size 2 or 4"):
        plan("qwen3-0.6b", "24GiB", batch_size=3, gpus=2)
    assert global_batch(1, 4) == 4 and global_batch(8, 4) == 8 and global_batch(3, 1) == 3
    with pytest.raises(ValueError, match=r"--batch-size 4\b"):
        global_batch(2, 4)


def test_cli_takes_gpus() -> None:
    from tightfit.cli import build_parser

    args = build_parser("plan").parse_args(["plan", "--model", "qwen3-0.6b", "--gpus", "2"])
    assert args.gpus == 2


def test_verify_with_gpus_is_refused_before_planning() -> None:
    from tightfit.cli import build_parser
    from tightfit.planner.plan_command import run

    args = build_parser("plan").parse_args(
        ["plan", "--model", "qwen3-0.6b", "--gpus", "2", "--verify"])
    with pytest.raises(ValueError, match="drop --gpus"):
        run(args)


def test_max_seq_that_fits_nothing_says_how_many_gpus_would() -> None:
    # the 70B's head, embeddings (gathered twice at forward's start) and overhead alone
    # outgrow a 6 GiB rank, its shards on the host or not: no count fits
    report = plan("llama-3.3-70b", "6GiB", maximize="seq", host_ram="256GiB")
    assert report.recommended is None and report.fewest is not None
    assert report.fewest.gpus == 0 and report.fewest.searched_to == 64
    assert "fewest GPUs: none up to 64 x 6.00 GiB" in str(report)
