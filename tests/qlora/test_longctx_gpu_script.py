"""benchmarks/long_context_gpu.py's code path on the CPU (tiny config, simulated budget): the
GPU section of benchmarks/gpu_check.sh runs the same functions on the 8B config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


# two tiny models built and planned, four measured steps: 4.8 s in the suite at load 3.8
# (30 s alone, most of it importing transformers and peft)
def test_tiny_run_finds_both_longest_and_predicts_the_peaks(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import long_context_gpu as gpu
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "probes.jsonl"
    summary = gpu.main(["--device", "cpu", "--tiny", "--budget", str(3 << 20), "--start", "128",
                        "--resolution", "128", "--limit", "256", "--box", "120", "--r", "4",
                        "--out", str(out)])
    # HF's step at 256 tokens needs ~4.4 MiB (the full fp32 logits); tightfit's ~2.2 MiB
    assert summary["hf"]["longest"] == 128 and summary["hf"]["first_failed"] == 256
    assert summary["tightfit"]["longest"] == 256 and not summary["tightfit"]["time_boxed"]
    assert summary["tightfit"]["tokens_per_s"] > 0
    lines = out.read_text().splitlines()
    assert len(lines) == 5 and "summary" in json.loads(lines[-1])


    for rec in map(json.loads, lines[:-1]):
        if rec["stack"] == "tightfit":  # the plan's predicted peak is the measured one
            assert abs(rec["peak"] - rec["predicted"]) <= 0.01 * rec["peak"]
