"""Issue 28 item 11: the Makefile's install takes torch from the machine's index by default and
from ``TORCH_INDEX`` when given (PyTorch's CPU index on a CPU-only machine, a CUDA index of the
driver's version), the pinned version either way; the package itself always from the default."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands(tmp_path: Path, *extra: str) -> list[str]:
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make on this machine")
    out = subprocess.run([make, "-n", "-B", "setup", f"VENV={tmp_path / 'venv'}", *extra],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "pip install" in line]


def test_torch_comes_pinned_from_the_default_index(tmp_path: Path) -> None:
    torch_line, package_line = _setup_commands(tmp_path)
    assert "-c requirements/constraints.txt" in torch_line and torch_line.endswith(" torch")
    assert "--index-url" not in torch_line + package_line
    assert '-e ".[dev]"' in package_line


def test_torch_index_picks_the_index_of_torch_only(tmp_path: Path) -> None:
    url = "https://example.invalid/whl/cpu"
    torch_line, package_line = _setup_commands(tmp_path, f"TORCH_INDEX={url}")
    assert f"--index-url {url} torch" in torch_line
    assert "-c requirements/constraints.txt" in torch_line
    assert "--index-url" not in package_line
