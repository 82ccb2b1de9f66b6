"""prepare() at long context: a step whose plain plan misses the budget is tiled, its loss
chunk sized, its profile carried from crops when the full step would not fit the machine, and
offloaded when that is what fits; the predicted peak is the measured one, the numerics are
the plain model's, and what no plan meets is refused by name."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tightfit
from tightfit.checkpoint import enable, long_step, tiling_of
from tightfit.checkpoint.apply import is_enabled
from tightfit.checkpoint.profile import step_loss
from tightfit.loss import is_chunked_loss_enabled
from tightfit.measure.tracker import MemoryTracker
from tightfit.qlora import prepare as prepare_module
from tightfit.qlora.prepare_options import PrepareOptions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning",
                                        "ignore:tightfit.checkpoint")
# tokens: long enough that the MLP's and head's transients, not the layer inputs, decide
# the peak; at 512 (was 1024) the routes still need tiling, crops and offload (each test
# asserts its route), in about half the time (they took 15-30 s each at load 4-5)
T = 512
LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def llama(positions: int = 4096) -> LlamaForCausalLM:
    """Llama proportions (intermediate 3.5 × hidden, GQA): four layers, a 4k vocabulary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=224,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=positions, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.train()
    return model


@pytest.fixture(scope="module")
def base() -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    x = torch.randint(0, 4096, (1, T))
    return llama(), {"input_ids": x, "labels": x}


def _prepare(base: tuple, **kw: object) -> torch.nn.Module:
    model, example = base
    torch.manual_seed(1)  # the same LoRA initialisation for every variant
    return tightfit.prepare(copy.deepcopy(model), example=example, device="cpu", lora=LORA,
                            **kw)  # type: ignore[arg-type]


def _step(model: torch.nn.Module, example: dict) -> tuple[torch.Tensor, dict, int]:
    model.zero_grad(set_to_none=True)
    with MemoryTracker("cpu") as mt:
        loss = step_loss(model, example)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, mt.peak_bytes


@pytest.fixture(scope="module")
def every(base: tuple) -> tuple[int, tuple]:
    """Today's lowest plan (every layer checkpointed, chunked loss): its peak and step."""
    model = _prepare(base, checkpoint="every")
    assert model.tightfit_info.tiling is None
    return model.tightfit_info.plan.predicted_peak_bytes, _step(model, base[1])


def _close(a: tuple, b: tuple) -> None:
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
    assert a[1].keys() == b[1].keys() and a[1]
    for n in a[1]:
        assert torch.allclose(a[1][n], b[1][n], rtol=1e-3, atol=1e-5), n


def test_a_budget_below_every_layer_checkpointed_is_met_by_tiling(base: tuple,
                                                                  every: tuple) -> None:
    lowest, ref = every
    budget = int(0.6 * lowest)
    model = _prepare(base, checkpoint_budget=budget)
    info = model.tightfit_info
    assert info.tiling is not None and tiling_of(model) is info.tiling
    assert isinstance(info.loss_chunks, int) and info.loss_chunks < T
    assert any(n.startswith("long context:") and "MLPs tiled" in n for n in info.notes)
    got = _step(model, base[1])
    _close(got, ref)
    # the step fits the budget, as predicted (within 10 %)
    assert got[2] <= budget
    assert abs(got[2] - info.plan.predicted_peak_bytes) <= 0.1 * info.plan.predicted_peak_bytes


