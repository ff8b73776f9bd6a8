"""Trace files written in a child process, so the engine's interpreter never writes them.

A dump while recording must not slow the forward pass. Run on a thread of the engine's
process, writing a large trace (a streaming dump's join: validating every segment, copying
its chunks; a ``stat`` dump's 67 MB window at DeepSeek-V3 size: compressing it; then sealing
the digests and ``fsync``) keeps that interpreter's GIL for up to the switch interval at a
time, and the forward thread, which takes the GIL back after every torch op, waits for it:
57-296 ms passes against a 7-12 ms median at DeepSeek-V3 size (``docs/benchmarks.md``, "Dump
stall"). Both writes run here in a child Python process with its own GIL:

* :func:`join_segments` runs :func:`~moetrace.trace.join.concat_segments` on a dump's closed segments;
* :func:`write_stat_trace` writes a ``stat`` dump from its gathered host arrays
  (:func:`~moetrace.trace.stat.write_stat_window`).

A job under :data:`CHILD_MIN_BYTES` is short and not worth a child's start: it runs where the
caller's ``small_jobs`` says, the recording's long-lived writer process
(:meth:`moetrace.recording.session.RecordingSession.run_small_job`), or on the calling thread
when there is none (no recording open, or no Python to start). The calling
thread (the recorder's dump thread) only hands the job over and waits; then it renames the
child's file into place (:func:`promote`), so the dump is placed, and the segments noted
consumed in the journal, by the recording process alone.

Hand-over: the job goes to the child's stdin as a pickle (protocol 5) whose arrays travel out
of band, their memory written to the pipe as it is (no copy, and the GIL is released while a
write blocks), and comes back to the parent as the child's own result or exception (a pickle on
its stdout).

Crash safety: the child writes ``.<target>.tmp-<host>-<parent pid>-<hex>`` (a
:func:`~moetrace.trace.files.temporary_path` named after the recording process), dies with the
thread that started it (``PR_SET_PDEATHSIG`` on Linux) and runs at a lower priority (``nice``
+10), so where cores are short the engine's threads go first. A recording process killed during
a dump leaves its segments and journal as they were (``moetrace recover`` brings every pass
back) and at most that temporary, which :func:`~moetrace.trace.files.sweep_dead_temporaries`
removes once its process is gone.

The child imports :mod:`moetrace.trace` only (numpy and h5py: no torch, no engine), through a
bootstrap that skips the package root (which imports the recorder and torch), so it starts in
about a second.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .child import die_with_starter, receive, send, start_child
from .files import temporary_path
from .join import concat_segments
from .schema import TraceError, TraceHeader, TraceWriteError
from .stat import CounterLayout, StatRows, write_stat_window
from .writer import TraceWriter

__all__ = ["CHILD_MIN_BYTES", "SmallJobs", "join_segments", "promote", "run_job", "write_stat_trace"]

#: Jobs smaller than this in all (segment files, or a ``stat`` dump's arrays) get no child of their
#: own (they run by ``small_jobs``): they hold a GIL for milliseconds (a join: about 0.25 s per 45 MB segment at
#: DeepSeek-V3 size, ``docs/benchmarks.md``), less than a child's start costs (0.6-2 s of a core:
#: a Python with numpy and h5py).
CHILD_MIN_BYTES = 8 << 20

#: ``small_jobs(job) -> path``: where a job under :data:`CHILD_MIN_BYTES` runs (:func:`run_job` there).
SmallJobs = Callable[[Mapping[str, object]], Path]


def join_segments(
    paths: Sequence[Path],
    target: Path,
    *,
    attrs: Mapping[str, object] | None = None,
    datasets: Mapping[str, np.ndarray] | None = None,
    compression: Mapping[str, object] | None = None,
    small_jobs: SmallJobs | None = None,
) -> Path:
    """Join the segments ``paths`` into ``target`` in a child process (by ``small_jobs`` when they
    are under :data:`CHILD_MIN_BYTES` in all, or no Python can be started) and rename it into place.

    Args:
        paths: consecutive segments of one rank, oldest first.
        target: the trace to write (nothing appears under its name unless the join succeeds).
        attrs: root attributes to add (the dump's timing attributes).
        datasets: ``{name: array}`` to write besides the joined rows (the dump's ``/stat``
            timing aggregates ``[R, ...]``).
        compression: h5py filter keywords for what the join writes.
        small_jobs: where a small join runs (``None``: on this thread).

    Returns:
        ``target``, complete.

    Raises:
        TraceError: what the join raised in the child (a damaged or foreign segment, a write that
            failed), or the child died; the segments are untouched either way.
    """
    job = {"kind": "join", "paths": [str(p) for p in paths], "attrs": dict(attrs or {}), "datasets": dict(datasets or {}),
           "compression": dict(compression or {})}
    size = sum(Path(p).stat().st_size for p in paths)
    return _place(job, Path(target), size, f"joining {len(paths)} segments", "the segments are kept: dump again, or run `moetrace recover` on the output directory",
                  small_jobs)


def write_stat_trace(
    target: Path,
    header: TraceHeader,
    layout: CounterLayout,
    rows: StatRows,
    *,
    attrs: Mapping[str, object] | None = None,
    datasets: Mapping[str, np.ndarray] | None = None,
    compression: Mapping[str, object] | None = None,
    small_jobs: SmallJobs | None = None,
) -> Path:
    """Write a ``stat`` dump of ``rows`` (:func:`~moetrace.trace.stat.write_stat_window`) to ``target``
    in a child process (by ``small_jobs`` when its arrays are under :data:`CHILD_MIN_BYTES`, or no
    Python can be started) and rename it into place.

    Args:
        header: the trace's header (its ``physical_to_logical`` maps ``/stat/logical_count``).
        layout: the columns of ``rows.rows [R, L, C]``.
        attrs, datasets, compression, small_jobs: as for :func:`join_segments` (the dump's timing).

    Returns:
        ``target``, complete.

    Raises:
        TraceError: the write failed (in the child or here), or the child died; nothing is left
            under ``target`` or a temporary name.
    """
    job = {"kind": "stat", "header": header, "layout": layout, "rows": rows, "attrs": dict(attrs or {}),
           "datasets": dict(datasets or {}), "compression": dict(compression or {})}
    size = sum(a.nbytes for a in (rows.rows, rows.passes, rows.meta, *rows.counts))
    return _place(job, Path(target), size, "writing a stat dump", "the recording is kept: dump again", small_jobs)


def promote(staging: Path, target: Path) -> Path:
    """Rename the child's ``staging`` file to ``target`` (atomic on one file system); returns ``target``."""
    try:
        os.replace(staging, target)
    except OSError as exc:
        _discard(staging)
        raise TraceWriteError(f"finishing trace {target} failed: {exc}; nothing was left under that name") from exc
    return target


def _place(job: dict[str, object], target: Path, size: int, what: str, kept: str, small_jobs: SmallJobs | None) -> Path:
    """Run ``job`` into a temporary named after this process (in a child when ``size`` bytes are
    worth one, else by ``small_jobs``), then :func:`promote` it to ``target``."""
    staging = temporary_path(target)
    job.update(out=str(staging), parent=os.getpid())
    if not sys.executable or size < CHILD_MIN_BYTES:  # no Python to start (embedded), or small
        try:
            (small_jobs or run_job)(job)
        except BaseException:
            _discard(staging)  # what a writer that died half-way left; this name is ours
            raise
        return promote(staging, target)
    child = start_child(__name__, capture_stderr=True)
    assert child.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # a child that died early: its exit status says why
        send(child.stdin, job)
    out, err = child.communicate()
    result = _result(out)
    if child.returncode != 0 or "path" not in result:
        _discard(staging)  # the child's own TraceWriter removed its temporary; this name is ours
        error = result.get("error")
        if isinstance(error, BaseException):
            raise error
        detail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise TraceWriteError(
            f"{what} into {target} in a child process failed (exit status {child.returncode}: {' / '.join(detail) or 'no message'}); {kept}"
        )
    return promote(staging, target)


def _discard(staging: Path) -> None:
    """Remove ``staging`` if it is there (an error removing it must not hide the error being raised)."""
    with contextlib.suppress(OSError):
        staging.unlink()


def _result(out: bytes) -> dict[str, object]:
    if not out:
        return {}
    try:
        result = pickle.loads(out)
    except Exception:
        return {}
    return result if isinstance(result, dict) else {}


def _extras(writer: TraceWriter, job: Mapping[str, object]) -> None:
    """The job's datasets (the dump's timing aggregates) into ``writer``."""
    datasets: Mapping[str, np.ndarray] = job["datasets"]  # type: ignore[assignment]
    for name, array in datasets.items():
        writer.write(name, array)


def _join(job: Mapping[str, object]) -> Path:
    paths: list[str] = job["paths"]  # type: ignore[assignment]
    return concat_segments([Path(p) for p in paths], Path(str(job["out"])), attrs=job["attrs"],  # type: ignore[arg-type]
                           extra=lambda writer: _extras(writer, job), compression=job["compression"])  # type: ignore[arg-type]


def _write_stat(job: Mapping[str, object]) -> Path:
    header: TraceHeader = job["header"]  # type: ignore[assignment]
    attrs: Mapping[str, object] = job["attrs"]  # type: ignore[assignment]
    with TraceWriter(Path(str(job["out"])), header, compression=job["compression"]) as writer:  # type: ignore[arg-type]
        write_stat_window(writer, job["layout"], header.physical_to_logical, job["rows"])  # type: ignore[arg-type]
        for key, value in attrs.items():
            writer.set_attr(key, value)
        _extras(writer, job)
        return writer.commit()


_JOBS: dict[str, Callable[[Mapping[str, object]], Path]] = {"join": _join, "stat": _write_stat}


def run_job(job: Mapping[str, object]) -> Path:
    """Run ``job`` (a ``join`` or a ``stat`` dump, as :func:`join_segments` or :func:`write_stat_trace`
    made it) here, into its ``out`` path; returns that path."""
    return _JOBS[str(job["kind"])](job)


def main() -> None:
    """The child: read the job (:func:`_send`'s framing on stdin), run it, write ``{"path"}`` or ``{"error"}`` (a pickle on stdout)."""
    result_fd = os.dup(1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the result
    job: dict[str, object] = receive(sys.stdin.buffer)  # type: ignore[assignment]
    die_with_starter(int(job["parent"]))  # type: ignore[call-overload]
    try:
        result: dict[str, object] = {"path": str(run_job(job))}
    except BaseException as exc:  # handed to the parent, which raises it
        try:
            pickle.loads(pickle.dumps(exc))  # the parent must be able to rebuild it
            result = {"error": exc}
        except Exception:
            result = {"error": TraceError(f"{type(exc).__name__}: {exc}")}
    with os.fdopen(result_fd, "wb") as out:
        out.write(pickle.dumps(result))
    sys.exit(0 if "path" in result else 1)
