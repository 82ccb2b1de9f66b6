"""SpillArea: room reserved per range (a full disk is an OSError, nothing left behind), files
checked before they are touched, an owner file in every folder, stale folders removed."""

from __future__ import annotations

import errno
import json
import os

import pytest

from tightfit.integrity.owners import OWNER_FILE, read_owner, this_process
from tightfit.tiers.spill import SpillArea

from .disks import TINY, tiny_folder

MiB = 1 << 20


def test_commit_reserves_only_the_ranges_asked_for(tmp_path) -> None:
    spill = SpillArea(tmp_path)
    spill.reserve(0, 64 * MiB)
    spill.commit(0, 8 * MiB, 2 * MiB)
    path = os.path.join(spill.folder, "group0.spill")
    st = os.stat(path)
    assert st.st_size == 64 * MiB  # the whole group's extent ...
    assert 2 * MiB <= st.st_blocks * 512 < 3 * MiB  # ... but disk only for the range
    region = spill.region(0, 8 * MiB, 2 * MiB)
    assert int(region.count_nonzero()) == 0  # a reserved range reads as zeros
    assert read_owner(spill.folder) == this_process()
    spill.close()
    assert os.listdir(tmp_path) == []


def test_a_disk_without_room_is_an_oserror_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    with tiny_folder(tmp_path, monkeypatch) as tiny:
        spill = SpillArea(tiny)
        spill.reserve(0, 4 * TINY)
        with pytest.raises(OSError) as info:
            spill.commit(0, 0, 4 * TINY)
        assert info.value.errno == errno.ENOSPC
        assert os.listdir(tiny) == []  # the file, the folder and its owner file are gone
        assert spill.folder is None
        spill.commit(0, 0, TINY // 4)  # a range that fits still works afterwards
        assert sorted(os.listdir(spill.folder)) == ["group0.spill", OWNER_FILE]
        spill.close()


def test_a_failed_range_of_an_existing_file_keeps_the_file(tmp_path, monkeypatch) -> None:
    spill = SpillArea(tmp_path)
    spill.reserve(0, 8 * MiB)
    spill.commit(0, 0, MiB)
    spill.region(0, 0, MiB).fill_(7)

    def no_room(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="No space"):
        spill.commit(0, MiB, MiB)
    assert bool((spill.region(0, 0, MiB) == 7).all())  # what was there stays
    spill.close()


def test_check_sees_a_truncated_file_before_anything_touches_it(tmp_path) -> None:
    spill = SpillArea(tmp_path)
    spill.reserve(0, 2 * MiB)
    spill.commit(0, 0, 2 * MiB)
    spill.check(0, MiB, MiB)
    path = os.path.join(spill.folder, "group0.spill")
    os.truncate(path, MiB + 10)
    spill.check(0, 0, MiB)  # what is still there is fine
    with pytest.raises(OSError, match="truncated to 1048586 bytes") as info:
        spill.check(0, MiB, MiB)  # touching this would raise SIGBUS: refused instead
    assert info.value.filename == path and info.value.errno == errno.EIO
    spill.close()


def test_a_new_area_removes_folders_of_dead_processes_only(tmp_path) -> None:
    first = SpillArea(tmp_path)
    first.reserve(0, MiB)
    first.commit(0, 0, MiB)
    mine = first.folder
    stale = tmp_path / "tightfit-spill-stale"
    stale.mkdir()
    (stale / "group0.spill").write_bytes(b"x" * 8192)
    # this pid, another start time: a process that is gone (its pid was reused)
    owner = {"pid": os.getpid(), "started": 1.0, "host": this_process().host}
    (stale / OWNER_FILE).write_text(json.dumps(owner))
    nameless = tmp_path / "tightfit-spill-nameless"  # no owner file: never touched
    nameless.mkdir()
    second = SpillArea(tmp_path)
    assert [(r.path, r.pid) for r in second.cleaned] == [(str(stale), os.getpid())]
    assert second.cleaned[0].nbytes >= 8192
    assert not stale.exists() and nameless.exists() and os.path.isdir(mine)  # live: kept
    first.close()
    second.close()
