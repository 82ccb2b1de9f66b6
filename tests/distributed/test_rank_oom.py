"""A rank that runs out of memory under torchrun stops every rank with one line naming it,
and the last completed step is saved once (tightfit.distributed.stop), resumable exactly."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tightfit.distributed.launch import fsdp_unavailable, run_torchrun

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,  # one 2-rank launch + two one-process runs
    pytest.mark.skipif(fsdp_unavailable() is not None, reason=fsdp_unavailable() or ""),
]

WORKER = Path(__file__).with_name("oom_worker.py")
ARGS = ["--batch-size", "4", "--seq-len", "16", "--save-every", "100", "--track-every", "0",
        "--checkpoint", "uniform:2", "--device", "cpu", "--page-bytes", "4KiB",
        "--device-budget", "16KiB", "--lora-r", "4", "--lora-alpha", "8",
        "--lora-dropout", "0", "--lr", "2e-3", "--tokenizer", "bytes"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_an_oom_on_one_rank_stops_all_and_saves_the_last_step_once(model_dir, tmp_path) -> None:
    from tightfit.cli import main

    out = tmp_path / "fsdp"
    try:
        res = run_torchrun([str(WORKER), "train", "--model", str(model_dir), "--out", str(out),
                            "--steps", "4", "--fsdp", *ARGS], 2, timeout_s=300)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a rank hung after the other ran out of memory (killed):\n{exc.stderr}")
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if "tightfit train:" in line]
    assert len(said) == 1, res.stderr[-4000:]  # one line, the failed rank's
    assert "out of memory in forward/backward of step 3 on rank 1 of 2" in said[0]
    assert "the state of step 2 is saved in" in said[0]
    states = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert states == ["step-00000002"], states  # once: one folder, one DCP metadata
    saved = out / "checkpoints" / "step-00000002"
    assert len(list(saved.rglob(".metadata"))) == 1
    assert {p.name for p in saved.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}

    # the saved state is step 2's: resumed in one process for one more step, it ends where
    # one process that ran the three steps does
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--model", str(model_dir), "--resume", str(out), "--steps", "3",
                     *ARGS]) == 0  # fmt: skip
        single = tmp_path / "single"
        assert main(["train", "--model", str(model_dir), "--out", str(single), "--steps", "3",
                     *ARGS]) == 0  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(single / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
