"""Which process made a spill folder, and removing the folders whose process is gone.

A process killed with ``kill -9`` (or by the OOM killer, or a power cut) cannot delete its spill
folder, and on a real model that folder is the size of the optimizer state. So each folder gets
an owner file naming its process (pid, start time, host) the moment it is made, and the next
store that starts in the same parent folder removes the siblings whose process no longer
exists. A live process's folder, a folder on another host (its pids mean nothing here), another
user's folder and a folder without a readable owner file (one still being made, or not ours)
are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass

import psutil

OWNER_FILE = "owner.json"


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one that reuses its pid by its start time.

    Attributes:
        pid: process id.
        started: start time (``psutil.Process.create_time()``, seconds since the epoch).
        host: the machine's host name.
    """

    pid: int
    started: float
    host: str


@dataclass(frozen=True)
class Removed:
    """A stale folder that was removed: where, whose, and the disk bytes it held."""

    path: str
    pid: int
    nbytes: int


def this_process() -> Owner:
    """The calling process as an :class:`Owner`."""
    return Owner(os.getpid(), psutil.Process().create_time(), socket.gethostname())


def write_owner(folder: str) -> None:
    """Write this process's owner file into ``folder`` (atomically: a reader sees all or none)."""
    me = this_process()
    tmp = os.path.join(folder, f".{OWNER_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"pid": me.pid, "started": me.started, "host": me.host}, f)
    os.replace(tmp, os.path.join(folder, OWNER_FILE))


def read_owner(folder: str) -> Owner | None:
    """The owner recorded in ``folder``, or ``None`` when there is no readable owner file."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            data = json.load(f)
        return Owner(int(data["pid"]), float(data["started"]), str(data["host"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_alive(owner: Owner) -> bool:
    """Whether ``owner`` may still be running (``True`` whenever this machine cannot tell)."""
    if owner.host != socket.gethostname():
        return True
    try:
        proc = psutil.Process(owner.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # exited; its files are closed
            return False
        # a later process with the same pid is not the owner (start times are in clock ticks)
        return abs(proc.create_time() - owner.started) < 0.05
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # it exists, and is not ours to judge
        return True


def disk_bytes(path: str | os.PathLike[str]) -> int:
    """Disk bytes a file, or a folder with everything under it, holds (allocated blocks, so a
    sparse or fallocated spill file counts what it takes, not its length); symlinks are not
    followed."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):  # a file, or a symlink (to a folder, too)
        return st.st_blocks * 512
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def remove_dead(
    folder: str | os.PathLike[str], owner_of: Callable[[os.DirEntry[str]], Owner | None]
) -> list[Removed]:
    """Remove the entries of ``folder`` that ``owner_of`` gives an owner whose process is gone.

    Only entries of this user whose owner is a process of this host that no longer exists are
    removed (files, or folders with all they hold); ``owner_of`` returns ``None`` for entries
    that are not its to judge. What cannot be removed (a permission, a race with another
    cleaner) is left as it is.

    Returns:
        What was removed (path, the owner's pid, the disk bytes freed).
    """
    removed: list[Removed] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            owner = owner_of(entry)
            if owner is None or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if is_alive(owner):
                continue
            nbytes = disk_bytes(entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Removed(entry.path, owner.pid, nbytes))
    return removed


def remove_stale(parent: str, prefix: str) -> list[Removed]:
    """Remove the folders in ``parent`` named ``prefix*`` whose owner process is gone.

    Only folders of this user with a readable owner file of this host whose process no longer
    exists are removed (:func:`remove_dead`).

    Returns:
        What was removed.
    """

    def owner_file(entry: os.DirEntry[str]) -> Owner | None:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            return None
        return read_owner(entry.path)

    return remove_dead(parent, owner_file)
