"""A Python child process that runs trace work without torch or the engine, and the pipe between them.

Two kinds of child write a recording's files outside the engine's interpreter, so that their file
work never holds its GIL: a dump's one-off child (:mod:`moetrace.trace.offload`) and a recording's
long-lived writer (:mod:`moetrace.trace.writer_process`). Both start with :func:`start_child`, which
runs a ``main()`` of a :mod:`moetrace.trace` module through a bootstrap that makes ``moetrace`` a bare
namespace over its folder (the package root imports the recorder and torch), so a child imports
numpy and h5py only and starts in about a second; it runs ``nice`` +10, so where cores are short
the engine's threads go first.

Messages are pickles (protocol 5) whose contiguous arrays travel out of band: :func:`send` writes the
number of parts, each part's size, the pickle, then each array's memory as it is (no copy; a
blocking write releases the GIL), and :func:`receive` reads them back over buffers of their own.
An array in a shared buffer (:mod:`moetrace.trace.shared_memory`) travels as a reference instead
when the sender says so (``share``): the receiver maps the same pages.
A child's pipes hold :data:`PIPE_BYTES` (Linux), so a checkpoint's window crosses in few writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import pickle
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import IO

from .shared_memory import SharedMaps, dumps_sharing

__all__ = ["NICE", "PIPE_BYTES", "die_with_starter", "receive", "send", "start_child", "widen_pipe"]

#: ``python -c`` source of a child: Ctrl-C ignored (a terminal sends SIGINT to its whole foreground
#: process group, and what a Ctrl-C stops is the engine's to decide: its recording is dumped while
#: the child still runs, and the child ends with its parent), ``moetrace`` as a bare namespace over
#: its folder (argv[1]), then ``main()`` of the module named by argv[2].
_BOOTSTRAP = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "import sys, types, importlib; package = types.ModuleType('moetrace'); package.__path__ = [sys.argv[1]]; "
    "sys.modules['moetrace'] = package; importlib.import_module(sys.argv[2]).main()"
)
_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_PR_SET_PDEATHSIG = 1
#: A child's niceness increment: about a tenth of a core's share against the engine's threads.
NICE = 10
_SIZE = struct.Struct("<Q")
#: Bytes a child's pipes hold (Linux's ``F_SETPIPE_SZ``; the default ``/proc/sys/fs/pipe-max-size``): a
#: 64 MiB checkpoint crosses in 64 writes and reads instead of 1,024 (each a context switch on both sides).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def start_child(module: str, capture_stderr: bool) -> subprocess.Popen[bytes]:
    """Start ``sys.executable`` running ``module``'s ``main()`` (a ``moetrace.trace`` module), its
    stdin and stdout pipes to this process; ``capture_stderr``: its stderr a pipe too (else inherited).

    Raises:
        OSError: no Python could be started.
    """
    if not sys.executable:
        raise OSError("no Python executable to start (an embedded interpreter)")
    child = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, _PACKAGE_DIR, module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE if capture_stderr else None)
    for pipe in (child.stdin, child.stdout):
        widen_pipe(pipe.fileno())  # type: ignore[union-attr]
    return child


def widen_pipe(fd: int) -> None:
    """Make the pipe ``fd`` hold :data:`PIPE_BYTES`; where it cannot (not Linux, a lower
    ``pipe-max-size``) it keeps its default size, which still works."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)


def send(stream: IO[bytes], message: object, share: bool = False) -> None:
    """Write ``message`` (see the module docstring) and flush; ``share``: its arrays that lie in
    shared buffers go as references (only where the receiver is done with them before the sender
    reuses their memory: a synchronous call)."""
    buffers: list[pickle.PickleBuffer] = []
    if share:
        head = dumps_sharing(message, buffers.append)
    else:
        head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    parts = [memoryview(head), *(b.raw() for b in buffers)]
    stream.write(_SIZE.pack(len(parts)) + b"".join(_SIZE.pack(part.nbytes) for part in parts))
    for part in parts:
        stream.write(part)  # a blocking write releases the GIL
    stream.flush()


def receive(stream: IO[bytes], maps: SharedMaps | None = None) -> object:
    """What :func:`send` wrote (the arrays over writable buffers of their own; references to
    shared buffers as read-only arrays over ``maps``).

    Raises:
        EOFError: the stream ended (the other side is gone).
        pickle.UnpicklingError: a reference, and no ``maps`` to resolve it.
        OSError: a shared buffer could not be mapped.
    """
    (count,) = _SIZE.unpack(_read(stream, _SIZE.size))
    sizes = struct.unpack(f"<{count}Q", _read(stream, count * _SIZE.size))
    head, *buffers = (_read(stream, size) for size in sizes)
    if maps is not None:
        return maps.loads(head, buffers)
    return pickle.loads(head, buffers=buffers)


def _read(stream: IO[bytes], size: int) -> bytearray:
    data = bytearray(size)
    view, at = memoryview(data), 0
    while at < size:
        got = stream.readinto(view[at:])  # type: ignore[attr-defined]
        if not got:
            raise EOFError(f"the message ended after {at} of {size} bytes")
        at += got
    return data


def die_with_starter(parent: int) -> None:
    """In a child: be killed when the thread that started it dies (Linux ``PR_SET_PDEATHSIG``), exit at
    once when ``parent`` is already gone, and lower this process's priority (:data:`NICE`)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody waits for this work
        os._exit(1)
    lower_priority()


def lower_priority() -> None:
    """``nice`` this process by :data:`NICE` (where cores are short, the engine's threads go first)."""
    with contextlib.suppress(OSError):
        os.nice(NICE)
