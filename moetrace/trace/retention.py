"""Bounded disk for a long-running recorder: keep the last N dumps, the last D days, at most B bytes.

A recorder that dumps every few minutes for weeks fills its output directory.
:class:`Retention` applies a :class:`RetentionPolicy` to one directory after
each dump (the recorder calls :meth:`Retention.apply`; operators can call it
too), oldest recordings first:

1. **age** — dumps older than ``max_age_seconds`` (by their ``created_unix``)
   are removed;
2. **count** — dumps past the newest ``max_dumps`` are *compacted* when
   ``compact`` is on and they are streaming traces: rewritten in place as a
   ``stat`` trace that keeps their ``/stat`` totals (and phase-timing
   aggregates) with the root attribute ``compacted_from`` naming the old
   mode, so a deployment series (:mod:`moetrace.analysis.deployment`) still
   sees them; otherwise they are removed;
3. **bytes** — while the directory's moetrace files exceed ``max_bytes``, the
   oldest streaming dump is compacted (when ``compact``) or the oldest dump
   removed.

Never touched: the newest dump; writer temporaries; segments, checkpoints
and journals (a live recording's crash evidence, :mod:`moetrace.trace.files`);
files that are not moetrace traces; and any file a process holds open — a
writer or a reader (HDF5 takes a ``flock`` on every file it opens; a file
that cannot be locked exclusively is skipped and counted as ``busy``). The
lock is held while a file is removed or replaced. When everything removable
is gone and the bound still does not hold, ``over_bound`` says so.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .files import exclusively
from .safe_open import open_hdf5
from .schema import (
    COMPACTED_FROM_ATTR,
    SCHEMA_NAME,
    Attr,
    Data,
    TraceError,
    TraceHeader,
    TraceWriteError,
)
from .writer import TraceWriter

__all__ = ["Retention", "RetentionPolicy", "RetentionStats"]

_STREAMING = ("per_pass", "per_token")
#: Root attributes a compacted trace does not carry over from its source.
_NOT_COPIED = (Attr.COMPLETE, Attr.MODE, Attr.SCHEMA, Attr.SCHEMA_VERSION, Attr.MOETRACE_VERSION)


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """How much of a recorder's output directory to keep (every bound optional; ``None``: unbounded).

    Args:
        max_dumps: dumps kept as they were written (newest first).
        max_age_seconds: dumps older than this are removed.
        max_bytes: bound on the moetrace files in the directory.
        compact: compact older streaming dumps to their ``stat`` totals before removing anything.
    """

    max_dumps: int | None = None
    max_age_seconds: float | None = None
    max_bytes: int | None = None
    compact: bool = True

    def __post_init__(self) -> None:
        for name in ("max_dumps", "max_age_seconds", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"RetentionPolicy.{name} must be positive or None, got {value!r}")


@dataclasses.dataclass
class RetentionStats:
    """What retention did in one directory (cumulative) and how full it is (last pass)."""

    removed_files: int = 0
    removed_bytes: int = 0
    compacted_files: int = 0
    compacted_bytes_saved: int = 0
    busy_skips: int = 0
    directory_bytes: int = 0
    kept_dumps: int = 0
    over_bound: bool = False
    last_applied_unix: float | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Dump:
    path: Path
    created: float
    mode: str
    size: int
    compacted: bool


def _session_files_bytes(directory: Path) -> int:
    """Bytes of the hidden recording files in ``directory`` (segments, checkpoints, journals), not writer temporaries."""
    return sum(entry.stat().st_size for entry in os.scandir(directory)
               if entry.is_file() and entry.name.startswith(".moetrace-") and ".h5.tmp-" not in entry.name)


def _dumps(directory: Path) -> list[_Dump]:
    """Complete moetrace dumps in ``directory`` (not hidden), oldest first."""
    out = []
    for entry in os.scandir(directory):
        if not entry.is_file() or entry.name.startswith(".") or not entry.name.endswith(".h5"):
            continue
        try:
            with open_hdf5(entry.path) as f:
                attrs = f.attrs
                if attrs.get(Attr.SCHEMA) != SCHEMA_NAME or not attrs.get(Attr.COMPLETE, False):
                    continue
                out.append(_Dump(Path(entry.path), float(attrs.get(Attr.CREATED_UNIX, entry.stat().st_mtime)),
                                 str(attrs[Attr.MODE]), entry.stat().st_size, COMPACTED_FROM_ATTR in attrs))
        except OSError:  # held open for writing, or not HDF5: not ours to judge
            continue
    out.sort(key=lambda d: (d.created, d.path.name))
    return out


class Retention:
    """Applies a :class:`RetentionPolicy` to one directory; thread-safe; counts what it did.

    Args:
        policy: the bounds.
        directory: the output directory.
        clock: unix seconds now (injectable for tests).
    """

    def __init__(self, policy: RetentionPolicy, directory: Path | str, clock: Callable[[], float] = time.time) -> None:
        self.policy, self.directory, self._clock = policy, Path(directory), clock
        self.stats = RetentionStats()
        self._lock = threading.Lock()

    def apply(self) -> RetentionStats:
        """Enforce the policy now; returns the (cumulative) stats. Never raises for a file it cannot touch."""
        with self._lock:
            p, stats = self.policy, self.stats
            now = self._clock()
            dumps = _dumps(self.directory)
            candidates = dumps[:-1]  # the newest dump is always kept
            kept = list(dumps)  # what is left of the dumps, sizes updated as they are compacted

            def remove(d: _Dump) -> bool:
                if not self._remove(d):
                    return False
                candidates.remove(d)
                kept.remove(d)
                return True

            if p.max_age_seconds is not None:
                for d in [d for d in candidates if now - d.created > p.max_age_seconds]:
                    remove(d)
            if p.max_dumps is not None:
                as_written = [d for d in kept if not d.compacted]
                for d in as_written[: max(len(as_written) - p.max_dumps, 0)]:
                    if not p.compact:
                        remove(d)
                    elif d.mode in _STREAMING:
                        self._compact(d)  # a stat dump is its totals already: kept
            # the bound covers the dumps and the hidden recording files (not temporaries, not foreign files)
            session_bytes = _session_files_bytes(self.directory)
            if p.max_bytes is not None:
                for d in list(candidates):
                    if session_bytes + sum(k.size for k in kept) <= p.max_bytes:
                        break
                    if p.compact and d.mode in _STREAMING and self._compact(d):
                        continue
                    remove(d)
            stats.directory_bytes = session_bytes + sum(k.size for k in kept)
            stats.kept_dumps = len(kept)
            stats.over_bound = p.max_bytes is not None and stats.directory_bytes > p.max_bytes
            stats.last_applied_unix = now
            return stats

    def _remove(self, dump: _Dump) -> bool:
        with exclusively(dump.path) as free:
            if not free:
                self.stats.busy_skips += 1
                return False
            try:
                size = dump.path.stat().st_size
                dump.path.unlink()
            except OSError as exc:
                self.stats.errors.append(f"cannot remove {dump.path}: {exc}")
                return False
        self.stats.removed_files += 1
        self.stats.removed_bytes += size
        return True

    def _compact(self, dump: _Dump) -> bool:
        """Rewrite a streaming dump in place as a ``stat`` trace of its totals (under an exclusive lock)."""
        with exclusively(dump.path) as free:
            if not free:
                self.stats.busy_skips += 1
                return False
            before = dump.path.stat().st_size
            try:
                with open_hdf5(dump.path, locking=False) as src:  # our exclusive lock is held
                    attrs = dict(src.attrs)
                    header = TraceHeader.of_attrs(attrs, src[Data.LAYERS][()], src[Data.PHYSICAL_TO_LOGICAL][()], mode="stat")
                    with TraceWriter(dump.path, header) as writer:
                        writer.copy_group(src, "stat")
                        for key, value in attrs.items():
                            if key not in _NOT_COPIED:
                                writer.set_attr(key, value)
                        writer.set_attr(COMPACTED_FROM_ATTR, dump.mode)
                        writer.commit()
            except (OSError, KeyError, TraceError, TraceWriteError) as exc:
                self.stats.errors.append(f"cannot compact {dump.path}: {exc}")
                return False
        dump.mode, dump.compacted = "stat", True
        dump.size = dump.path.stat().st_size
        self.stats.compacted_files += 1
        self.stats.compacted_bytes_saved += before - dump.size
        return True
