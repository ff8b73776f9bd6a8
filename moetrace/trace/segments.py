"""Crash-safe streaming: a recording as a sequence of complete segment files.

Streaming modes never keep more than one *open* file. Rows go into the open
segment (a :class:`~moetrace.trace.writer.TraceWriter` temporary); at least
every ``segment_seconds`` (at the first pass end after the deadline, see the
recorder) or ``segment_bytes`` of raw rows, the writer thread closes it: it
writes the segment's own ``/stat`` (the totals of exactly the passes in it),
marks it complete, ``fsync``s and renames it to::

    .moetrace-<run_id>-rank<r>-seg<index:06d>.h5

Every closed segment is a valid trace on its own. A SIGKILL therefore loses at
most the open segment plus the rows still staged in memory. ``stat`` mode
writes a checkpoint instead, ``.moetrace-<run_id>-rank<r>-checkpoint.h5``,
replaced atomically on the same schedule.

Next to them a small append-only *journal* (``.moetrace-<run_id>-rank<r>.journal``,
JSON lines, no fsync: a killed process's writes survive in the page cache)
says which process wrote the run, what each segment holds, which segments a
``dump_record`` consumed and which passes were in the open segment, so
``moetrace recover`` can tell what a crash lost.

Temporary files of writers that died are swept by :func:`sweep_dead_temporaries`
only when their process is gone *and* no process holds the file open (HDF5
keeps an exclusive ``flock`` on every file it writes).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from ..layout import RankLayout
from .ranks import read_layouts
from .schema import RANKS_GROUP, TraceError
from .writer import TraceHeader, TraceWriter

__all__ = [
    "CheckpointWriter",
    "Journal",
    "SegmentInfo",
    "SegmentWriter",
    "StreamRows",
    "checkpoint_path",
    "concat_segments",
    "journal_path",
    "parse_temporary",
    "process_alive",
    "segment_path",
    "sweep_dead_temporaries",
]

_PREFIX = ".moetrace-"
SEGMENT_RE = re.compile(r"^\.moetrace-(?P<run>[0-9a-zA-Z_]+)-rank(?P<rank>\d+)-seg(?P<index>\d{6})\.h5$")
CHECKPOINT_RE = re.compile(r"^\.moetrace-(?P<run>[0-9a-zA-Z_]+)-rank(?P<rank>\d+)-checkpoint\.h5$")
JOURNAL_RE = re.compile(r"^\.moetrace-(?P<run>[0-9a-zA-Z_]+)-rank(?P<rank>\d+)\.journal$")
# TraceWriter temporaries: ".<final name>.tmp-<host>-<pid>-<8 hex>"
_TEMP_RE = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]{8})$")

#: Stat datasets that are per-rank totals: summed when segments are joined.
_ADDITIVE = "stat"


def segment_path(directory: Path, run_id: str, rank: int, index: int) -> Path:
    return Path(directory) / f"{_PREFIX}{run_id}-rank{rank}-seg{index:06d}.h5"


def checkpoint_path(directory: Path, run_id: str, rank: int) -> Path:
    return Path(directory) / f"{_PREFIX}{run_id}-rank{rank}-checkpoint.h5"


def journal_path(directory: Path, run_id: str, rank: int) -> Path:
    return Path(directory) / f"{_PREFIX}{run_id}-rank{rank}.journal"


# ----------------------------------------------------------------------------- processes and temporaries
def process_alive(pid: int, host: str) -> bool | None:
    """Whether ``pid`` runs on this host (``None`` when ``host`` is another machine: unknown)."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def parse_temporary(path: Path) -> tuple[str, str, int] | None:
    """``(final name, host, pid)`` of a :class:`TraceWriter` temporary, else ``None``."""
    match = _TEMP_RE.match(Path(path).name)
    if match is None:
        return None
    return match["target"], match["host"], int(match["pid"])


