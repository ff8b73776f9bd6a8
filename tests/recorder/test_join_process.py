"""A streaming dump's join runs in a child process (its own GIL): the same file, errors handed back, no leftovers.

:func:`moetrace.trace.join_process.join_segments` (here with every join sent to a child) must write what
:func:`~moetrace.trace.join.concat_segments` writes in-process (dataset by dataset, with the
dump's timing attributes and datasets), raise the child's own error with nothing left under
the target or a temporary name, report a child that died, start a child that imports no
torch, and leave no child running when the recording process is killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import TraceWriteError, join_process, open_trace
from moetrace.trace.files import process_alive
from moetrace.trace.join import concat_segments
from moetrace.trace.schema import TraceDamageError

ROOT = Path(__file__).resolve().parents[2]
LAYERS, EXPERTS, TOP_K, TOKENS = 3, 16, 2, 8
WAIT_S = 60  # bound on every wait (never reached when the code is right)


@pytest.fixture(autouse=True)
def every_join_in_a_child(monkeypatch):
    monkeypatch.setattr(join_process, "CHILD_MIN_BYTES", 0)


def segments(tmp_path: Path, mode: str) -> tuple[ExpertDistributionRecorder, list[Path]]:
    """Closed segments of a recording (one per hand-off) and its recorder, left recording (its session owns them)."""
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path, max_tokens_per_pass=TOKENS,
        stream_chunk_passes=4, stream_chunk_tokens=32, segment_bytes=1, segment_seconds=0,
    ))
    rec.start_record()
    rng = np.random.default_rng(0)
    for pass_id in range(20):
        with rec.with_forward_pass(pass_id):
            for layer in range(LAYERS):
                rec.on_select_experts(torch.as_tensor(rng.integers(-1, EXPERTS, (TOKENS, TOP_K))), layer=layer)
    rec._session.writer.drain()
    found = sorted(tmp_path.glob(".moetrace-*-seg*.h5"))
    assert len(found) >= 4
    return rec, found


def contents(path: Path) -> dict[str, object]:
    """Every dataset's values and every root attribute but the creation time (and the root digest, which covers it)."""
    out: dict[str, object] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        out.update({f"@{key}": value for key, value in f.attrs.items() if key not in ("created_unix", "checksum")})
    return out


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_the_child_writes_what_the_join_writes_in_process(tmp_path, mode):
    _rec, paths = segments(tmp_path, mode)
    attrs = {"timing_clock": "perf_counter", "timing_phases": '["gate"]'}
    datasets = {"stat/timing_test": np.arange(6, dtype=np.float64).reshape(1, 6)}
    here = concat_segments(paths, tmp_path / "here.h5", attrs=attrs, extra=lambda w: [w.write(n, a) for n, a in datasets.items()])
    there = join_process.join_segments(paths, tmp_path / "there.h5", attrs=attrs, datasets=datasets)
    assert there == tmp_path / "there.h5"
    a, b = contents(here), contents(there)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    with open_trace(there) as trace:  # complete, sealed, valid
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths) > 0
    assert all(p.exists() for p in paths)  # the segments are the caller's to delete
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_the_childs_error_is_raised_and_nothing_is_left(tmp_path):
    _rec, paths = segments(tmp_path, "per_token")
    with h5py.File(paths[1], "r+") as f:  # one stored row changed after sealing: the digest no longer matches
        f["tokens/pass_id"][0] += 1
    with pytest.raises(TraceDamageError, match=paths[1].name):
        join_process.join_segments(paths, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert all(p.exists() for p in paths)


def test_a_child_that_dies_is_reported(tmp_path, monkeypatch):
    _rec, paths = segments(tmp_path, "per_pass")
    monkeypatch.setattr(join_process, "_BOOTSTRAP", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(TraceWriteError, match=r"exit status -9.*the segments are kept"):
        join_process.join_segments(paths, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists() and all(p.exists() for p in paths)


def test_without_a_python_to_start_the_join_runs_on_the_calling_thread(tmp_path, monkeypatch):
    _rec, paths = segments(tmp_path, "per_pass")
    monkeypatch.setattr(sys, "executable", "")
    out = join_process.join_segments(paths, tmp_path / "out.h5")
    with open_trace(out) as trace:
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths) > 0


def _passes(segment: Path) -> int:
    with open_trace(segment) as trace:
        return int(trace.num_passes().sum())


def test_a_small_join_runs_on_the_calling_thread(tmp_path, monkeypatch):
    _rec, paths = segments(tmp_path, "per_token")
    monkeypatch.setattr(join_process, "CHILD_MIN_BYTES", sum(p.stat().st_size for p in paths) + 1)

    def no_child(*args, **kwargs):
        raise AssertionError("a join under CHILD_MIN_BYTES started a child")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    out = join_process.join_segments(paths, tmp_path / "out.h5")
    with open_trace(out) as trace:
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths) > 0


def test_the_child_imports_no_torch():
    source = join_process._BOOTSTRAP.replace("from moetrace.trace.join_process import main; main()",
                                             "import moetrace.trace.join_process; print('torch' in sys.modules)")
    assert source != join_process._BOOTSTRAP
    done = subprocess.run([sys.executable, "-c", source, join_process._PACKAGE_DIR], capture_output=True, text=True, timeout=WAIT_S, check=True)
    assert done.stdout.strip() == "False"


def orphan(tmp_path: Path, die_with_parent: bool) -> int:
    """Start a parent that starts a child as the join's is started (the bootstrap; with
    ``die_with_parent``, ``_die_with_parent`` as ``main`` calls it), SIGKILL the parent once the
    child runs; the child's pid."""
    pid_file = tmp_path / "child.pid"
    setup = "from moetrace.trace.join_process import _die_with_parent; _die_with_parent({parent}); " if die_with_parent else ""
    child_source = join_process._BOOTSTRAP.replace(
        "from moetrace.trace.join_process import main; main()",
        f"import os, time; {setup}open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep({WAIT_S})",
    )
    parent_source = (
        "import os, subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child_source!r}.replace('{{parent}}', str(os.getpid())), {join_process._PACKAGE_DIR!r}]); "
        f"time.sleep({WAIT_S})"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_source], cwd=ROOT)
    try:
        deadline = time.monotonic() + WAIT_S
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        return int(pid_file.read_text())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()


def test_the_child_dies_with_the_recording_process(tmp_path):
    """The join's child is killed with its SIGKILLed parent, so no join outlives a dead engine."""
    child = orphan(tmp_path, die_with_parent=True)
    deadline = time.monotonic() + WAIT_S
    while process_alive(child, socket.gethostname()):
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.05)


def test_negative_control_a_child_without_the_death_signal_outlives_its_parent(tmp_path):
    """The check above can fail: the same child without ``_die_with_parent`` is still alive after its parent is killed."""
    child = orphan(tmp_path, die_with_parent=False)
    try:
        assert process_alive(child, socket.gethostname())
    finally:
        os.kill(child, signal.SIGKILL)