def test_a_machine_too_small_for_the_plain_step_is_profiled_from_crops(
        base: tuple, every: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    lowest, ref = every
    # a machine with room for the crops' unchecked steps but not the full one's; crops of
    # at most T / 2 tokens of the example
    monkeypatch.setattr(prepare_module, "machine_room",
                        lambda dev: long_step.Room(int(1.2 * lowest), "a test's machine"))
    monkeypatch.setattr(long_step, "CROP_TOKENS", T // 2)
    # the fixed part of the margin is sized for real processes (MiBs); this room is KiBs
    monkeypatch.setattr(long_step, "MARGIN_BYTES", {"cpu": 0, "cuda": 0})
    budget = int(0.6 * lowest)
    model = _prepare(base, checkpoint_budget=budget)
    info = model.tightfit_info
    assert any("profile carried from crops" in n for n in info.notes)
    got = _step(model, base[1])
    _close(got, ref)
    assert got[2] <= budget
    assert abs(got[2] - info.plan.predicted_peak_bytes) <= 0.1 * info.plan.predicted_peak_bytes


def test_a_budget_only_offload_meets_puts_activations_in_the_spill_file(
        base: tuple, every: tuple, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    lowest, ref = every
    tiled = _prepare(base, checkpoint_budget=int(0.6 * lowest)).tightfit_info.plan
    from tightfit.checkpoint.solver import min_peak

    # below anything tiling and recompute alone reach: only offload gets there
    budget = int(min_peak(tiled.profile)) - (64 << 10)
    # this model's saved tensors are KiBs: let storages above 16 KiB move (the default
    # 1 MiB floor is for real models, where smaller moves cost more than they free)
    monkeypatch.setattr(long_step, "enable", functools.partial(enable, offload_min_bytes=16 << 10))
    model = _prepare(base, checkpoint_budget=budget, offload_dir=str(tmp_path))
    plan = model.tightfit_info.plan
    assert any(s.offloads for s in plan.segments) and plan.host_bytes > 0
    got = _step(model, base[1])
    _close(got, ref)
    assert got[2] <= budget
    assert abs(got[2] - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes
    assert any(os.scandir(str(tmp_path)))  # the spill file is where it was asked to be


def test_a_budget_no_plan_meets_names_the_smallest_peak_and_leaves_no_plan(base: tuple) -> None:
    model, example = base
    target = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"smallest plan of the plain model needs [\d.]+ MiB.*"
                                         r"MLPs tiled in \d+ tokens.*smallest peak any "
                                         r"checkpoint plan reaches.*offloaded to the") as e:
        tightfit.prepare(target, example=example, device="cpu", lora=LORA,
                         checkpoint_budget=1 << 20)
    assert "checkpoint_budget" in str(e.value)
    # the error says the module passed in was changed in place, and what to do
    assert any("changed the model passed to it in place" in n and "nf4" in n
               and "load it again" in n for n in e.value.__notes__)
    # the tiles and the sized loss chunk are taken back; no checkpoint plan is left
    assert tiling_of(target) is None and not is_enabled(target)
    assert is_chunked_loss_enabled(target)  # the chunked loss prepare installed, unsized


def test_a_sequence_past_the_position_limit_is_refused_before_any_change() -> None:
    model = llama(positions=512)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 4096, (1, 600))
    with pytest.raises(ValueError, match=r"600 tokens, longer than the model's position limit "
                                         r"\(512 positions"):
        tightfit.prepare(model, example={"input_ids": x}, device="cpu", checkpoint_budget=1 << 30)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(("kw", "msg"), [
    ({"offload": "yes"}, "offload must be one of auto, none, inputs, all"),
    ({"offload": "inputs", "checkpoint": "none"}, "checkpoint='none' checkpoints nothing"),
    ({"mlp_tile": 0}, "mlp_tile must be 'auto', 'none' or a positive number of tokens"),
    ({"mlp_tile": True}, "mlp_tile must be"),
    ({"mlp_tile": "big"}, "mlp_tile must be"),
    ({"offload_host_budget": -1}, "offload_host_budget must be a number of bytes"),
])
def test_bad_long_context_options_are_refused(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        PrepareOptions(**kw)


def test_none_spells_no_tiles_and_a_number_always_tiles(base: tuple) -> None:
    assert PrepareOptions(mlp_tile="none").mlp_tile is None
    model = _prepare(base, checkpoint="every", mlp_tile=128)
    assert model.tightfit_info.tiling.tile_tokens == 128


@pytest.mark.parametrize(("offload", "tile"), [("inputs", 512), ("all", None), ("none", 256)])
def test_a_planned_rows_placement_reaches_train_as_prepare_options(offload: str,
                                                                   tile: int | None) -> None:
    from tightfit.cli import build_parser
    from tightfit.planner.train_args import train_args
    from tightfit.planner.train_setup import TrainSetup
    from tightfit.train.train_command import config_from_args

    setup = TrainSetup(seq_len=4096, checkpoint="every", offload=offload,  # type: ignore[arg-type]
                       mlp_tile=tile)
    cfg = config_from_args(build_parser().parse_args(["train", *train_args(setup)]))
    assert (cfg.prepare.offload, cfg.prepare.mlp_tile) == (offload, tile)


def test_a_model_in_eval_mode_is_planned_and_returned_for_training(base: tuple,
                                                                    every: tuple) -> None:
    model, example = base
    evaluating = copy.deepcopy(model).eval()  # as from_pretrained returns it
    torch.manual_seed(1)
    pm = tightfit.prepare(evaluating, example=example, device="cpu", lora=LORA,
                          checkpoint="every")
    assert pm.training
    # the same plan as the model in training mode: no full logits in the head's profile
    assert pm.tightfit_info.plan.predicted_peak_bytes == every[0]
