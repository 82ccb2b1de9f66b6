"""Temp names carry their owner; a cleanup removes the temps of dead processes of this host
and nothing else (a live process's, another host's, an old name without an owner, another
prefix)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tightfit.integrity.owners import this_process
from tightfit.integrity.temps import owner_of, remove_stale_temps, temp_path

PREFIX = ".thing.tmp-"


def _dead_token() -> str:
    """The owner token of a process that has exited."""
    code = "from tightfit.integrity.temps import owner_token; print(owner_token())"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_temp_name_records_this_process_and_nothing_is_created(tmp_path) -> None:
    path = temp_path(tmp_path, PREFIX)
    name = os.path.basename(path)
    assert os.path.dirname(path) == str(tmp_path) and not os.path.exists(path)
    assert re.fullmatch(re.escape(PREFIX) + r"p\d+\.s\d+\.h[0-9a-f]{8}-[0-9a-f]{12}", name)
    owner, me = owner_of(name, PREFIX), this_process()
    assert owner is not None
    assert (owner.pid, owner.host) == (me.pid, me.host)
    assert abs(owner.started - me.started) < 0.002  # kept in ms
    assert temp_path(tmp_path, PREFIX) != path  # a random part: two temps never collide
    assert owner_of(name, ".other-") is None
    assert owner_of(PREFIX + "k3j2h1", PREFIX) is None  # an old name: no owner part


def test_only_dead_processes_temps_are_removed(tmp_path) -> None:
    dead = _dead_token()
    dead_file = tmp_path / f"{PREFIX}{dead}-aaaa"
    dead_file.write_bytes(b"x" * 10_000)
    dead_dir = tmp_path / f"{PREFIX}{dead}-bbbb-step-00000002"  # a temp that is a folder
    (dead_dir / "adapter").mkdir(parents=True)
    (dead_dir / "adapter" / "w.bin").write_bytes(b"y" * 20_000)
    live = Path(temp_path(tmp_path, PREFIX))
    live.write_bytes(b"")
    host = re.sub(r"\.h[0-9a-f]{8}", ".hdeadbeef", dead)  # the same pid on another machine
    kept = [
        live,
        tmp_path / f"{PREFIX}{host}-cccc",
        tmp_path / f"{PREFIX}k3j2h1",  # written before names had owners
        tmp_path / f".other-{dead}-dddd",  # not a prefix asked for
        tmp_path / "results.json",
    ]
    for path in kept[1:]:
        path.write_bytes(b"z")
    removed = remove_stale_temps(tmp_path, (PREFIX,))
    assert sorted(r.path for r in removed) == sorted([str(dead_file), str(dead_dir)])
    assert {r.pid for r in removed} == {int(dead.split(".")[0][1:])}
    freed = {r.path: r.nbytes for r in removed}
    assert freed[str(dead_file)] >= 10_000 and freed[str(dead_dir)] >= 20_000  # disk blocks
    assert not dead_file.exists() and not dead_dir.exists()
    assert all(p.exists() for p in kept)
    assert remove_stale_temps(tmp_path, (PREFIX,)) == []  # nothing left to remove
    assert remove_stale_temps(tmp_path / "absent", (PREFIX,)) == []

