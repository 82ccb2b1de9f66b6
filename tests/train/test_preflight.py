"""tightfit train checks its step against the real limit before any data is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tightfit.planner.host import HostLimit
from tightfit.planner.run_fit import run_fit
from tightfit.train import preflight, run_setup
from tightfit.train.run_options import RunConfig

from .helpers import tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory) -> Path:
    """The tiny Llama with room for long sequences (8,192 positions)."""
    return tiny_llama(tmp_path_factory.mktemp("long-llama"), positions=8192, tokenizer=True)


def _cfg(model: Path, seq_len: int, **flat: object) -> RunConfig:
    return RunConfig().with_flat({"train.model": str(model), "train.seq_len": seq_len,
                                  "train.batch_size": 1, **flat})


def _limit(monkeypatch: pytest.MonkeyPatch, limit: int, overhead: int = 0) -> None:
    """The step runs in ``limit`` bytes, ``overhead`` of them held by the process."""
    monkeypatch.setattr(preflight, "real_limit", lambda device, spill: (
        limit, "the memory cgroup's limit", overhead, HostLimit(1 << 40, 1.0)))


def _fits(model: Path, cfg: RunConfig, seq_len: int, limit: int) -> bool:
    setup, sized = preflight.planned_setup(cfg, CPU)
    return run_fit(model, setup.with_(seq_len=seq_len), limit_bytes=limit, limit_source="x",
                   overhead_bytes=0, host=HostLimit(1 << 40, 1.0), **sized).fits


def test_a_step_that_fits_passes_with_a_note(long_dir: Path, monkeypatch) -> None:
    _limit(monkeypatch, 8 << 30)
    pre = preflight.check_fits(_cfg(long_dir, 256), CPU)
    assert pre.fit is not None and pre.fit.fits
    assert pre.cfg.prepare.resident_layers == "all"  # auto: nothing binds, nothing pages
    assert len(pre.notes) == 1 and "256 tokens per sequence predicted at" in pre.notes[0]


def test_too_long_is_refused_with_the_longest_that_fits(long_dir: Path, monkeypatch) -> None:
    limit = 8 << 20
    _limit(monkeypatch, limit)
    cfg = _cfg(long_dir, 8192)
    with pytest.raises(ValueError) as err:
        preflight.check_fits(cfg, CPU)
    msg = str(err.value)
    assert "--seq-len 8192 (batch 1) does not fit" in msg
    assert "the memory cgroup's limit" in msg and "binds" in msg
    # the plan command that asks the same question (this limit, this overhead, no margin)
    assert f"tightfit plan --model {long_dir} --gpu 8MiB --overhead 0MiB --margin 0" in msg
    longest = int(msg.split("these options fit is ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < longest < 8192
    assert f"pass --seq-len {longest} or less" in msg
    # the number is the planner's: it fits, one more token does not
    assert _fits(long_dir, cfg, longest, limit) and not _fits(long_dir, cfg, longest + 1, limit)


def test_positions_are_refused_before_the_data(long_dir: Path) -> None:
    with pytest.raises(ValueError, match="longer than the model allows .8192 positions"):
        preflight.check_fits(_cfg(long_dir, 9000), CPU)


def test_weights_page_when_only_that_fits(tmp_path: Path, monkeypatch) -> None:
    from transformers import LlamaConfig

    # a config alone: the planner needs no weights. Wide layers, a small vocabulary, so that
    # the 4-bit weights are what binds.
    folder = tmp_path / "wide"
    folder.mkdir()
    LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                tie_word_embeddings=False).to_json_file(folder / "config.json")
    cfg = _cfg(folder, 128, **{"prepare.checkpoint": "every",  # totals the room cannot grow
                                "optimizer.kind": "adamw"})
    setup, sized = preflight.planned_setup(cfg, CPU)
    host = HostLimit(1 << 40, 1.0)

    def total(resident: object) -> int:
        fit = run_fit(folder, setup.with_(resident_layers=resident), limit_bytes=1 << 40,
                      limit_source="x", overhead_bytes=0, host=host, **{**sized,
                                                                     "paged_weights": False})
        return fit.row.estimate.total

    limit = (total("all") + total(4)) // 2  # between all resident and half of them
    _limit(monkeypatch, limit)
    pre = preflight.check_fits(cfg, CPU)
    k = pre.cfg.prepare.resident_layers
    assert isinstance(k, int) and 4 <= k < 8
    assert cfg.prepare.resident_layers == "auto"  # the caller's config is not changed
    assert any(f"--resident-layers {k} (planned)" in n for n in pre.notes)
    # given explicitly, the user's number is kept (and checked as it is)
    pre = preflight.check_fits(cfg.with_flat({"prepare.resident_layers": 2}), CPU)
    assert pre.cfg.prepare.resident_layers == 2
    # 'all' given is kept too: then the step does not fit, and is refused
    with pytest.raises(ValueError, match="does not fit"):
        preflight.check_fits(cfg.with_flat({"prepare.resident_layers": "all"}), CPU)


def test_what_the_planner_does_not_model_is_not_checked(long_dir: Path, monkeypatch) -> None:
    _limit(monkeypatch, 1 << 20)  # nothing would fit
    for flat in ({"optimizer.kind": "paged_lion"}, {"prepare.checkpoint": "selective"}):
        assert preflight.check_fits(_cfg(long_dir, 8192, **flat), CPU).fit is None
    assert preflight.check_fits(RunConfig(), CPU).fit is None  # the built-in model
    folder = long_dir.parent / "unknown-family"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    pre = preflight.check_fits(_cfg(folder, 128), CPU)
    assert pre.fit is None and "not checked before the data" in pre.notes[0]


def test_setup_refuses_before_reading_the_data(long_dir: Path, tmp_path: Path,
                                              monkeypatch) -> None:
    _limit(monkeypatch, 8 << 20)
    data = tmp_path / "text.txt"
    data.write_text("hello " * 100)

    def no_data(*args: object, **kwargs: object) -> None:
        raise AssertionError("the data was read before the step was checked")

    monkeypatch.setattr(run_setup, "_load_data", no_data)
    cfg = _cfg(long_dir, 8192, **{"data.path": str(data), "train.out": str(tmp_path / "out")})
    with pytest.raises(ValueError, match="does not fit"):
        run_setup.setup(cfg, progress=False, log=lambda _m: None)
    assert not (tmp_path / "out").exists()


def test_a_small_room_shrinks_the_planned_loss_chunk_as_prepare_does(tmp_path: Path) -> None:
    """The planner's chunk follows prepare's rule (a working set of at most 1/8 of the
    activation room): under a 725 MiB cgroup a 2,000-token chunk of a 32k vocabulary took 248
    MiB of a 290 MiB room, and the preflight's longest was 1,963 tokens instead of 33,098
    (benchmarks/results/long_context_cgroup.md's model, held 435 MiB)."""
    from tightfit.loss.sizing import BUDGET_SHARE, chunk_bytes_per_token

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "intermediate_size": 448, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 131072,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    setup, sized = preflight.planned_setup(_cfg(tmp_path, 32768), CPU)
    fit = run_fit(tmp_path, setup, limit_bytes=725 << 20, limit_source="x",
                  overhead_bytes=435 << 20, host=HostLimit(1 << 40, 1.0), **sized)
    row = fit.row.setup
    assert row.checkpoint == "budget" and row.loss_chunk_tokens is not None
    per_token = chunk_bytes_per_token(32000, torch.float32)
    assert row.loss_chunk_tokens * per_token <= row.checkpoint_budget // BUDGET_SHARE
    assert fit.fits and fit.longest.maximum > 30_000
