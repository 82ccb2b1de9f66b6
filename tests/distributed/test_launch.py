"""torchrun helpers: single-process layout, command line, and a timeout that kills the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from tightfit.distributed import launch

pytestmark = pytest.mark.distributed


def test_without_torchrun_nothing_is_initialized(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    info = launch.init_from_env(device="cpu")
    assert (info.rank, info.world_size, info.distributed, info.is_main) == (0, 1, False, True)
    assert not dist.is_initialized()
    assert launch.gather_objects({"x": 1}) == [{"x": 1}]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="backend='mpi'"):
        launch.init_from_env(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use backend='gloo'"):
        launch.init_from_env(backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="nproc=0"):
        launch.torchrun_command(["x.py"], 0)
    with pytest.raises(ValueError, match="target is empty"):
        launch.torchrun_command([], 2)


def test_torchrun_command_uses_loopback_and_this_python() -> None:
    cmd = launch.torchrun_command(["pkg.mod", "--a", "1"], 2, port=12345, module=True)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in cmd and "--master_addr=127.0.0.1" in cmd
    assert "--master_port=12345" in cmd
    assert cmd[-4:] == ["-m", "pkg.mod", "--a", "1"]
    assert 0 < launch.free_port() < 65536


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_timeout_kills_the_whole_job(tmp_path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, time\n"
        f"open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
        "time.sleep(600)\n"
    )
    deadline = time.monotonic() + 60
    timeout = 5.0
    while True:  # a loaded machine may need longer just to start the workers
        with pytest.raises(subprocess.TimeoutExpired):
            launch.run_torchrun([str(script)], 2, timeout_s=timeout)
        if len(os.listdir(pids)) == 2 or time.monotonic() > deadline:
            break
        timeout *= 2
    started = [int(p) for p in os.listdir(pids)]
    assert len(started) == 2, "the workers never started"
    end = time.monotonic() + 10
    while any(_alive(p) for p in started) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(p) for p in started)
