"""Long context in the planner: offload and tiling in the memory model, the host budget, and
the longest sequence / largest batch each configuration fits."""

from __future__ import annotations

import json
import math

import pytest

from tightfit.checkpoint.plan import Segment, structural_segments
from tightfit.cli import main
from tightfit.planner.activations import backward_transient_bytes, layer_saved_bytes
from tightfit.planner.estimate import Overhead, estimate
from tightfit.planner.host import host_limit
from tightfit.planner.ladder import Sizing, evaluate, ladder, plan, sized
from tightfit.planner.max_length import search
from tightfit.planner.peak import offloaded_bytes, plan_peak
from tightfit.planner.presets import PRESETS, ModelShape
from tightfit.planner.speed import slowdown
from tightfit.planner.train_setup import TrainSetup

# h8 i16, 3 layers, 2 heads of 4 (q = 8), 1 kv head (kv = 4), vocabulary 32
TINY = ModelShape("tiny", hidden=8, intermediate=16, layers=3, heads=2, kv_heads=1, vocab=32)
# fp32 everywhere (d = a = 4), 4 tokens, LoRA r=2 on all seven linears, no quantization
FP32 = TrainSetup(seq_len=4, batch_size=1, compute_dtype="float32", quant="none", lora_r=2)
SMALL = ModelShape("small", hidden=128, intermediate=352, layers=6, heads=4, kv_heads=2,
                   vocab=1000, max_positions=1 << 20)
NO_MARGIN = Overhead(0, 0.0)


def test_layer_terms_by_hand() -> None:
    # a layer saves: 2 norms x (T·h·4 + T·4) = 288; attention T·(2q + 2kv)·d = 384 + its
    # logsumexp batch·heads·seq·4 = 32; adapter inputs (shared, a = d): q/k/v T·h·d = 128,
    # o none, gate/up 128, down T·i·d = 256; 7 r-wide hiddens T·r·a = 7 x 32 = 224; SwiGLU
    # 3·T·i·d = 768. Total 2208; the first layer has no input norm: 2208 - 144
    assert layer_saved_bytes(TINY, FP32) == 2208
    assert layer_saved_bytes(TINY, FP32, first=True) == 2064
    # tiled: the MLP keeps only its input (T·h·d = 128) instead of gate/up/down's 1248
    tiled = FP32.with_(mlp_tile=2)
    assert layer_saved_bytes(TINY, tiled) == 288 + 416 + 128 + 4 * 32 + 128 == 1088
    assert layer_saved_bytes(TINY, tiled, first=True) == 944
    # untiled backward: 2·T·i·d + 3·T·r·a = 512 + 96
    assert backward_transient_bytes(TINY, FP32) == 608
    # tiled (2 tokens a tile): the tile's saved tensors (SwiGLU 384, gate/up input 64, down
    # input 128, 3 hiddens 48) + its gradients 2·c·i·d = 256 + 3·c·r·a = 48, beside the MLP
    # input's full gradient T·h·d = 128 and the fp32 sums of the MLP adapters' gradients
    # (an accumulator + one tile's: 2 x 4 bytes x r·(in + out) = 2 x 4 x 3 x 48 = 1152);
    # the attention moment (T·(2q + 2kv)·d + T·q·4 = 512) is smaller here
    assert backward_transient_bytes(TINY, tiled) == 624 + 256 + 48 + 128 + 1152 == 2208


def test_plan_peak_with_offloaded_inputs_by_hand() -> None:
    every = structural_segments("every", None, TINY.layers)
    # x = T·h·d = 128 per layer input; head 12·T·V = 1536; final norm 128 + 16 + rotary 128
    # last segment's backward on the device: inputs of layers 0, 1 (256) + its own (128) +
    # its recomputed saved tensors minus the norm's view of x (2208 - 128) + transients
    # 608 + the incoming gradient 128 + the rotary cos/sin the checkpoint keeps for the
    # recompute (128; no layer is masked, so no mask)
    rotary = 2 * 4 * 4 * 4
    assert plan_peak(TINY, FP32, every) == (256 + 128 + 2080 + 608 + 128 + rotary, 0)
    # offloaded: no input waits on the device, the previous one is prefetched (128)
    off = FP32.with_(checkpoint="every", offload="inputs")
    assert plan_peak(TINY, off, every) == (128 + 2080 + 128 + 608 + 128 + rotary, 0)
    assert offloaded_bytes(TINY, off, every) == 3 * 128
    # the explicit placement kinds mean the same
    kinds = tuple(Segment(s.start, s.stop, "checkpoint_offload") for s in every)
    assert plan_peak(TINY, FP32.with_(checkpoint="every"), kinds) == plan_peak(TINY, off, every)
    # + tiled MLP (tile 2): the recomputed layer saves 1088 - 128, the transients are 2208
    both = off.with_(mlp_tile=2)
    assert plan_peak(TINY, both, every) == (128 + 960 + 128 + 2208 + 128 + rotary, 0)


