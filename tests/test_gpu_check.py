"""benchmarks/gpu_check.sh and the sections it runs (benchmarks/gpu_sections.py).

The sections' code runs here on the CPU under the strict CUDA emulation (``--emulate``), the
same functions a GPU runs; the shell script is checked for its structure (a process a section,
boxes under 8 minutes on one GPU) and, with a stand-in Python that pretends to have CUDA, for
going on past a section that dies (a sticky CUDA error) while reporting the failure.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _sections():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("gpu_sections", ROOT / "benchmarks/gpu_sections.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_emulated(name: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / "results.jsonl"
    assert _sections().main([name, "--out", str(out), "--emulate"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines and all(line["ok"] and line["device"] == "emulated" for line in lines), lines
    return lines


@pytest.mark.slow
def test_oom_in_step_section_runs_emulated(tmp_path) -> None:
    (line,) = _run_emulated("oom_step", tmp_path)
    assert line["oom_recoveries"] == 1 and line["equal_to_clean"]


@pytest.mark.slow
def test_paged_section_runs_emulated_with_its_sync_counts(tmp_path) -> None:
    lines = {line["case"]: line for line in _run_emulated("paged", tmp_path)}
    assert lines["PagedAdamW streamed"]["syncs_per_step"] == [0, 0, 0]
    assert lines["PagedAdamW foreach streamed"]["syncs_per_step"] == [1, 1, 1]
    assert lines["PagedAdamW8bit streamed"]["syncs_per_step"] == [1, 1, 1]
    assert lines["PagedAdamW streamed"]["bytes_paged_in"] > 0


@pytest.mark.slow
def test_offload_section_runs_emulated(tmp_path) -> None:
    (line,) = _run_emulated("offload", tmp_path)
    assert line["offloaded_bytes"] > 0 and line["grad_max_diff"] <= 1e-5


@pytest.mark.slow
def test_oom_in_backward_section_runs_emulated(tmp_path) -> None:
    (line,) = _run_emulated("oom_backward", tmp_path)
    assert line["oom_retry"] == [False, True, False] and line["adapter_equal"]


def _one_gpu_part(text: str) -> str:
    return text.split("NGPU=")[0]


def test_every_section_is_its_own_boxed_process_within_8_minutes() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    assert subprocess.run([bash, "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    one_gpu = _one_gpu_part(text)
    called = re.findall(r"^run_section (\w+) (\d+)", one_gpu, re.M)
    assert {name for name, _ in called} == set(_sections().SECTIONS)  # every section, once
    boxes = [int(n) for n in re.findall(r"timeout (\d+)", one_gpu)]  # the literal boxes
    boxes += [int(n) for _, n in called]  # run_section's
    assert sum(boxes) <= 480, boxes  # the bitsandbytes install included


def test_a_section_that_dies_is_reported_and_the_next_ones_still_run(tmp_path) -> None:
    """A stand-in for Python that has "CUDA" and whose offload section dies as a sticky CUDA
    error would kill it: the script goes on to the later sections and exits 1."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    ran = tmp_path / "ran.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {ran}
case "$*" in
  *"gpu_sections.py offload"*) echo "torch.AcceleratorError: illegal memory access" >&2; exit 1;;
  *"device_count"*) echo 1;;
  *"get_device_name"*) echo "gpu_check: fake GPU";;
esac
exit 0
""")
    fake.chmod(0o755)
    work = tmp_path / "repo"
    (work / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(SCRIPT, work / "benchmarks" / "gpu_check.sh")
    done = subprocess.run([bash, str(work / "benchmarks" / "gpu_check.sh")], capture_output=True,
                          text=True, env={"PY": str(fake), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    calls = ran.read_text()
    for later in ("gpu_sections.py oom_step", "gpu_sections.py oom_backward", "-m pytest",
                  "long_context_gpu.py"):
        assert later in calls, calls
    assert "=== CUDA tests ===" in (work / "benchmarks" / "results" / "gpu_check.log").read_text()
