"""Process-group setup under ``torchrun``, and a guarded ``torchrun`` runner.

``torchrun --nproc_per_node N`` starts N copies of a script with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. :func:`init_from_env` turns that into a
process group (NCCL on CUDA, gloo on the CPU) and a :class:`DistInfo`; without those variables it
returns a single-process :class:`DistInfo` and initializes nothing, so one script serves both.
:func:`run_torchrun` launches a script that way from Python (tests, benchmarks) on the loopback
interface with a free port, and kills the whole process tree on timeout so nothing hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Backend = Literal["auto", "gloo", "nccl"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global rank (0 when not distributed).
        world_size: number of processes (1 when not distributed).
        local_rank: rank on this machine; picks the CUDA device.
        device: the device this rank computes on.
        distributed: whether a process group was initialized by :func:`init_from_env`.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes reports and prints."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when the launcher environment variables (``RANK``, ``WORLD_SIZE``) are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(
    backend: Backend = "auto",
    device: Literal["auto", "cpu", "cuda"] = "auto",
    timeout_s: float = 120.0,
) -> DistInfo:
    """Initialize the default process group from torchrun's environment variables.

    Args:
        backend: ``"auto"`` picks NCCL when the device is CUDA (with gloo for CPU tensors:
            ``"cpu:gloo,cuda:nccl"``) and gloo otherwise.
        device: ``"auto"`` uses ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU.
        timeout_s: collective timeout; a stuck peer fails the job instead of hanging it.

    Returns:
        The rank layout. Without torchrun's variables: a single-process layout, nothing
        initialized. Calling it again after initialization returns the same layout.

    Raises:
        ValueError: on an unknown backend/device, or NCCL asked for without CUDA.
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'gloo', 'nccl'")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda'")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; pass device='cpu'")
    if backend == "nccl" and not use_cuda:
        raise ValueError("backend='nccl' needs CUDA devices; use backend='gloo' on the CPU")
    if not launched_by_torchrun():
        dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return DistInfo(device=dev)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not torch.distributed.is_initialized():
        # auto on CUDA: NCCL for CUDA tensors, gloo for CPU ones (--fsdp-offload keeps the
        # grads on the host: gradient clipping's norm is then reduced there)
        name = backend if backend != "auto" else ("cpu:gloo,cuda:nccl" if use_cuda else "gloo")
        torch.distributed.init_process_group(
            name,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
        )
    return DistInfo(rank, world, local_rank, dev, distributed=True)


def close() -> None:
    """Destroy the default process group if one is initialized (end of a script)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` alone.

    Used to collect per-rank figures (memory stats, timings) for one report.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def fsdp_unavailable() -> str | None:
    """Why FSDP2 on CPU ranks (gloo) cannot run here, or ``None`` when it can.

    What the CPU test suite and ``selfcheck --device cpu`` need: torch.distributed with the
    gloo backend and FSDP2's ``fully_shard``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        return "torch.distributed with the gloo backend is not available on this platform"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return "FSDP2 (torch.distributed.fsdp.fully_shard) is not available in this torch"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_command(
    target: Sequence[str], nproc: int, *, port: int | None = None, module: bool = False
) -> list[str]:
    """The argv of ``torchrun --nproc_per_node nproc`` on 127.0.0.1, with this interpreter.

    Args:
        target: script path (or module name when ``module``) followed by its arguments.
        nproc: processes to start on this machine.
        port: rendezvous port; a free one when None.
        module: run ``target[0]`` as a module (``python -m``).
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    if not target:
        raise ValueError("target is empty; pass the script (or module) and its arguments")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={port or free_port()}",
    ]  # fmt: skip
    if module:
        cmd.append("-m")
    return [*cmd, *target]


def run_torchrun(
    target: Sequence[str],
    nproc: int,
    *,
    timeout_s: float = 120.0,
    module: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``target`` under torchrun and wait, killing the process tree after ``timeout_s``.

    Gloo is pinned to the loopback interface (unless ``GLOO_SOCKET_IFNAME`` is already set) so
    a machine whose hostname resolves to an unreachable address still works.

    Returns:
        The completed process (text stdout/stderr); check ``returncode``.

    Raises:
        subprocess.TimeoutExpired: if the job outlived ``timeout_s`` (launcher and workers
            have been killed).
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    if sys.platform.startswith("linux"):
        full_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    full_env.setdefault("OMP_NUM_THREADS", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)  # never inherit a parent job's layout
    proc = subprocess.Popen(
        torchrun_command(target, nproc, module=module),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,  # own process group: a timeout kills workers too
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout_s, output=out, stderr=err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process it started.

    torchrun starts each worker in a session of its own, so killing the launcher's process
    group alone leaves the workers running: freeze the launcher (no new workers), collect its
    descendants, then kill them all.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        root.suspend()
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # anything else left in the launcher's own group
    psutil.wait_procs(procs, timeout=5)
