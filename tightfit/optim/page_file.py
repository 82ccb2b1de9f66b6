"""Page files: a paged optimizer's state streamed to a file and back, every byte verified.

For states too big for RAM: :func:`save` writes one page at a time into a temp file next to
the target and renames it into place; :func:`load` reads one page at a time. The format,
version 2 (integers little-endian)::

    magic        16 bytes  b"TIGHTFIT-PAGES\\x00\\x02" (the last byte is the version)
    length        8 bytes  of the header
    header       JSON      version, checksum algorithm, optimizer type, each group's
                           hyperparameters, param shapes, step counts, the page layout
    header sum    8 bytes  XXH3-64 of the header's bytes
    for each page, in page order:
      bytes      the page's bytes (page.nbytes)
      sum         8 bytes  XXH3-64 of them

:func:`load` refuses a file whole, before changing anything: a bad magic, length or header
checksum, a header the constructor would refuse (hyperparameters, step counts, another
layout) or any page whose bytes do not match their checksum — it reads every page and
verifies it first, then reads them again (verified again) into the pages. A load that fails
*during* that second pass (the file changed in place meanwhile, an I/O error) has replaced part
of the state: the optimizer is then closed, never left to train on a mix. Ctrl-C during the
second pass is held until the load is complete.

Version 1 files (written before checksums: no sums) are still read, with the same header
checks and a warning that their bytes cannot be verified; :func:`save` writes version 2.

A kill mid-save leaves the temp (``.tightfit-save-<owner>-<random>``, see
:mod:`tightfit.integrity.temps`); the next save into the same folder removes those of processes
that no longer exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings
from typing import IO, Any

import torch

from tightfit.integrity.checksums import ALGORITHM, CorruptStateError, checksum
from tightfit.integrity.interrupts import hold_interrupts
from tightfit.integrity.temps import remove_stale_temps, temp_path
from tightfit.optim.dtensor import local_tensor
from tightfit.optim.torch_format import (
    PagedState,
    checked_step,
    has_state,
    replace_groups_and_steps,
    step_counts,
)
from tightfit.paging.disk import describe
from tightfit.paging.layout import Page

VERSION = 2
_MAGIC_BASE = b"TIGHTFIT-PAGES\x00"
_MAGICS = {_MAGIC_BASE + bytes([v]): v for v in (1, 2)}
_MAGIC = _MAGIC_BASE + bytes([VERSION])
_SUM = struct.Struct("<Q")  # a length or a checksum
TEMP_PREFIX = ".tightfit-save-"
_AGAIN = "save it again, or load another saved state (an earlier one, or a copy)"


def _header(opt: PagedState) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.item()
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        return v

    return {
        "version": VERSION,
        "checksum": ALGORITHM,
        "optimizer": type(opt).__name__,
        "groups": [
            {k: plain(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
        ],
        "params": [[list(local_tensor(p).shape) for p in g["params"]] for g in opt.param_groups],
        "steps": _steps(opt),
        "pages": [[p.group, str(p.dtype), p.elements, p.nbytes] for p in opt.pager.pages],
    }


def _steps(opt: PagedState) -> list[list[float | None]]:
    """Each param's step count (``None`` without state), read from the device at once."""
    held = [p for g in opt.param_groups for p in g["params"] if has_state(opt, p)]
    values = dict(zip(map(id, held), step_counts([opt.state[p]["step"] for p in held])))
    return [[values.get(id(p)) for p in g["params"]] for g in opt.param_groups]


