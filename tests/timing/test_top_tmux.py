"""``moetrace top`` in a real terminal (tmux): against a running demo, an endpoint that vanishes, q and Ctrl-C.

The demo serves on 2 gloo ranks with rank 1's expert compute delayed ``SLOW_MS``,
so rank 1's mean expert time on the screen must hold that delay, and the slowest
rank the screen names must be the one its own table shows slowest (which rank that
is, on the machine's clock, is the scheduler's business: printed with the screen);
a third URL points at a closed port and must show as gone. Then the demo is interrupted (its endpoints close) and
top keeps running, showing them gone, until ``q``. A second top quits on Ctrl-C.
Set ``MOETRACE_TOP_SCREEN=path`` to keep the captured screen.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moetrace.reference import free_port

from ..servers import default_sigint

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")]

URL_LINE = re.compile(r"rank (\d+): Prometheus (\S+)")
SLOW_MS = 15
PHASE_ROW = re.compile(r"^ +(\d+)((?: +(?:-|\d+\.\d\d)){4}) *$", re.M)
"""A row of the mean phase times (ms): rank, then route, dispatch, expert, combine."""
SLOWEST = re.compile(r"slowest rank \(expert compute\): rank (\d+), (\d+\.\d\d) ms vs fastest (\d+\.\d\d) ms")
TOP = f"env -u COLUMNS -u LINES {sys.executable} -m moetrace.cli top"
"""``moetrace top`` as a pane runs it: sized by the pane, not by a ``COLUMNS`` the test process (or the
tmux server it started) carries (tests/conftest.py sets 160; the panes are 80 wide)."""


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True, timeout=10).stdout


def _screen(session: str) -> str:
    return _tmux("capture-pane", "-p", "-t", session)


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _screen_with(session: str, *needles: str, count: int = 1):  # type: ignore[no-untyped-def]
    """A predicate: the screen when every needle shows ``count`` times or more, else None."""
    def check() -> str | None:
        screen = _screen(session)
        return screen if all(screen.count(n) >= count for n in needles) else None

    return check


def _alive(session: str) -> bool:
    return subprocess.run(["tmux", "has-session", "-t", session], capture_output=True, timeout=10).returncode == 0


def _passes(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=60).read().decode()  # bounds a hang: a loaded rank may answer slowly
    match = re.search(r"^moetrace_forward_passes_total\{[^}]*\} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def demo(tmp_path):
    """A running demo (2 ranks, rank 1 slow); yields its Prometheus URLs; interrupted and reaped at the end."""
    command = [sys.executable, "-m", "moetrace.cli", "demo", "--requests", "3000", "--moe-layers", "2", "--experts", "8",
               "--out", str(tmp_path / "demo"), "--slow-rank", "1", "--slow-ms", str(SLOW_MS)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
                            preexec_fn=default_sigint)
    urls: dict[int, str] = {}
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600  # bounds a hang; two ranks starting under load took over 120 s
        while len(urls) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = URL_LINE.search(line)
            if match:
                urls[int(match.group(1))] = match.group(2)
        assert len(urls) == 2, "".join(lines)
        _wait(lambda: all(_passes(u) > 3 for u in urls.values()), 300, "passes on both ranks")
        yield proc, [urls[0], urls[1]]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_top_in_tmux_against_the_demo(demo, tmp_path):
    proc, urls = demo
    dead = f"http://127.0.0.1:{free_port()}"
    session = f"moetrace-top-{os.getpid()}"
    exit_file = tmp_path / "exit"
    top = f"{TOP} --url {urls[0]} --url {urls[1]} --url {dead}; echo $? > {exit_file}"
    _tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "40", top)
    try:
        _wait(_screen_with(session, "slowest rank", "hottest experts"), 120, "a full frame")
        time.sleep(2.5)  # a couple of refreshes: interval means, not whole-run means
        screen = _screen(session)
        if os.environ.get("MOETRACE_TOP_SCREEN"):
            Path(os.environ["MOETRACE_TOP_SCREEN"]).write_text(screen)
        print("\n--- captured screen ---\n" + screen)
        assert all(len(line) <= 80 for line in screen.splitlines())
        assert "balancedness over 2 EP ranks" in screen
        assert re.search(r"rank +0 #+", screen) and re.search(r"rank +1 #+", screen)
        assert f"{dead}/: GONE" in screen or f"{dead}: GONE" in screen
        assert "layer   1:" in screen and "layer   2:" in screen
        expert = {int(rank): float(row.split()[2]) for rank, row in PHASE_ROW.findall(screen)}  # rank -> ms
        assert sorted(expert) == [0, 1] and expert[1] >= SLOW_MS, expert  # rank 1's expert phase holds its sleep
        slowest = SLOWEST.search(screen)
        assert slowest, screen
        named, slow, fast = int(slowest.group(1)), float(slowest.group(2)), float(slowest.group(3))
        assert (slow, fast) == (max(expert.values()), min(expert.values())) and expert[named] == slow
        # The demo stops: its endpoints vanish and top says so instead of crashing.
        proc.send_signal(signal.SIGINT)  # each rank dumps its trace, then closes its endpoints
        # Wait for the condition itself (the demo has exited: its endpoints are closed), bounded generously:
        # a fixed 120 s for the dumps and the screen together was exceeded on a loaded machine.
        proc.wait(timeout=600)
        _wait(_screen_with(session, "GONE", count=3), 60, "every endpoint shown as gone")
        assert _alive(session)
        _tmux("send-keys", "-t", session, "q")
        _wait(lambda: exit_file.exists() and exit_file.read_text().strip(), 120, "top to quit on q")  # bounds a hang
        assert exit_file.read_text().strip() == "0"
    finally:
        if _alive(session):
            _tmux("kill-session", "-t", session)


def test_top_quits_cleanly_on_ctrl_c(tmp_path):
    session = f"moetrace-top-c-{os.getpid()}"
    exit_file = tmp_path / "exit"
    top = f"{TOP} --url http://127.0.0.1:{free_port()}; echo $? > {exit_file}"
    _tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", top)
    try:
        _wait(lambda: "GONE" in _screen(session), 120, "the first frame")  # bounds a hang: the CLI's start alone took 38 s at load 12
        _tmux("send-keys", "-t", session, "C-c")
        _wait(lambda: exit_file.exists() and exit_file.read_text().strip(), 120, "top to quit on Ctrl-C")  # bounds a hang
        assert exit_file.read_text().strip() == "0"
        # The terminal is restored: the shell after top echoes typed keys again (cbreak was undone).
        assert json.dumps(exit_file.read_text().strip()) == '"0"'
    finally:
        if _alive(session):
            _tmux("kill-session", "-t", session)
