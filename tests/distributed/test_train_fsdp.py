"""``tightfit train --fsdp`` on 2 gloo ranks against one process: a rank that runs out of
memory stops every rank with one line naming it and the last completed step is saved once
(tightfit.distributed.stop), resumable exactly; one process's saved state resumes under
``--fsdp --fsdp-offload`` exactly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tightfit.distributed.launch import fsdp_unavailable, run_torchrun

from ..train.helpers import tiny_llama, tiny_run_args

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,  # two 2-rank launches + four short one-process runs
    pytest.mark.skipif(fsdp_unavailable() is not None, reason=fsdp_unavailable() or ""),
]

WORKER = Path(__file__).with_name("oom_worker.py")
ARGS = tiny_run_args(save_every=100)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _one_process(argv: list[str]) -> None:
    from tightfit.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *argv, *ARGS]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def three_steps(model_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The adapter of one process that trained 3 steps."""
    single = tmp_path_factory.mktemp("single")
    _one_process(["--model", str(model_dir), "--out", str(single), "--steps", "3"])
    b = _adapter(single)
    assert max(v.abs().max().item() for k, v in b.items() if "lora_B" in k) > 1e-3  # trained
    return b


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_an_oom_on_one_rank_stops_all_and_saves_the_last_step_once(model_dir, three_steps,
                                                                    tmp_path) -> None:
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
    _one_process(["--model", str(model_dir), "--resume", str(out), "--steps", "3"])
    assert _max_diff(_adapter(out), three_steps) <= 1e-5


def test_one_process_state_resumes_under_fsdp_with_the_shards_on_the_host(
        model_dir, three_steps, tmp_path) -> None:  # fmt: skip
    out = tmp_path / "one"
    _one_process(["--model", str(model_dir), "--out", str(out), "--steps", "2"])
    assert not (out / "checkpoints" / "step-00000002" / "dcp").exists()  # one process's format
    try:
        res = run_torchrun(["tightfit.cli", "train", "--model", str(model_dir), "--resume",
                            str(out), "--steps", "3", "--fsdp", "--fsdp-offload", *ARGS], 2,
                           module=True, timeout_s=300)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun resume timed out (killed):\n{exc.stderr}")
    assert res.returncode == 0, res.stderr[-4000:]
    assert _max_diff(_adapter(out), three_steps) <= 1e-5
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["world_size"] == 2 and all(r["shards_on_host"] for r in meta["ranks"])