def _bytes_sum(data: bytes) -> int:
    return checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def save(opt: PagedState, path: str | os.PathLike) -> None:
    """Stream every page to ``path`` with its checksum; a crash mid-write leaves any old file
    intact (and a temp the next save into the folder removes once this process is gone)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"folder {folder!r} does not exist; create it before save()")
    header = json.dumps(_header(opt)).encode()
    remove_stale_temps(folder, (TEMP_PREFIX,))
    tmp = temp_path(folder, TEMP_PREFIX)  # named before it exists: always removable below
    try:
        with open(tmp, "xb") as f:
            f.write(_MAGIC + _SUM.pack(len(header)) + header + _SUM.pack(_bytes_sum(header)))
            for page in opt.pager.pages:  # one page in RAM at a time
                data = opt.pager.read_page(page)
                f.write(memoryview(data.numpy()))
                f.write(_SUM.pack(checksum(data)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _sync_folder(folder)  # the rename itself survives a power cut


def _sync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):  # not every file system can fsync a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _corrupt(path: str, what: str) -> CorruptStateError:
    what = f"the saved optimizer state {path!r} is damaged: {what}"
    return CorruptStateError(f"{what}. Nothing was loaded; {_AGAIN}", what)


def _read_header(f: IO[bytes], path: str, size: int) -> tuple[int, dict[str, Any]]:
    """The file's version and header, checked against its length and checksum."""
    magic = f.read(len(_MAGIC))
    version = _MAGICS.get(magic)
    if version is None:
        if magic and any(m.startswith(magic) for m in _MAGICS):
            raise _corrupt(path, f"it is cut short ({size} bytes)")
        raise ValueError(f"{path!r} is not a tightfit page file; pass a file written by save()")
    raw = f.read(_SUM.size)
    if len(raw) < _SUM.size:
        raise _corrupt(path, f"it is cut short ({size} bytes)")
    (n,) = _SUM.unpack(raw)
    room = size - f.tell() - (_SUM.size if version >= 2 else 0)
    if n > room:
        raise _corrupt(path, f"its header length says {n} bytes but only {room} follow")
    header = f.read(n)
    if version >= 2:
        (want,) = _SUM.unpack(f.read(_SUM.size))
        if _bytes_sum(header) != want:
            raise _corrupt(path, f"its header does not match its checksum ({ALGORITHM})")
    try:
        saved = json.loads(header)
    except ValueError:  # UnicodeDecodeError too
        raise _corrupt(path, "its header is not JSON") from None
    if not isinstance(saved, dict):
        raise _corrupt(path, "its header is not a JSON object")
    return version, saved


def _like(current: Any, value: Any) -> Any:
    """A hyperparameter read from JSON in the form of the value it replaces (tuples, tensors)."""
    if isinstance(current, torch.Tensor) and isinstance(value, int | float):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(value, list):
        if len(value) == len(current):
            return tuple(_like(c, v) for c, v in zip(current, value))
        return tuple(value)
    return value


def _check_header(
    opt: PagedState, path: str, saved: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[int, tuple[float, dict[str, Any]]]]:
    """The groups and step counts to install, every one checked as the constructor checks
    its arguments; ``ValueError`` naming what differs or is wrong."""
    fix = "load it into an optimizer built with the same params, groups, hyperparameters and "
    fix += "page_bytes"
    missing = [k for k in ("optimizer", "groups", "params", "steps", "pages") if k not in saved]
    if missing:
        raise ValueError(f"{path!r} has a header without {missing}: it was not written by "
                         f"save() or was edited; {_AGAIN}")
    mine = _header(opt)
    for key, what in (("optimizer", "optimizer type"), ("params", "param shapes"),
                      ("pages", "page layout (page_bytes, dtypes, groups)")):
        if saved[key] != mine[key]:
            raise ValueError(f"{path!r} was saved with another {what}; {fix}")
    groups, steps = saved["groups"], saved["steps"]
    n = [len(g["params"]) for g in opt.param_groups]
    if not (isinstance(groups, list) and len(groups) == len(n)
            and all(isinstance(g, dict) for g in groups)):  # fmt: skip
        raise ValueError(f"{path!r} holds {len(groups) if isinstance(groups, list) else 'no'} "
                         f"param groups' hyperparameters for {len(n)} groups; {fix}")
    if not (isinstance(steps, list) and [len(s) if isinstance(s, list) else -1
                                         for s in steps] == n):  # fmt: skip
        raise ValueError(f"{path!r} lists step counts for other groups than its params "
                         f"({n} params per group); it was edited or damaged: {_AGAIN}")
    new_groups = []
    for gi, (group, sg) in enumerate(zip(opt.param_groups, groups)):
        merged = dict(group)
        merged.update({k: _like(group.get(k), v) for k, v in sg.items() if k != "params"})
        try:
            opt._validate_group(merged)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path!r} holds hyperparameters of param group {gi} that the "
                             f"optimizer refuses: {exc}") from None
        names, ours = ([s.name for s in opt._state_specs(g)] for g in (merged, group))
        if names != ours:
            raise ValueError(f"{path!r} was saved with state {names} in param group {gi} but "
                             f"this optimizer pages {ours}; {fix}")
        new_groups.append(merged)
    items: dict[int, tuple[float, dict[str, Any]]] = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, (p, step) in enumerate(zip(group["params"], steps[gi])):
            if step is not None:
                try:
                    items[id(p)] = (checked_step(f"{pi} of param group {gi}", step), {})
                except ValueError as exc:
                    raise ValueError(f"{path!r}: {exc}") from None
    return new_groups, items


