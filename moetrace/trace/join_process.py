"""Joining a dump's segments in a child process, so the engine's interpreter never runs the join.

A dump while recording must not slow the forward pass. Run on a thread of the engine's
process, the join (validating every segment, copying its chunks, sealing the digests,
``fsync``) keeps that interpreter's GIL for up to the switch interval at a time, and the
forward thread, which takes the GIL back after every torch op, waits for it: 57-296 ms
passes against a 7-12 ms median at DeepSeek-V3 size (``docs/benchmarks.md``, "Dump stall").
:func:`join_segments` runs :func:`~moetrace.trace.join.concat_segments` in a child Python
process with its own GIL (a join under :data:`CHILD_MIN_BYTES` runs in-process: it is short); the calling thread (the recorder's dump thread) only waits for it,
then renames the joined file into place (:func:`promote`), so the dump is placed, and the
segments noted consumed in the journal, by the recording process alone.

Crash safety: the child writes ``.<target>.tmp-<host>-<parent pid>-<hex>`` (a
:func:`~moetrace.trace.files.temporary_path` named after the recording process), and the
child dies with the thread that started it (``PR_SET_PDEATHSIG`` on Linux) and runs at a
lower priority (``nice`` +10), so where cores are short the engine's threads go first. A recording
process killed during a dump leaves its segments and journal as they were (``moetrace
recover`` brings every pass back) and at most that temporary, which
:func:`~moetrace.trace.files.sweep_dead_temporaries` removes once its process is gone.

The child imports :mod:`moetrace.trace` only (numpy and h5py: no torch, no engine), through
a bootstrap that skips the package root (which imports the recorder and torch), so it starts
in about a second. The job and the result go through pipes as pickles between the two
processes of one run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .files import temporary_path
from .join import concat_segments
from .schema import TraceError, TraceWriteError
from .writer import TraceWriter

__all__ = ["CHILD_MIN_BYTES", "join_segments", "promote"]

#: Segments smaller than this in all are joined on the calling thread: their join holds the GIL
#: for milliseconds (about 0.25 s per 45 MB segment at DeepSeek-V3 size, ``docs/benchmarks.md``),
#: less than a child's start costs (0.6-2 s of a core: a Python with numpy and h5py).
CHILD_MIN_BYTES = 8 << 20

#: ``python -c`` source of the child: make ``moetrace`` a bare namespace over its folder (argv[1])
#: so that importing ``moetrace.trace`` does not run the package root's torch imports.
_BOOTSTRAP = (
    "import sys, types; package = types.ModuleType('moetrace'); package.__path__ = [sys.argv[1]]; "
    "sys.modules['moetrace'] = package; from moetrace.trace.join_process import main; main()"
)
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_PR_SET_PDEATHSIG = 1
_NICE = 10  # the child's niceness increment: about a tenth of a core's share against the engine's threads


def join_segments(
    paths: Sequence[Path],
    target: Path,
    *,
    attrs: Mapping[str, object] | None = None,
    datasets: Mapping[str, np.ndarray] | None = None,
    compression: Mapping[str, object] | None = None,
) -> Path:
    """Join the segments ``paths`` into ``target`` in a child process (on this thread when they are
    under :data:`CHILD_MIN_BYTES` in all, or no Python can be started) and rename it into place.

    Args:
        paths: consecutive segments of one rank, oldest first.
        target: the trace to write (nothing appears under its name unless the join succeeds).
        attrs: root attributes to add (the dump's timing attributes).
        datasets: ``{name: array}`` to write besides the joined rows (the dump's ``/stat``
            timing aggregates ``[R, ...]``).
        compression: h5py filter keywords for what the join writes.

    Returns:
        ``target``, complete.

    Raises:
        TraceError: what the join raised in the child (a damaged or foreign segment, a write that
            failed), or the child died; the segments are untouched either way.
    """
    target = Path(target)
    staging = temporary_path(target)
    job = {"paths": [str(p) for p in paths], "out": str(staging), "attrs": dict(attrs or {}), "datasets": dict(datasets or {}),
           "compression": dict(compression or {}), "parent": os.getpid()}
    if not sys.executable or sum(Path(p).stat().st_size for p in paths) < CHILD_MIN_BYTES:  # no Python to start (embedded), or small
        _run(job)
        return promote(staging, target)
    child = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, _PACKAGE_DIR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = child.communicate(pickle.dumps(job))
    result = _result(out)
    if child.returncode != 0 or "path" not in result:
        staging.unlink(missing_ok=True)  # the child's own TraceWriter removed its temporary; this name is ours
        error = result.get("error")
        if isinstance(error, BaseException):
            raise error
        detail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise TraceWriteError(
            f"joining {len(paths)} segments into {target} in a child process failed (exit status {child.returncode}: "
            f"{' / '.join(detail) or 'no message'}); the segments are kept: dump again, or run `moetrace recover` on the output directory"
        )
    return promote(staging, target)


def promote(staging: Path, target: Path) -> Path:
    """Rename the joined ``staging`` file to ``target`` (atomic on one file system); returns ``target``."""
    try:
        os.replace(staging, target)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise TraceWriteError(f"finishing trace {target} failed: {exc}; nothing was left under that name") from exc
    return target


def _result(out: bytes) -> dict[str, object]:
    if not out:
        return {}
    try:
        result = pickle.loads(out)
    except Exception:
        return {}
    return result if isinstance(result, dict) else {}


def _run(job: Mapping[str, object]) -> Path:
    datasets: Mapping[str, np.ndarray] = job["datasets"]  # type: ignore[assignment]

    def extra(writer: TraceWriter) -> None:
        for name, array in datasets.items():
            writer.write(name, array)

    paths: list[str] = job["paths"]  # type: ignore[assignment]
    return concat_segments([Path(p) for p in paths], Path(str(job["out"])), attrs=job["attrs"], extra=extra, compression=job["compression"])  # type: ignore[arg-type]


def _die_with_parent(parent: int) -> None:
    """Linux: be killed when the thread that started this process dies (a killed engine leaves no join running)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody waits for this join
        os._exit(1)


def main() -> None:
    """The child: read the job (a pickle on stdin), join, write ``{"path"}`` or ``{"error"}`` (a pickle on stdout)."""
    result_fd = os.dup(1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the result
    job = pickle.load(sys.stdin.buffer)
    _die_with_parent(int(job["parent"]))
    with contextlib.suppress(OSError):
        os.nice(_NICE)  # a background job: where cores are short, the engine's threads (and its segment writer) go first
    try:
        result: dict[str, object] = {"path": str(_run(job))}
    except BaseException as exc:  # handed to the parent, which raises it
        try:
            pickle.loads(pickle.dumps(exc))  # the parent must be able to rebuild it
            result = {"error": exc}
        except Exception:
            result = {"error": TraceError(f"{type(exc).__name__}: {exc}")}
    with os.fdopen(result_fd, "wb") as out:
        out.write(pickle.dumps(result))
    sys.exit(0 if "path" in result else 1)
