"""Names of a recording's files and the liveness of the processes that write them.

A streaming recording leaves, per rank, in its output directory::

    .moetrace-<run_id>-rank<r>-seg<index:06d>.h5    closed segments (streaming modes)
    .moetrace-<run_id>-rank<r>-checkpoint.h5        the checkpoint (``stat`` mode)
    .moetrace-<run_id>-rank<r>.journal              the journal (:mod:`moetrace.trace.journal`)

and every :class:`~moetrace.trace.writer.TraceWriter` writes to a temporary
``.<final name>.tmp-<host>-<pid>-<8 hex>`` (:func:`temporary_path`) until it commits.
Temporary files of writers that died are swept by :func:`sweep_dead_temporaries`
only when their process is gone *and* no process holds the file open (HDF5
keeps an exclusive ``flock`` on every file it writes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "CHECKPOINT_RE",
    "JOURNAL_RE",
    "SEGMENT_RE",
    "checkpoint_path",
    "exclusively",
    "journal_path",
    "parse_temporary",
    "process_alive",
    "segment_path",
    "sweep_dead_temporaries",
    "temporary_path",
]

_PREFIX = ".moetrace-"
SEGMENT_RE = re.compile(r"^\.moetrace-(?P<run>[0-9a-zA-Z_]+)-rank(?P<rank>\d+)-seg(?P<index>\d{6})\.h5$")
CHECKPOINT_RE = re.compile(r"^\.moetrace-(?P<run>[0-9a-zA-Z_]+)-rank(?P<rank>\d+)-checkpoint\.h5$")
JOURNAL_RE = re.compile(r"^\.moetrace-(?P<run>[0-9a-zA-Z_]+)-rank(?P<rank>\d+)\.journal$")
# TraceWriter temporaries: ".<final name>.tmp-<host>-<pid>-<8 hex>"
_TEMP_RE = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]{8})$")

def segment_path(directory: Path, run_id: str, rank: int, index: int) -> Path:
    return Path(directory) / f"{_PREFIX}{run_id}-rank{rank}-seg{index:06d}.h5"


def checkpoint_path(directory: Path, run_id: str, rank: int) -> Path:
    return Path(directory) / f"{_PREFIX}{run_id}-rank{rank}-checkpoint.h5"


def journal_path(directory: Path, run_id: str, rank: int) -> Path:
    return Path(directory) / f"{_PREFIX}{run_id}-rank{rank}.journal"


def temporary_path(path: Path) -> Path:
    """A fresh temporary name beside ``path`` that says which host and process writes it."""
    path = Path(path)
    return path.parent / f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def process_alive(pid: int, host: str) -> bool | None:
    """Whether ``pid`` runs on this host (``None`` when ``host`` is another machine: unknown).

    A zombie (killed or exited, not yet reaped by its parent) is dead: it can write nothing more. SGLang's
    engine SIGKILLs its scheduler processes at shutdown and leaves them zombies until it starts another
    process, so a recovery run in the engine's own process must not take them for live writers.
    """
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return not _exited(pid)


def _exited(pid: int) -> bool:
    """Whether ``pid``, which ``kill(pid, 0)`` found, has exited: a zombie, or reaped since (Linux ``/proc``;
    ``False`` where there is no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self/stat").exists()  # reaped between the two looks
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("Z", "X")


def parse_temporary(path: Path) -> tuple[str, str, int] | None:
    """``(final name, host, pid)`` of a :class:`TraceWriter` temporary, else ``None``."""
    match = _TEMP_RE.match(Path(path).name)
    if match is None:
        return None
    return match["target"], match["host"], int(match["pid"])


@contextlib.contextmanager
def exclusively(path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` for the block; yields whether it was had.

    ``False`` when another process holds the file open under HDF5's locking (a
    writer, or a reader: HDF5 takes a shared lock on every file it opens), or
    the file cannot be opened. Removing or replacing the file inside the block
    cannot race a reader that locks it.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _unused(path: Path) -> bool:
    """True when no process holds ``path`` open (an exclusive flock succeeds)."""
    with exclusively(path) as free:
        return free


def sweep_dead_temporaries(directory: Path) -> list[Path]:
    """Delete the writer temporaries in ``directory`` left by dead processes of this host.

    A file is removed only when its name carries this host, its pid no longer
    runs and no process holds it open; anything else (a live writer, another
    machine on a shared file system) is left alone. Returns the removed paths.
    """
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for path in entries:
        parsed = parse_temporary(path)
        if parsed is None or not path.is_file():
            continue
        _, host, pid = parsed
        if process_alive(pid, host) is False and _unused(path):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed
