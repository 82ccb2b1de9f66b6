"""benchmarks/long_context_gpu.py's code path on the CPU (tiny config, simulated budget): the
GPU section of benchmarks/gpu_check.sh runs the same functions on the 8B config. Also: results
are on disk after each probe, a non-OOM error stops the run, and gpu_check.sh's output filters
showing nothing are no failure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script():  # noqa: ANN202 - the benchmark module
    sys.path.insert(0, str(BENCH))
    try:
        import long_context_gpu as gpu
    finally:
        sys.path.remove(str(BENCH))
    return gpu


# two tiny models built and planned, four measured steps: 4.8 s in the suite at load 3.8
# (30 s alone, most of it importing transformers and peft)
def test_tiny_run_finds_both_longest_and_predicts_the_peaks(tmp_path: Path) -> None:
    gpu = _script()
    out = tmp_path / "probes.jsonl"
    summary = gpu.main(["--device", "cpu", "--tiny", "--budget", str(3 << 20), "--start", "128",
                        "--resolution", "128", "--limit", "512", "--box", "120", "--r", "4",
                        "--out", str(out)])
    # HF with its offload on: 2.0 MiB at 256 tokens, 3.1 at 384, 4.1 at 512; tightfit 2.6 at 512
    assert summary["hf"]["longest"] == 384 and summary["hf"]["first_failed"] == 512
    assert summary["tightfit"]["longest"] == 512 and not summary["tightfit"]["time_boxed"]
    assert summary["tightfit"]["tokens_per_s"] > 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert "run" in lines[0] and "summary" in lines[-1]
    assert [next(iter(r["stack_summary"])) for r in lines if "stack_summary" in r] == \
        ["tightfit", "hf"]
    probes = [r for r in lines if "tokens" in r]
    assert len(probes) == 7  # tightfit 128, 256, 512; HF 128, 256, 512, 384
    for rec in probes:
        if rec["stack"] == "tightfit":  # the plan's predicted peak is the measured one
            assert abs(rec["peak"] - rec["predicted"]) <= 0.01 * rec["peak"]


# one tiny HF model built twice, two measured steps (issue 25, finding 13)
def test_results_are_on_disk_after_each_probe_and_a_cuda_error_stops_the_run(
        tmp_path: Path, monkeypatch) -> None:
    gpu = _script()
    out = tmp_path / "probes.jsonl"
    real_step, calls = gpu.step, []

    def step(model, batch, device):  # noqa: ANN001, ANN202
        calls.append(batch["input_ids"].shape[1])
        on_disk = [json.loads(line) for line in out.read_text().splitlines()]
        assert sum("tokens" in r for r in on_disk) == len(calls) - 1  # every probe so far
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")  # "does not fit"
        if len(calls) == 3:  # a sticky CUDA error is no "does not fit"
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step(model, batch, device)

    monkeypatch.setattr(gpu, "step", step)
    with pytest.raises(gpu.ProbeFailed, match="hf probe at 128 tokens.*not out-of-memory"):
        gpu.main(["--device", "cpu", "--tiny", "--budget", str(64 << 20), "--start", "128",
                  "--resolution", "128", "--limit", "256", "--box", "120", "--r", "4",
                  "--stacks", "hf,hf", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    probes = [r for r in lines if "tokens" in r]
    assert [(r["tokens"], r.get("ok")) for r in probes] == [(128, True), (256, False), (128, None)]
    assert "OutOfMemoryError" in probes[1]["error"] and "illegal memory" in probes[2]["fatal"]
    assert "run" in lines[0] and sum("stack_summary" in r for r in lines) == 1
    assert not any("summary" in r for r in lines)


def test_gpu_check_filters_showing_nothing_are_no_failure() -> None:
    import shutil
    import subprocess

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    script = BENCH / "gpu_check.sh"
    assert subprocess.run([bash, "-n", str(script)]).returncode == 0
    text = script.read_text()
    only = next(line for line in text.splitlines() if line.startswith("only() {"))
    assert "| grep" not in text  # every output filter goes through only()

    def status(pipeline: str) -> int:
        return subprocess.run([bash, "-c", f"set -u -o pipefail; {only}\n{pipeline}"],
                              capture_output=True).returncode

    # every line filtered out (the long-context section's `grep -v ... | tail`): no failure
    assert status(r'printf "Loading a\nWriting b\n" | only -v "^Loading\|^Writing" | tail -12') == 0
    assert status('printf "x\n" | only "selfcheck"') == 0
    assert status('false | only -v "^Loading" | tail -12') == 1  # the command's failure counts
