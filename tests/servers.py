"""Run an engine's HTTP server as its users do: a subprocess on a loopback port, stopped with its process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SUBPROCESS_BOUND_S", "default_sigint", "http_status", "moetrace_cli", "post_json", "serve"]

#: How long a test waits for a command that must finish (a `moetrace` CLI run, a short script) before
#: calling it hung. A hang guard, not a speed check: at load 11 on 2 cores one `moetrace analyze`
#: (7.5 s of CPU, most of it imports) took over 120 s, the bound the Megatron test had.
SUBPROCESS_BOUND_S = 600.0


def default_sigint() -> None:
    """``preexec_fn`` for a child a test interrupts with SIGINT: restore its default action.

    A test run as a background job of a non-interactive shell (``pytest ... &``, a CI runner
    that does so) inherits SIGINT ignored, and Python keeps an inherited ignore: the child would
    never see the Ctrl-C the test sends.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def http_status(url: str, timeout: float = 5.0) -> int:
    """HTTP status of ``GET url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except OSError:
        return 0


def post_json(url: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """``POST url`` with a JSON body; the decoded JSON answer."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def moetrace_cli(*args: str, timeout: float = SUBPROCESS_BOUND_S) -> str:
    """Stdout of ``moetrace ARGS...`` run as a user runs it; fails the test on a non-zero exit."""
    done = subprocess.run([sys.executable, "-m", "moetrace.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"moetrace {' '.join(args)} failed ({done.returncode}): {done.stderr}"
    return done.stdout


@contextlib.contextmanager
def serve(command: Sequence[str], env: Mapping[str, str], log: Path, health_url: str, timeout: float) -> Iterator[subprocess.Popen]:
    """Start ``command`` (output to ``log``), wait until ``health_url`` answers 200, stop it on exit.

    Raises ``RuntimeError`` with the log's tail when the server exits or does
    not come up within ``timeout`` seconds.
    """
    with log.open("w") as out:
        proc = subprocess.Popen(list(command), env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while http_status(health_url) != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[2] if len(command) > 2 else command[0]} did not come up (exit {proc.poll()}); log tail:\n{log.read_text()[-4000:]}")
            time.sleep(1.0)
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (engines spawn worker processes), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