def test_offloaded_stored_segment_by_hand() -> None:
    none = structural_segments("none", None, TINY.layers)
    # stored on the device: the start of backward holds all saved (2064 + 2 x 2208 = 6480),
    # the final norm (272) and the head (1536)
    assert sum(plan_peak(TINY, FP32, none)) == 6480 + 272 + 1536
    # offload="all": layer by layer, one layer's saved tensors back + the next one's
    # prefetched (2 x 2208) beside the transients and the gradient; 6480 bytes on the host
    everything = FP32.with_(offload="all")
    assert sum(plan_peak(TINY, everything, none)) == 2208 + 2208 + 608 + 128
    assert offloaded_bytes(TINY, everything, none) == 6480


MONOTONE_SETUPS = [
    TrainSetup(checkpoint="every", offload="inputs", loss_chunk_tokens=64),
    TrainSetup(checkpoint="every", offload="inputs", loss_chunk_tokens=64, mlp_tile=128),
    TrainSetup(checkpoint="sqrt", offload="inputs", mlp_tile=64, compute_dtype="float32"),
    TrainSetup(checkpoint="none", offload="all", mlp_tile=256, quant="none"),
    TrainSetup(checkpoint="uniform:2", optimizer="paged_adamw8bit", optimizer_device_budget=1),
]


@pytest.mark.parametrize("setup", MONOTONE_SETUPS, ids=range(len(MONOTONE_SETUPS)))
def test_more_tokens_never_fewer_bytes(setup: TrainSetup) -> None:
    for what in ("seq_len", "batch_size"):
        last = None
        for n in (1, 2, 3, 7, 16, 63, 64, 65, 200, 511, 512, 513, 1000, 4097):
            e = estimate(SMALL, setup.with_(**{what: n}), NO_MARGIN)
            now = (e.total, e.activation_peak, e.host)
            if last is not None:
                assert all(b >= a for a, b in zip(last, now)), (what, n, last, now)
            last = now


def test_search_finds_the_boundary() -> None:
    assert search(lambda n: n <= 1000, cap=5000) == search(lambda n: n <= 1000, cap=5000)
    found = search(lambda n: n <= 1000, cap=5000)
    assert (found.value, found.limit) == (1000, "memory")
    assert found.evaluations <= 2 * math.ceil(math.log2(5000)) + 2
    assert search(lambda n: n <= 1000, cap=5000, granularity=64).value == 960
    assert (search(lambda n: True, cap=777).value, search(lambda n: True, cap=777).limit) == \
        (777, "cap")
    assert search(lambda n: n <= 776, cap=777).value == 776
    assert search(lambda n: False, cap=777).limit == "nothing fits"
    asked: list[int] = []
    search(lambda n: asked.append(n) or n < 10, cap=100, granularity=7)
    assert max(asked) <= 100 and all(n % 7 == 0 or n == 100 for n in asked)
    with pytest.raises(ValueError, match="granularity must be a positive integer"):
        search(lambda n: True, cap=10, granularity=0)


def _sizing(gpu: int, host: str = "1TiB") -> Sizing:
    return Sizing(SMALL, gpu, NO_MARGIN, host_limit(host))


@pytest.mark.parametrize("granularity", [1, 64])
def test_max_seq_fits_and_one_step_more_does_not(granularity: int) -> None:
    gpu = 48 * 2**20
    report = plan(SMALL, gpu, overhead=0, slack=0.0, margin=0, host_ram="1TiB",
                  maximize="seq", granularity=granularity)
    sizing = _sizing(gpu)
    found = 0
    for rung, row in zip(ladder(TrainSetup()), report.rows):
        assert row.name == rung.name
        if not row.maximum:
            continue
        found += 1
        assert row.fits and row.setup.seq_len == row.maximum
        assert row.maximum % granularity == 0
        assert row.limit == "device"
        over = evaluate(rung, sizing, sized(rung, sizing, row.maximum + granularity, 1,
                                            monotone=True))
        assert not over.fits_device
    assert found >= 6
    by_name = {r.name: r.maximum for r in report.rows}
    # what each mechanism buys: recompute < + offload < + tiled MLP
    assert by_name["QLoRA + ckpt every"] < by_name["QLoRA + every + offload + chunked loss"] \
        < by_name["QLoRA + every + offload + chunked + tiled MLP"]
    assert report.recommended is not None
    assert report.recommended.maximum == max(by_name.values())


def test_max_batch() -> None:
    report = plan(SMALL, "48MiB", seq_len=256, overhead=0, slack=0.0, margin=0,
                  host_ram="1TiB", maximize="batch")
    sizing = _sizing(48 * 2**20)
    for rung, row in zip(ladder(TrainSetup()), report.rows):
        if row.maximum:
            assert row.fits and row.setup.batch_size == row.maximum and row.setup.seq_len == 256
            over = evaluate(rung, sizing, sized(rung, sizing, 256, row.maximum + 1, monotone=True))
            assert not over.fits
    assert "batch" in str(report).splitlines()[4]


