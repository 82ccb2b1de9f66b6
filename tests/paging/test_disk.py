"""The disk tier through the optimizer: no room is an OSError with nothing changed, a spill file
truncated mid-run is an error (not SIGBUS), a killed process's spill folder is cleaned."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tightfit.optim.adamw import PagedAdamW

from ..tiers.disks import TINY, tiny_folder

PAGE = 16 << 10
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _params(n: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(150_000, generator=gen) for _ in range(n)]  # 4.6 MiB of state


def _grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _state(opt: PagedAdamW) -> dict:
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}


def test_placing_pages_on_a_full_disk_raises_before_anything_changes(tmp_path, monkeypatch):
    params = _params()
    before = [p.clone() for p in params]
    with tiny_folder(tmp_path, monkeypatch) as tiny:
        opt = PagedAdamW(params, lr=1e-2, page_bytes=PAGE, device_budget=8 * PAGE,
                         spill_dir=tiny)  # fmt: skip
        _grads(params, 1)
        with pytest.raises(OSError) as info:
            opt.step()  # the first step places the pages: ~4.5 MiB must go to disk
        message = str(info.value)
        assert tiny in message and "bytes of optimizer state" in message
        need = sum(p.nbytes for p in opt.pager.pages) - 6 * PAGE  # all but the resident ones
        assert str(need) in message and "spill_dir=" in message and "device_budget" in message
        # nothing changed: params, state, step counts, tiers, and nothing left on the disk
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert opt.state_dict()["state"] == {} and opt.pager.device_bytes == 0
        assert {p.tier for p in opt.pager.pages} == {"new"} and os.listdir(tiny) == []
        with pytest.raises(OSError, match="no room"):
            opt.step()  # a retry is refused the same way: nothing was half done
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert opt.state_dict()["state"] == {} and os.listdir(tiny) == []
        opt.close()


def test_evicting_onto_a_full_disk_raises_and_keeps_every_page(tmp_path, monkeypatch) -> None:
    params = _params()
    with tiny_folder(tmp_path, monkeypatch) as tiny:
        opt = PagedAdamW(params, lr=1e-2, page_bytes=PAGE, spill_dir=tiny)
        _grads(params, 1)
        opt.step()  # unlimited: everything on the device, nothing on disk yet
        reference, limit = _state(opt), opt.pager.device_limit
        events = len(opt.paging_events())
        with pytest.raises(OSError, match="no room"):
            opt.pager.evict_bytes(TINY * 3, "test: a spike")
        assert opt.pager.device_limit == limit and opt.pager.disk_bytes() == 0
        assert len(opt.paging_events()) == events  # no move was made, none logged
        after = _state(opt)
        assert all(torch.equal(reference[i][k], after[i][k]) for i in reference for k in after[i])
        freed = opt.pager.evict_bytes(TINY // 2, "test: a small spike")  # what fits, works
        assert freed >= TINY // 2 and opt.pager.disk_bytes() > 0
        opt.close()


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (a SIGBUS there cannot take the test run down)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def test_a_spill_file_truncated_mid_run_is_an_error_not_a_signal(tmp_path) -> None:
    proc = _run("""
        import os, sys, torch
        from tightfit.optim.adamw import PagedAdamW
        params = [torch.randn(30_000)]
        opt = PagedAdamW(params, page_bytes=16 << 10, device_budget=2 * (16 << 10),
                         spill_dir=sys.argv[1])
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        os.truncate(os.path.join(opt.memory_stats()["spill_dir"], "group0.spill"), 0)
        for what in (opt.step, opt.finish_step, opt.state_dict):
            try:
                what()
            except OSError as exc:
                print("OSError", exc.errno, exc)
        opt.close()
        print("closed")
    """, str(tmp_path))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -7 would be SIGBUS
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 and lines[-1] == "closed", proc.stdout
    for line in lines[:3]:  # every later access says so, none touches the mapping
        assert line.startswith("OSError 5 ") and "truncated to 0 bytes" in line, line
        assert "group0.spill" in line


def test_a_killed_processs_spill_folder_is_removed_by_the_next_one(tmp_path) -> None:
    proc = _run("""
        import os, signal, sys, torch
        from tightfit.optim.adamw import PagedAdamW
        params = [torch.randn(30_000)]
        opt = PagedAdamW(params, page_bytes=16 << 10, device_budget=2 * (16 << 10),
                         spill_dir=sys.argv[1])
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        print(opt.memory_stats()["spill_dir"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no finalizer: a crash
    """, str(tmp_path))
    assert proc.returncode == -9
    left = proc.stdout.strip()
    assert os.path.isdir(left) and any(f.endswith(".spill") for f in os.listdir(left))
    params = [torch.randn(100)]
    opt = PagedAdamW(params, spill_dir=tmp_path)  # a new optimizer in the same place
    assert not os.path.exists(left)
    cleanup = [e for e in opt.paging_events() if e.kind == "cleanup"]
    assert len(cleanup) == 1 and left in cleanup[0].reason and cleanup[0].nbytes > 0
    opt.close()
