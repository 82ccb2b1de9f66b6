"""A folder on a disk with no room: a real 1 MiB tmpfs where this process may mount one, else a
folder whose ``posix_fallocate`` (the reservation the disk tier makes) fails past 1 MiB."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

TINY = 1 << 20


@contextlib.contextmanager
def tiny_folder(base: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Yield a folder where at most about :data:`TINY` bytes can be reserved."""
    mnt = base / "tiny"
    mnt.mkdir()
    mount = shutil.which("mount")
    made = mount is not None and os.geteuid() == 0 and subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={TINY}", "tmpfs", str(mnt)], capture_output=True
    ).returncode == 0  # fmt: skip
    if not made:
        real = os.posix_fallocate

        def fallocate(fd: int, offset: int, nbytes: int) -> None:
            if offset + nbytes > TINY:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, offset, nbytes)

        monkeypatch.setattr(os, "posix_fallocate", fallocate)
    try:
        yield str(mnt)
    finally:
        if made:
            _unmount(mnt)


def _unmount(mnt: Path) -> None:
    """Unmount the test's tmpfs, saying so if it stays mounted (it holds at most 1 MiB)."""
    umount = shutil.which("umount") or "/usr/bin/umount"
    for args in ([umount, str(mnt)], [umount, "-l", str(mnt)]):
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode == 0:
            return
    warnings.warn(f"could not unmount the test tmpfs {mnt}: {done.stderr.strip()}", stacklevel=2)
