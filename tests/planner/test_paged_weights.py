"""The planner's paged base weights (tightfit.planner.paged_weights): the bytes that page as the
runtime pages them, the device/host split, the link time against the compute, the ladder's
choice of resident layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit
from tightfit.cli import build_parser
from tightfit.planner.estimate import estimate
from tightfit.planner.ladder import plan
from tightfit.planner.paged_weights import (
    IN_FLIGHT,
    exposed_seconds,
    fit_resident_layers,
    paged_layer_bytes,
    weight_placement,
)
from tightfit.planner.presets import load_shape
from tightfit.planner.train_args import train_args
from tightfit.planner.train_setup import TrainSetup
from tightfit.qlora.paged_base import disable_paged_base, enable_paged_base
from tightfit.train.train_command import config_from_args

CONFIG = {"model_type": "llama", "vocab_size": 128, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "max_position_embeddings": 256,
          "tie_word_embeddings": False}


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_paged_bytes_are_what_the_runtime_pages(double_quant) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    model = tightfit.prepare(LlamaForCausalLM(cfg), checkpoint=None, loss_chunks=None,
                             double_quant=double_quant, lora={"r": 4})
    pager = enable_paged_base(model, 0)
    try:
        setup = TrainSetup(double_quant=double_quant)
        weights, constants = paged_layer_bytes(load_shape(CONFIG), setup)
        assert constants > 0  # hidden 512: some absmax reach MIN_BYTES
        assert pager.streamed_bytes == 2 * (weights + constants)
    finally:
        disable_paged_base(model)


def test_placement_moves_the_streamed_layers_to_the_host() -> None:
    shape = load_shape("llama-3.1-8b")
    base = TrainSetup(seq_len=4096, checkpoint="every", loss_chunk_tokens=512)
    resident = estimate(shape, base)
    assert resident == estimate(shape, base.with_(resident_layers="all"))
    w, c = paged_layer_bytes(shape, base)
    for k in (0, 10, 31):
        est = estimate(shape, base.with_(resident_layers=k))
        streamed = shape.layers - k
        saved = (streamed - min(IN_FLIGHT, streamed)) * (w + c)
        assert resident.total - est.total >= saved  # (and the overhead's share of it)
        assert est.weights + est.constants == resident.weights + resident.constants - saved
        assert est.host_weights == streamed * (w + c) and est.host == resident.host + streamed * (w + c)
    placed = weight_placement(shape, base.with_(resident_layers=0))
    assert placed.moved_per_step == 2 * shape.layers * (w + c)
    assert weight_placement(shape, base.with_(quant="none", resident_layers=0)).host_bytes == 0


def test_the_link_time_is_what_the_compute_does_not_hide() -> None:
    shape = load_shape("llama-3.1-8b")
    setup = TrainSetup(seq_len=512, checkpoint="every", loss_chunk_tokens=512, resident_layers=2)
    est = estimate(shape, setup)
    placed = weight_placement(shape, setup)
    assert exposed_seconds(shape, setup, est.segments, gpu_tflops=100, link_gbps=1e6) == 0.0  # fast link
    slow = exposed_seconds(shape, setup, est.segments, gpu_tflops=1e9, link_gbps=1)  # compute ~ free
    assert slow == pytest.approx(placed.moved_per_step / 1e9, rel=1e-3)
    mid = exposed_seconds(shape, setup, est.segments, gpu_tflops=100, link_gbps=5)
    assert 0 < mid < slow
    # longer sequences hide more of the same bytes
    long = estimate(shape, setup.with_(seq_len=8192))
    assert exposed_seconds(shape, long.setup, long.segments, gpu_tflops=100, link_gbps=5) < mid
    every = setup.with_(resident_layers="all")
    assert exposed_seconds(shape, every, est.segments, gpu_tflops=1e9, link_gbps=1) == 0.0


def test_fit_resident_layers_keeps_as_many_as_fit() -> None:
    base = TrainSetup()
    calls = []

    def fits_up_to(k_max):  # noqa: ANN001, ANN202
        def fits(s: TrainSetup) -> bool:
            calls.append(s.resident_layers)
            return s.resident_layers != "all" and s.resident_layers <= k_max
        return fits

    assert fit_resident_layers(base, 32, fits_up_to(17)).resident_layers == 17
    assert len(calls) <= 2 + 6  # a bisection, not a scan
    assert fit_resident_layers(base, 32, fits_up_to(-1)).resident_layers == 0
    assert fit_resident_layers(base, 32, lambda s: True).resident_layers == "all"
    assert fit_resident_layers(base.with_(quant="none"), 32,
                               fits_up_to(3)).resident_layers == "all"


def test_the_long_context_row_streams_weights_only_when_they_bind() -> None:
    short = plan("llama-3.1-8b", "24GiB", seq_len=2048, lora_r=32)
    row = next(r for r in short.rows if r.setup.mlp_tile is not None
               and r.setup.optimizer == "paged_adamw8bit")
    assert row.setup.resident_layers == "all" and "--resident-layers" not in row.train_args
    # 70B on 24 GiB: the 4-bit weights alone are 32 GiB; streaming them makes it trainable
    big = plan("llama-3.3-70b", "24GiB", seq_len=4096, lora_r=32, host_ram="128GiB")
    assert big.recommended is not None
    setup = big.recommended.setup
    assert setup.resident_layers != "all" and 0 <= setup.resident_layers < 80
    assert big.recommended.estimate.host_weights > 0
    args = big.recommended.train_args
    assert args[args.index("--resident-layers") + 1] == str(setup.resident_layers)
    # the row's command line reaches prepare() with the same number
    parsed = build_parser("train").parse_args(["train", *args])
    assert config_from_args(parsed).prepare.resident_layers == setup.resident_layers


@pytest.mark.parametrize("bad", [-1, 1.5, True, "some"])
def test_bad_resident_layers_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="resident_layers"):
        TrainSetup(resident_layers=bad)


def test_train_args_round_trip_the_resident_layers() -> None:
    setup = dataclasses.replace(TrainSetup(), resident_layers=5)
    args = train_args(setup)
    assert args[args.index("--resident-layers") + 1] == "5"


def test_verify_builds_the_placement_it_predicts() -> None:
    from tightfit.planner.verify import build_model
    from tightfit.qlora.paged_base import paged_base_of

    setup = TrainSetup(seq_len=16, compute_dtype="float32", resident_layers=1)
    model = build_model(load_shape(CONFIG), setup)
    pager = paged_base_of(model)
    assert pager is not None and pager.resident_layers == 1
    assert paged_base_of(build_model(load_shape(CONFIG), setup.with_(resident_layers="all"))) is None
