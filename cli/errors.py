"""One error path for every command: one clear line on stderr, no traceback.

Exit codes: 0 success, 1 the operation failed at run time (server refused or
unreachable, write failed), 2 bad usage or bad input (missing file, not a
trace, truncated, damaged, newer schema, inconsistent options). Every HDF5
failure while reading an input exits 2 with a message, never a traceback.
A reader that stops reading (``moetrace analyze T | head -2``) is no failure: 0.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import NoReturn, ParamSpec, TextIO, TypeVar

import typer

from moetrace.trace.integrity import from_hdf5
from moetrace.trace.schema import TraceError, TraceWriteError

__all__ = ["EXIT_FAILED", "EXIT_INPUT", "CommandError", "exit_when_reader_leaves", "guarded", "say_error"]

EXIT_FAILED = 1
EXIT_INPUT = 2

P = ParamSpec("P")
R = TypeVar("R")


class CommandError(Exception):
    """An expected failure: ``message`` goes to stderr, ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_INPUT) -> None:
        super().__init__(message)
        self.code = code


def say_error(message: str) -> None:
    """Print ``moetrace: error: <message>`` as a single line on stderr."""
    typer.echo(f"moetrace: error: {' '.join(str(message).split())}", err=True)


def guarded(command: Callable[P, R]) -> Callable[P, R]:
    """Turn expected exceptions into one stderr line and an exit code."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except CommandError as exc:
            say_error(str(exc))
            raise typer.Exit(exc.code) from None
        except TraceWriteError as exc:
            say_error(str(exc))
            raise typer.Exit(EXIT_FAILED) from None
        except (TraceError, ValueError, FileNotFoundError, IsADirectoryError) as exc:
            say_error(str(exc))
            raise typer.Exit(EXIT_INPUT) from None
        except Exception as exc:
            if not from_hdf5(exc):
                raise
            # The backstop of the one error boundary: the library names the file where it reads.
            say_error(f"an input trace is damaged: HDF5 failed while reading it ({exc}); run `moetrace verify` on the inputs to see what is intact")
            raise typer.Exit(EXIT_INPUT) from None

    return wrapper


def exit_when_reader_leaves() -> None:
    """Make a closed stdout end the program with 0: the reader has what it wanted (``| head -2``).

    Every write to stdout goes through ``sys.stdout`` (typer's echo, click's help, rich's consoles,
    which catch :class:`BrokenPipeError` themselves and exit 1), so the wrapper installed here sees
    the broken pipe first, whoever writes.
    """
    if not isinstance(sys.stdout, _ReaderMayLeave) and sys.stdout is not None:
        sys.stdout = _ReaderMayLeave(sys.stdout)


class _ReaderMayLeave:
    """``sys.stdout`` whose broken pipe exits 0 (after pointing the descriptor at the null device)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _reader_left()

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _reader_left()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _reader_left() -> NoReturn:
    _discard_stdout()
    raise SystemExit(0)


def _discard_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what is still buffered
    for a closed pipe cannot fail again (and exit 120) after the command ended."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a test runner's buffer): nothing is flushed to a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
