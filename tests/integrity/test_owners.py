"""Owner records: a live process is alive, a finished one (or a later one with its pid) is not,
another host is never judged; stale folders are removed, nothing else is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

import psutil

from tightfit.integrity.owners import (
    OWNER_FILE,
    Owner,
    is_alive,
    read_owner,
    remove_stale,
    this_process,
    write_owner,
)


def _finished_process() -> Owner:
    """The owner record of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    started = psutil.Process(proc.pid).create_time()
    proc.wait()
    return Owner(proc.pid, started, this_process().host)


def test_the_owner_file_names_this_process(tmp_path) -> None:
    write_owner(str(tmp_path))
    assert read_owner(str(tmp_path)) == this_process()
    assert sorted(os.listdir(tmp_path)) == [OWNER_FILE]  # written atomically: no temp left
    (tmp_path / OWNER_FILE).write_text("{not json")
    assert read_owner(str(tmp_path)) is None


def test_alive_dead_reused_pid_and_other_host() -> None:
    me = this_process()
    assert is_alive(me)
    assert not is_alive(_finished_process())
    assert not is_alive(replace(me, started=me.started - 3600))  # our pid, an older process
    assert is_alive(replace(_finished_process(), host="another-machine"))  # cannot tell: keep


def test_remove_stale_takes_only_folders_of_gone_processes(tmp_path) -> None:
    def folder(name: str, owner: Owner | None) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "group0.spill").write_bytes(b"\1" * 20_000)
        if owner is not None:
            (path / OWNER_FILE).write_text(json.dumps(asdict(owner)))
        return str(path)

    dead = folder("tightfit-spill-dead", _finished_process())
    live = folder("tightfit-spill-live", this_process())
    unowned = folder("tightfit-spill-unowned", None)
    other = folder("someone-else", _finished_process())
    (tmp_path / "tightfit-spill-file").write_text("a file, not a folder")
    removed = remove_stale(str(tmp_path), "tightfit-spill-")
    assert [r.path for r in removed] == [dead] and removed[0].nbytes >= 20_000
    assert not os.path.exists(dead)
    assert all(os.path.isdir(p) for p in (live, unowned, other))
    assert remove_stale(str(tmp_path / "missing"), "tightfit-spill-") == []