def test_host_budget_refuses_offload_rows() -> None:
    with pytest.raises(ValueError, match="host_budget must be a positive integer"):
        TrainSetup(host_budget=0)
    with pytest.raises(ValueError, match="offload='inputs'.*checkpoint='none'"):
        TrainSetup(offload="inputs")
    with pytest.raises(ValueError, match="write the unit"):
        host_limit("12")
    with pytest.raises(ValueError, match="pinned_fraction"):
        host_limit("12GiB", pinned_fraction=1.5)
    # 2 MiB of host RAM, 1 MiB pinnable: the offloaded inputs of 2048 tokens do not fit
    report = plan(SMALL, "1GiB", seq_len=2048, host_ram="2MiB", overhead=0)
    for row in report.rows:
        assert row.fits_host == (row.estimate.host <= 2**19)
        assert row.fits == (row.fits_device and row.fits_host and not row.tight)
        if row.estimate.host_activations:  # every row whose plan offloads an input
            assert row.fits_device and not row.fits_host and not row.fits
    assert sum(not r.fits_host for r in report.rows) >= 2
    text = str(report)
    assert "HOST" in text and "pinned: does not fit" in text
    assert report.recommended is not None and report.recommended.setup.offload == "none"


def test_host_can_be_what_binds() -> None:
    report = plan(SMALL, "1GiB", overhead=0, host_ram="64MiB", maximize="seq")
    offload = [r for r in report.rows if r.setup.offload != "none" and r.maximum]
    assert offload and all(r.limit == "host" for r in offload)
    assert all(r.estimate.host <= 32 * 2**20 for r in offload)


def test_position_limit() -> None:
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        plan("llama-2-7b", "24GiB", seq_len=4097)
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        estimate(PRESETS["llama-2-7b"], TrainSetup(seq_len=8192))
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        plan("llama-2-7b", "24GiB", seq_len=4097, maximize="batch")
    capped = ModelShape("capped", 128, 352, 6, 4, 2, 1000, max_positions=512)
    report = plan(capped, "1GiB", overhead=0, host_ram="1TiB", maximize="seq")
    assert max(r.maximum for r in report.rows) == 512
    assert any(r.limit.startswith("positions") for r in report.rows)
    assert "capped by the model's max_position_embeddings=512" in str(report)


def test_presets_carry_their_position_limits() -> None:
    assert PRESETS["llama-3.3-70b"] == ModelShape(
        "llama-3.3-70b", 8192, 28672, 80, 64, 8, 128256, max_positions=131072)
    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.3-70b"):
        assert PRESETS[name].max_positions == 131072


def test_offload_slowdown_is_what_compute_does_not_hide() -> None:
    setup = TrainSetup(seq_len=512, checkpoint="every", offload="inputs")
    est = estimate(SMALL, setup)
    fast, _ = slowdown(SMALL, est, gpu_tflops=1.0, link_gbps=1000.0)
    hidden, _ = slowdown(SMALL, estimate(SMALL, setup.with_(offload="none")), gpu_tflops=1.0,
                         link_gbps=1000.0)
    assert fast == pytest.approx(hidden)  # copies hide behind the compute
    slow, _ = slowdown(SMALL, est, gpu_tflops=1000.0, link_gbps=0.001)
    assert slow > 2 * fast


def test_cli_max_seq_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "24GiB", "--lora-r", "32", "--max-seq",
            "--granularity", "256", "--host-ram", "256GiB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["maximize"] == "seq" and out["granularity"] == 256
    assert out["host"]["budget_bytes"] == 128 * 2**30
    rows = {r["name"]: r for r in out["rows"]}
    assert len(rows) == 11
    for r in rows.values():
        assert r["maximum"] % 256 == 0 and r["setup"]["seq_len"] == r["maximum"]
        assert r["fits"] and r["fits_device"] and r["fits_host"] and r["limit"] == "device"
        assert r["host_bytes"] == (r["host_activation_bytes"] + r["optimizer_offloaded_bytes"]
                                   + r["host_weight_bytes"])
        assert all(kind in ("stored", "checkpoint", "checkpoint_offload")
                   for _, _, kind in r["segments"])
    assert out["recommended"] == max(rows.values(), key=lambda r: r["maximum"])["name"]
    unsloth = rows["QLoRA + every + offload + chunked loss"]
    assert {k for _, _, k in unsloth["segments"]} == {"checkpoint_offload"}
    assert unsloth["host_activation_bytes"] == 32 * unsloth["maximum"] * 4096 * 2
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-2-7b", "--max-seq", "--max-batch"])
    assert "not allowed with" in capsys.readouterr().err
