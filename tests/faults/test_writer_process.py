"""The recording's writer process (issue 50): the engine killed, the writer killed, the disk full.

Each case runs a real recording process (``python -m tests.faults.recording per_token ...``: seeded
passes, each pass id logged before it is fed) whose files a real writer process writes. What survives
is checked against the ids fed: ``moetrace recover`` gives back passes ``0..n-1`` exactly, every id
equal to the seeded routing, and nothing after the fault.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from moetrace.trace import open_trace
from moetrace.trace.recover import RankRecovery, recover
from tests.faults.recording import LAYERS, TOKENS, pass_ids, wait_gone, writer_pid

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 300
WARNING = "the recording's writer failed"
MORE_PASSES = 200  # passes the engine must run after the fault: it went on


def wait_for(ready: Callable[[], bool], what: str, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert child.poll() is None, f"the recording process exited while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S} s"
        time.sleep(0.02)


def logged(log: Path) -> int:
    """Passes the recording process has begun (each id is logged before its pass is fed)."""
    return len(log.read_text().split()) if log.exists() else 0


@contextlib.contextmanager
def engine(out: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """The recording process (``per_token``), its pass log and its stderr; SIGKILLed at the end."""
    log, err = tmp_path / "passes.log", tmp_path / "stderr.txt"
    with err.open("wb") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "tests.faults.recording", "per_token", str(out), str(log)], cwd=ROOT, stderr=stderr)
    try:
        wait_for(lambda: any(out.glob(".moetrace-*-seg*.h5")), "closed segment", child)
        yield child, log, err
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def check_exact(out: Path, tmp_path: Path, at_most: int) -> RankRecovery:
    """Recover ``out`` and check it against the ids fed: passes ``0..n-1``, every id as seeded, ``n <= at_most``."""
    [rank] = recover(out, tmp_path / "recovered.h5")
    with open_trace(rank.path) as trace:
        ids = np.concatenate([c.topk_ids for c in trace.iter_tokens()])
        pid = np.concatenate([c.pass_id for c in trace.iter_tokens()])
        totals = trace.physical_count()
    n = rank.last_pass + 1
    assert 0 < n <= at_most, (n, at_most)
    np.testing.assert_array_equal(pid, np.repeat(np.arange(n), TOKENS))
    fed = np.concatenate([pass_ids(i) for i in range(n)])
    np.testing.assert_array_equal(ids, fed)
    assert not np.array_equal(ids, np.concatenate([pass_ids(i, rank=1) for i in range(n)])), "negative control: other ids differ"
    np.testing.assert_array_equal(totals, np.stack([np.bincount(fed[:, layer].ravel(), minlength=totals.shape[1]) for layer in range(LAYERS)]))
    return rank


def test_engine_killed_its_writer_ends_and_closes_what_it_received(tmp_path):
    """SIGKILL of the engine: the writer process exits too (it watches its pipe and parent), after closing
    the segment it held, so recover gives back every pass it received, exactly."""
    out = tmp_path / "out"
    out.mkdir()
    with engine(out, tmp_path) as (_child, log, _):
        writer = writer_pid(out)
        assert writer is not None
        time.sleep(0.5)
    at_kill = logged(log)
    wait_gone(writer)  # dies with its parent (it would otherwise run on, orphaned)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name and p.stat().st_size and "checkpoint" in p.name]
    rank = check_exact(out, tmp_path, at_kill)
    assert rank.passes == rank.last_pass + 1


def test_writer_killed_the_engine_goes_on_with_one_warning(tmp_path):
    """SIGKILL of the writer: the engine serves on (passes keep coming), recording stops with one warning,
    and recover gives back exactly the passes closed before the kill."""
    out = tmp_path / "out"
    out.mkdir()
    with engine(out, tmp_path) as (child, log, err):
        writer = writer_pid(out)
        assert writer is not None
        os.kill(writer, signal.SIGKILL)
        at_kill = logged(log)
        wait_for(lambda: WARNING in err.read_text(errors="replace"), "warning", child)
        after = logged(log)
        wait_for(lambda: logged(log) >= after + MORE_PASSES, f"{MORE_PASSES} passes after the warning", child)
    assert err.read_text(errors="replace").count(WARNING) == 1, err.read_text()
    check_exact(out, tmp_path, at_kill)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a real file system that runs out of space (mounting needs root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}): the full-disk case needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_the_engine_goes_on_and_closed_segments_survive(tmp_path, full_disk):
    """The output directory's file system fills up: the writer's write fails with ENOSPC, recording stops
    with one warning, the engine serves on, and every segment closed before is recovered exactly."""
    with engine(full_disk, tmp_path) as (child, log, err):
        wait_for(lambda: WARNING in err.read_text(errors="replace"), "warning (the disk filled)", child)
        after = logged(log)
        wait_for(lambda: logged(log) >= after + MORE_PASSES, f"{MORE_PASSES} passes after the warning", child)
        at_warning = after
    text = err.read_text(errors="replace")
    assert text.count(WARNING) == 1 and "No space left on device" in text, text
    writer = writer_pid(full_disk)
    assert writer is not None
    wait_gone(writer)
    check_exact(full_disk, tmp_path, at_warning)