def _read_page(f: IO[bytes], path: str, page: Page, buf: torch.Tensor, version: int) -> torch.Tensor:
    """The next page's bytes from ``f`` (into ``buf``), verified against their checksum."""
    data = buf[: page.nbytes]
    at = f.tell()
    got = f.readinto(memoryview(data.numpy()))
    raw = f.read(_SUM.size) if version >= 2 else b""
    if got != page.nbytes or len(raw) != (_SUM.size if version >= 2 else 0):
        raise _corrupt(path, f"it ends inside {describe(page)}")
    if version >= 2:
        (want,) = _SUM.unpack(raw)
        found = checksum(data)
        if found != want:
            what = (f"the optimizer state of {describe(page)} in the saved file {path!r} (bytes "
                    f"{at}..{at + page.nbytes - 1}) does not match its checksum ({ALGORITHM} "
                    f"{want:#018x} saved, {found:#018x} read): the file was damaged after it "
                    "was written (a disk or memory fault, a partial copy)")
            raise CorruptStateError(f"{what}. Nothing was loaded; {_AGAIN}", what)
    return data


def load(opt: PagedState, path: str | os.PathLike) -> None:
    """Read a :func:`save` file into the pages: everything is checked — the header as the
    constructor checks its arguments, then every page's checksum — before anything changes."""
    path = os.fspath(path)
    pages = opt.pager.pages
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        version, saved = _read_header(f, path, size)
        new_groups, steps = _check_header(opt, path, saved)
        start = f.tell()
        per_page = _SUM.size if version >= 2 else 0
        expected = start + sum(p.nbytes + per_page for p in pages)
        if size != expected:
            raise _corrupt(path, f"it holds {size} bytes where its header needs {expected}")
        buf = torch.empty(max((p.nbytes for p in pages), default=0), dtype=torch.uint8)
        if version >= 2:
            for page in pages:  # verify all, apply nothing: a bad page refuses the file whole
                _read_page(f, path, page, buf, version)
        else:
            warnings.warn(f"{path!r} is a version 1 page file, saved without checksums: its "
                          "bytes cannot be verified (save() writes version 2 with them)",
                          stacklevel=3)
        f.seek(start)
        opt.pager.materialize()  # a full disk refuses here, before any page changes
        with hold_interrupts():  # Ctrl-C: the whole file or (before this) nothing
            written = 0
            try:
                for page in pages:
                    opt.pager.write_page(page, _read_page(f, path, page, buf, version))
                    written += 1
            except Exception as exc:
                if not written:
                    raise
                opt.close()  # part old, part loaded: never trained on
                raise CorruptStateError(
                    f"loading {path!r} failed after part of the state was replaced ({exc}); "
                    "the file changed while it was read, or a read failed. The optimizer was "
                    "closed: make a new one and load a good saved state"
                ) from exc
            replace_groups_and_steps(opt, new_groups, steps)
            opt._clear_pending_step()
