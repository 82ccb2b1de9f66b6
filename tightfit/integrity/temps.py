"""Temp files that name their process, and removing those whose process is gone.

An atomic write goes to a temp file next to its target, then ``os.replace`` puts it in place.
A process killed mid-write (``kill -9``, the OOM killer, a power cut) leaves the temp behind,
and for a saved optimizer state it is the size of the state. So the temp's *name* carries its
owner (pid, process start time and a hash of the host name, as the spill folders' owner files
do, :mod:`tightfit.integrity.owners`), and the next write or run in the same folder removes the
temps whose process no longer exists. A name is known before the file exists, so a caller that
creates it inside ``try`` can always remove it again, even when an interrupt lands in the
middle of the creating call; a kill is what the name is for.

Temps of a live process, of another host, of another user, and names without an owner part
(written by older versions: their pid alone cannot tell a dead owner from a reused pid) are
never touched.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import zlib

from tightfit.integrity.owners import Owner, Removed, remove_dead, this_process

# p<pid>.s<start time, ms>.h<crc32 of the host name>: letters and digits only, any file system
_TOKEN = re.compile(r"p(\d+)\.s(\d+)\.h([0-9a-f]{8})")


def _host_hash(host: str) -> str:
    return f"{zlib.crc32(host.encode()):08x}"


def owner_token() -> str:
    """This process as it appears in a temp's name (``p1234.s1712345678901.h0badf00d``)."""
    me = this_process()
    return f"p{me.pid}.s{round(me.started * 1000)}.h{_host_hash(me.host)}"


def temp_path(folder: str | os.PathLike[str], prefix: str) -> str:
    """A fresh temp file name in ``folder``: ``prefix``, this process's token, a random part.

    Nothing is created: open it with ``"xb"`` (exclusive) inside the ``try`` that removes it
    on failure.
    """
    return os.path.join(os.fspath(folder), f"{prefix}{owner_token()}-{secrets.token_hex(6)}")


def owner_of(name: str, prefix: str) -> Owner | None:
    """The owner a temp named ``name`` (made with ``prefix``) records, or ``None``."""
    if not name.startswith(prefix):
        return None
    m = _TOKEN.match(name, len(prefix))
    if m is None:
        return None
    here = socket.gethostname()
    host = here if m.group(3) == _host_hash(here) else f"another host ({m.group(3)})"
    return Owner(int(m.group(1)), int(m.group(2)) / 1000, host)


def remove_stale_temps(folder: str | os.PathLike[str], prefixes: tuple[str, ...]) -> list[Removed]:
    """Remove the temps in ``folder`` named ``prefix<token>...`` whose owner process is gone.

    Only entries of this user whose token names a process of this host that no longer exists
    are removed (files, or folders for temps that are folders); what cannot be removed (a
    permission, a race with another cleaner) is left as it is.

    Returns:
        What was removed (path, the owner's pid, the disk bytes freed).
    """
    return remove_dead(
        folder, lambda e: next((o for p in prefixes if (o := owner_of(e.name, p)) is not None), None)
    )