def _unused(path: Path) -> bool:
    """True when no process holds ``path`` open for writing (an exclusive flock succeeds)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise
    finally:
        os.close(fd)  # closing releases the lock
    return True


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


# ----------------------------------------------------------------------------- journal
class Journal:
    """Append-only JSON-lines notes of one rank's recording (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fh = open(self.path, "a", encoding="utf-8")

    def note(self, event: str, **fields: object) -> None:
        line = json.dumps({"event": event, "unix": time.time(), **fields})
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line + "\n")
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, object]]:
        """The journal's events; a torn last line (killed mid-write) is ignored."""
        events = []
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events


# ----------------------------------------------------------------------------- writing
@dataclasses.dataclass
class StreamRows:
    """One hand-off of streamed rows and the counter totals of exactly those passes.

    Attributes:
        rows: ``{dataset: [n, ...] rows}`` to append (e.g. ``"tokens/topk_ids"``).
        totals: ``[L, C]`` int64 counter rows of these passes (see ``CounterLayout``);
            ``None`` when there are no passes.
        passes: passes in ``rows``.
        tokens: tokens in those passes.
        first_pass: pass id of the first pass (``-1`` when ``passes == 0``).
        last_pass: pass id of the last pass.
        dropped_passes: passes dropped (``on_overflow="drop"``) since the previous hand-off.
    """

    rows: dict[str, np.ndarray]
    totals: np.ndarray | None
    passes: int
    tokens: int
    first_pass: int
    last_pass: int
    dropped_passes: int = 0


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """A closed segment: its file and the passes it holds."""

    path: Path
    index: int
    first_pass: int
    last_pass: int
    passes: int
    tokens: int
    closed_unix: float


#: ``write_stat(writer, totals [1, L, C], passes [1], tokens [1])`` writes ``/stat``.
WriteStat = Callable[[TraceWriter, np.ndarray, np.ndarray, np.ndarray], None]


