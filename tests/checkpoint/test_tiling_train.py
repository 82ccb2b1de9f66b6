"""`tightfit train` with tiled MLPs on tiny MoE and Phi-3 models (saved from configs, no
download): the run tiles every layer's experts / fused MLP and trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tightfit.cli import main

from ..train.helpers import byte_tokenizer
from .families import tiny

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.slow  # a whole run per family: ~20 s each on 2 free cores
@pytest.mark.parametrize("family", ["qwen3_moe", "phi3"])
def test_train_runs_with_tiled_mlps(family: str, tmp_path: Path, monkeypatch) -> None:
    from tightfit.checkpoint import tiling

    folder = tmp_path / family
    tiny(family, vocab_size=256, max_position_embeddings=64).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(f"word{i % 50}" for i in range(3000)))
    installed = []
    enable = tiling.enable_tiling

    def spy(model, *args, **kwargs):  # noqa: ANN001, ANN202
        installed.append(enable(model, *args, **kwargs))
        return installed[-1]

    monkeypatch.setattr("tightfit.checkpoint.long_step.enable_tiling", spy)
    out = tmp_path / "run"
    assert main(["-q", "train", "--model", str(folder), "--data", str(data), "--out", str(out),
                 "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--lora-r", "2",
                 "--track-every", "0", "--checkpoint", "every", "--mlp-tile", "8"]) == 0
    kind = "experts" if family == "qwen3_moe" else "fused_gate_up"
    assert [(t.tile_tokens, t.kinds) for t in installed] == [(8, (kind, kind))]
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["steps"] == 2 and 0 < meta["first_loss"] < 100 and 0 < meta["last_loss"] < 100