class SegmentWriter:
    """Writes one rank's streamed rows into rotating segment files (writer thread only).

    Args:
        directory: where segments go (the recorder's ``output_dir``).
        header: the trace header of every segment (run id, rank, shapes).
        streamed: ``{dataset: (row shape, dtype)}`` of the streamed group, so an
            empty segment or dump still has every dataset.
        write_stat: writes a segment's ``/stat`` from its totals.
        totals_shape: ``(L, C)`` of the counter rows.
        segment_bytes: close the segment once its raw rows reach this size.
        journal: the run's journal.
        compression: keyword arguments for ``TraceWriter.append`` datasets.
    """

    def __init__(
        self,
        directory: Path,
        header: TraceHeader,
        streamed: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        write_stat: WriteStat,
        totals_shape: tuple[int, int],
        segment_bytes: int,
        journal: Journal,
        compression: Mapping[str, object] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.header = header
        self.streamed = dict(streamed)
        self._write_stat = write_stat
        self.totals_shape = totals_shape
        self.segment_bytes = segment_bytes
        self.journal = journal
        self.compression = compression
        self._index = 0
        self._writer: TraceWriter | None = None
        self._reset_open()
        self._completed: list[SegmentInfo] = []
        self._lock = threading.Lock()

    def _reset_open(self) -> None:
        self._totals: np.ndarray | None = None
        self._passes = self._tokens = self._bytes = self._dropped = 0
        self._first = self._last = -1

    @property
    def open_passes(self) -> int:
        """Passes written into the open (not yet closed) segment."""
        return self._passes

    def write(self, part: StreamRows | dict[str, np.ndarray] | None) -> None:
        """Append one hand-off to the open segment, closing it when it reached ``segment_bytes``.

        A plain ``{dataset: rows}`` dict (rows that belong to no pass count,
        e.g. ``/timing``) is appended as it is.
        """
        if part is None or (isinstance(part, dict) and not part):
            return
        rows = part if isinstance(part, dict) else part.rows
        if self._writer is None:
            target = segment_path(self.directory, self.header.run_id, self.header.rank, self._index)
            self._writer = TraceWriter(target, self.header, compression=self.compression)
        for name, array in rows.items():
            self._writer.append(name, array)
            self._bytes += array.nbytes
        if isinstance(part, dict):
            return
        self._dropped += part.dropped_passes
        if part.passes == 0:
            return
        assert part.totals is not None
        self._totals = part.totals.astype(np.int64) if self._totals is None else self._totals + part.totals
        if self._passes == 0:
            self._first = part.first_pass
        self._passes += part.passes
        self._tokens += part.tokens
        self._last = part.last_pass
        self.journal.note("rows", segment=self._index, first_pass=self._first, last_pass=self._last, passes=self._passes, tokens=self._tokens, dropped_passes=self._dropped)
        if self._bytes >= self.segment_bytes:
            self.rotate()

    def rotate(self) -> None:
        """Close the open segment (``/stat``, complete, fsync, rename); no-op when it holds nothing."""
        writer = self._writer
        if writer is None:
            return
        try:
            for name, (row_shape, dtype) in self.streamed.items():
                writer.ensure_empty(name, row_shape, np.dtype(dtype))
            totals = self._totals if self._totals is not None else np.zeros(self.totals_shape, np.int64)
            self._write_stat(writer, totals[None], np.array([self._passes]), np.array([self._tokens]))
            writer.write("stat/dropped_passes", np.array([self._dropped], dtype=np.int64))
            closed = time.time()
            for key, value in (("segment_index", self._index), ("first_pass", self._first), ("last_pass", self._last), ("segment_unix", closed)):
                writer.set_attr(key, value)
            path = writer.commit()
        except BaseException:
            writer.abort()
            self._writer = None
            raise
        info = SegmentInfo(path, self._index, self._first, self._last, self._passes, self._tokens, closed)
        with self._lock:
            self._completed.append(info)
        self.journal.note("segment", segment=self._index, path=path.name, first_pass=self._first, last_pass=self._last, passes=self._passes, tokens=self._tokens, dropped_passes=self._dropped)
        self._writer = None
        self._index += 1
        self._reset_open()

    def take_completed(self) -> list[SegmentInfo]:
        """Closed segments not taken yet (oldest first); the caller owns their files."""
        with self._lock:
            done, self._completed = self._completed, []
        return done

    def abort(self) -> None:
        """Delete the open segment's temporary (its rows are discarded)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._reset_open()


class CheckpointWriter:
    """``stat`` mode's sink: each job writes a complete checkpoint trace, replacing the previous one atomically.

    A job builds ``(fill, last_pass, passes)``: ``fill(writer)`` writes ``/stat``
    and ``/window``; the checkpoint gets root attributes ``checkpoint_unix`` and
    ``last_pass``.
    """

    def __init__(self, path: Path, header: TraceHeader, journal: Journal, compression: Mapping[str, object] | None = None) -> None:
        self.path = Path(path)
        self.header = header
        self.journal = journal
        self.compression = compression

    def write(self, part: tuple[Callable[[TraceWriter], None], int, int] | None) -> None:
        if part is None:
            return
        fill, last_pass, passes = part
        writer = TraceWriter(self.path, self.header, compression=self.compression)
        try:
            fill(writer)
            now = time.time()
            writer.set_attr("checkpoint_unix", now)
            writer.set_attr("last_pass", last_pass)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        self.journal.note("checkpoint", path=self.path.name, last_pass=last_pass, passes=passes)

    def rotate(self) -> None:
        return None


# ----------------------------------------------------------------------------- joining
def _check_same(paths: Sequence[Path], files: Sequence[h5py.File]) -> None:
    first = files[0].attrs
    for path, f in zip(paths[1:], files[1:], strict=True):
        for key in ("run_id", "rank", "mode", "num_layers", "num_physical_experts", "top_k", "ep_size"):
            if f.attrs.get(key) != first.get(key):
                raise TraceError(f"{path}: {key}={f.attrs.get(key)!r} differs from {paths[0]}'s {first.get(key)!r}; segments of one run and rank only")


def header_of(attrs: Mapping[str, object], layers: np.ndarray, mapping: np.ndarray, layouts: tuple[RankLayout, ...] = ()) -> TraceHeader:
    """A :class:`TraceHeader` that reproduces a trace's root attributes (and its rank layouts)."""
    return TraceHeader(
        mode=str(attrs["mode"]),
        id_space=str(attrs["id_space"]),
        num_layers=int(attrs["num_layers"]),  # type: ignore[call-overload]
        num_physical_experts=int(attrs["num_physical_experts"]),  # type: ignore[call-overload]
        top_k=int(attrs["top_k"]),  # type: ignore[call-overload]
        ep_size=int(attrs["ep_size"]),  # type: ignore[call-overload]
        layer_ids=layers,
        physical_to_logical=mapping,
        model=str(attrs["model"]),
        engine=str(attrs["engine"]),
        run_id=str(attrs["run_id"]),
        rank=int(attrs["rank"]),  # type: ignore[call-overload]
        world_size=int(attrs["world_size"]),  # type: ignore[call-overload]
        hidden_size=int(attrs.get("hidden_size", 0)),  # type: ignore[call-overload]
        dtype_bytes=int(attrs.get("dtype_bytes", 0)),  # type: ignore[call-overload]
        layouts=layouts,
    )


def concat_segments(
    paths: Sequence[Path],
    out: Path,
    *,
    attrs: Mapping[str, object] | None = None,
    extra: Callable[[TraceWriter], None] | None = None,
    compression: Mapping[str, object] | None = None,
    block_rows: int = 1 << 18,
) -> Path:
    """Join consecutive segments of one rank into one trace at ``out`` (atomically).

    One segment is copied as it is (compressed chunks are not re-encoded).
    Several: ``/stat`` datasets are summed (each segment's totals cover its own
    passes), datasets resizable along axis 0 (``/passes``, ``/tokens``,
    ``/timing`` ...) are concatenated in segment order, ``block_rows`` rows at a
    time, and other datasets are taken from the last segment. ``attrs`` are
    added to the root; ``extra(writer)`` may write more before the commit.

    Raises:
        TraceError: no segment, or one is unreadable or of another run/rank.
    """
    from .reader import open_trace

    if not paths:
        raise TraceError("no segments to join")
    for path in paths:
        open_trace(path).close()  # validates: complete, schema, version
    files = [h5py.File(p, "r") for p in paths]
    try:
        _check_same(paths, files)
        first = files[0]
        header = header_of(dict(first.attrs), np.asarray(first["layers"][()]), np.asarray(first["physical_to_logical"][()]), read_layouts(first))
        writer = TraceWriter(out, header, compression=compression)
        try:
            if len(files) == 1:
                for group in first:
                    if isinstance(first[group], h5py.Group) and group != RANKS_GROUP:  # /ranks is part of the header
                        writer.copy_group(first, group)
            else:
                _join(files, writer, block_rows)
            if extra is not None:
                extra(writer)
            for key, value in (attrs or {}).items():
                writer.set_attr(key, value)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise
    finally:
        for f in files:
            f.close()


def _join(files: Sequence[h5py.File], writer: TraceWriter, block_rows: int) -> None:
    names: dict[str, h5py.Dataset] = {}  # every dataset of any segment, first seen first

    def collect(name: str, obj: object) -> None:  # returns None: visititems stops at a non-None return
        if isinstance(obj, h5py.Dataset):
            names.setdefault(name, obj)

    for f in files:
        f.visititems(collect)
    for name, ds in names.items():
        if name in ("layers", "physical_to_logical") or name.split("/", 1)[0] == RANKS_GROUP:
            continue
        if name.split("/", 1)[0] == _ADDITIVE:
            total = sum(np.asarray(f[name][()]) for f in files if name in f)
            writer.write(name, np.asarray(total).astype(ds.dtype), compress=ds.compression is not None)
        elif ds.maxshape and ds.maxshape[0] is None:
            writer.ensure_empty(name, ds.shape[1:], ds.dtype)
            for f in files:
                if name not in f:
                    continue
                src = f[name]
                for start in range(0, src.shape[0], block_rows):
                    writer.append(name, np.asarray(src[start : start + block_rows]))
        else:
            writer.write(name, np.asarray([f for f in files if name in f][-1][name][()]))
