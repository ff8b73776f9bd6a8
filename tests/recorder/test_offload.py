"""A dump's file is written in a child process (its own GIL): the same file, errors handed back, no leftovers.

:func:`moetrace.trace.offload.join_segments` and :func:`~moetrace.trace.offload.write_stat_trace`
(here with every job sent to a child) must write what the same job writes in-process (dataset by
dataset, with the dump's timing attributes and datasets), hand the arrays over intact, raise the
child's own error with nothing left under the target or a temporary name, report a child that
died, start a child that imports no torch, and leave no child running when the recording process
is killed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.pass_phase import PASS_PHASES
from moetrace.recording import dump_files
from moetrace.recording import session as session_module
from moetrace.trace import TraceWriteError, offload, open_trace
from moetrace.trace import child as child_process
from moetrace.trace.files import process_alive
from moetrace.trace.join import concat_segments
from moetrace.trace.schema import TraceDamageError, TraceHeader
from moetrace.trace.stat import CounterLayout, StatRows

ROOT = Path(__file__).resolve().parents[2]
LAYERS, EXPERTS, TOP_K, TOKENS = 3, 16, 2, 8
WAIT_S = 60  # bound on every wait (never reached when the code is right)


@pytest.fixture(autouse=True)
def every_join_in_a_child(monkeypatch):
    monkeypatch.setattr(offload, "CHILD_MIN_BYTES", 0)


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
    rec._files.session.writer.drain()
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
    there = offload.join_segments(paths, tmp_path / "there.h5", attrs=attrs, datasets=datasets)
    assert there == tmp_path / "there.h5"
    a, b = contents(here), contents(there)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    with open_trace(there) as trace:  # complete, sealed, valid
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths) > 0
    assert all(p.exists() for p in paths)  # the segments are the caller's to delete
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def stat_rows(window: int = 6, filled: int = 4, tokens: int = 5) -> tuple[TraceHeader, CounterLayout, StatRows]:
    """A ``stat`` dump of one rank row: ``filled`` passes of ``tokens`` tokens in ``window`` slots
    (the ring wrapped: its counts in two pieces, the oldest slots first), every pass in the first
    pass phase, the totals the sum of the window."""
    rng = np.random.default_rng(1)
    layout = CounterLayout(EXPERTS, 1)
    header = TraceHeader(mode="stat", id_space="logical", num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=1,
                         layer_ids=np.arange(LAYERS), physical_to_logical=np.tile(np.arange(EXPERTS), (LAYERS, 1)))
    order = np.roll(np.arange(window), -2)  # slot 2 is the oldest
    ring = np.zeros((1, window, LAYERS, EXPERTS), dtype=np.int32)
    ring[0, order[:filled]] = rng.multinomial(tokens * TOP_K, np.full(EXPERTS, 1 / EXPERTS), (filled, LAYERS))
    meta = np.full((1, window, 5), -1.0)
    meta[0, :filled] = np.stack([np.arange(filled), np.arange(filled) * 0.5, np.full(filled, tokens), np.zeros(filled), np.ones(filled)], axis=1)
    phases = len(PASS_PHASES)
    phase_rows = np.zeros((1, phases, LAYERS, layout.width), dtype=np.int64)
    phase_rows[0, 0, :, layout.experts] = ring[0].sum(axis=0)
    phase_rows[0, 0, :, layout.tokens] = filled * tokens
    phase_counts = np.zeros((1, 3, phases), dtype=np.int64)
    phase_counts[0, :, 0] = (filled, filled * tokens, filled)
    rows = StatRows(phase_rows.sum(axis=1), np.array([[filled, filled * tokens]]), meta, [ring[:, 2:], ring[:, :2]],
                    phase_rows=phase_rows, phase_counts=phase_counts)
    return header, layout, rows


def test_the_child_writes_the_stat_dump_written_in_process(tmp_path, monkeypatch):
    header, layout, rows = stat_rows()
    attrs = {"timing_clock": "perf_counter"}
    datasets = {"stat/timing_test": np.arange(6, dtype=np.float64).reshape(1, 6)}
    there = offload.write_stat_trace(tmp_path / "there.h5", header, layout, rows, attrs=attrs, datasets=datasets)
    monkeypatch.setattr(sys, "executable", "")  # the same job on this thread
    here = offload.write_stat_trace(tmp_path / "here.h5", header, layout, rows, attrs=attrs, datasets=datasets)
    a, b = contents(here), contents(there)
    assert a.keys() == b.keys() and "window/physical_count" in a
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    with open_trace(there) as trace:  # complete, sealed, and the values are those handed over
        np.testing.assert_array_equal(trace.physical_count(), rows.rows[0, :, layout.experts])
        np.testing.assert_array_equal(np.asarray(b["window/physical_count"])[0], np.concatenate(rows.counts, axis=1)[0, :4])
        assert int(trace.num_tokens().sum()) == 20
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_the_work_happens_in_the_child(tmp_path, monkeypatch):
    """Above CHILD_MIN_BYTES this process runs neither job itself (its ``run_job`` would fail)."""
    header, layout, rows = stat_rows()
    _rec, paths = segments(tmp_path, "per_pass")

    def not_here(job):
        raise AssertionError(f"the {job['kind']} job ran in the recording process")

    monkeypatch.setattr(offload, "run_job", not_here)
    with open_trace(offload.write_stat_trace(tmp_path / "stat.h5", header, layout, rows)) as trace:
        assert int(trace.num_passes().sum()) == 4
    with open_trace(offload.join_segments(paths, tmp_path / "joined.h5")) as trace:
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths)
    monkeypatch.setattr(offload, "CHILD_MIN_BYTES", 1 << 40)  # negative control: a small job runs here, and fails
    with pytest.raises(AssertionError, match="stat job ran in the recording process"):
        offload.write_stat_trace(tmp_path / "small.h5", header, layout, rows)


def test_the_hand_over_keeps_every_array():
    """The framing sends contiguous arrays out of band and any other in the pickle: all come back equal."""
    base = np.arange(60, dtype=np.int32).reshape(3, 4, 5)
    job = {"c": base, "view": base[:, 1:3], "fortran": np.asfortranarray(base), "strided": base[:, :, ::2], "empty": np.zeros((0, 5)),
           "scalar": np.float64(2.5), "text": "x", "nested": [base[0], {"b": np.ones(3, dtype=bool)}]}
    stream = io.BytesIO()
    child_process.send(stream, job)
    stream.seek(0)
    back = child_process.receive(stream)
    assert back.keys() == job.keys() and back["text"] == "x" and back["scalar"] == 2.5
    for key in ("c", "view", "fortran", "strided", "empty"):
        np.testing.assert_array_equal(back[key], job[key], err_msg=key)
        assert back[key].dtype == job[key].dtype
    np.testing.assert_array_equal(back["nested"][0], base[0])
    np.testing.assert_array_equal(back["nested"][1]["b"], np.ones(3, dtype=bool))
    back["c"][0, 0, 0] = -1  # writable, and its own memory
    assert base[0, 0, 0] == 0
    stream.seek(0)
    with pytest.raises(EOFError, match="the message ended"):
        child_process.receive(io.BytesIO(stream.read()[:-7]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_a_childs_pipes_hold_a_mebibyte_and_carry_a_checkpoint_sized_message_intact():
    """The writer's pipes are widened to ``PIPE_BYTES`` (a 64 MiB checkpoint crosses in 64 writes, not
    1,024), and a message many times that size still arrives whole; the default 64 KiB pipe is
    what the widening changes (negative control: a pipe of this process's own)."""
    get_size = getattr(fcntl, "F_GETPIPE_SZ", 1032)
    with open("/proc/sys/fs/pipe-max-size") as limit:
        if int(limit.read()) < child_process.PIPE_BYTES:
            pytest.skip("this kernel's pipe-max-size is below PIPE_BYTES: the default pipe is kept")
    read_end, write_end = os.pipe()
    try:
        assert fcntl.fcntl(write_end, get_size) < child_process.PIPE_BYTES  # what an unwidened pipe holds
    finally:
        os.close(read_end)
        os.close(write_end)
    child = child_process.start_child("moetrace.trace.writer_process", capture_stderr=False)
    try:
        assert fcntl.fcntl(child.stdin.fileno(), get_size) == child_process.PIPE_BYTES
        assert fcntl.fcntl(child.stdout.fileno(), get_size) == child_process.PIPE_BYTES
    finally:
        child.kill()
        child.wait()
    read_end, write_end = os.pipe()
    big = np.random.default_rng(0).integers(0, 1 << 30, size=(5, 1 << 20), dtype=np.int32)  # 20 MiB
    with os.fdopen(read_end, "rb") as reader, os.fdopen(write_end, "wb") as writer:
        child_process.widen_pipe(write_end)
        got: list[object] = []
        thread = threading.Thread(target=lambda: got.append(child_process.receive(reader)))
        thread.start()
        child_process.send(writer, {"window": big, "pass": 7})
        thread.join(WAIT_S)
    assert got and got[0]["pass"] == 7
    np.testing.assert_array_equal(got[0]["window"], big)


def test_a_stat_write_that_fails_in_the_child_is_raised(tmp_path):
    header, layout, rows = stat_rows()
    (tmp_path / "file").write_text("")
    with pytest.raises(TraceWriteError, match="file"):  # the child cannot create its file: its own error, as it raised it
        offload.write_stat_trace(tmp_path / "file" / "out.h5", header, layout, rows)
    (tmp_path / "file").unlink()
    broken = dataclasses.replace(rows, meta=rows.meta[:, :, :2])  # no tokens column: the write fails half-way
    with pytest.raises(IndexError):
        offload.write_stat_trace(tmp_path / "out.h5", header, layout, broken)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary


def test_the_childs_error_is_raised_and_nothing_is_left(tmp_path):
    _rec, paths = segments(tmp_path, "per_token")
    with h5py.File(paths[1], "r+") as f:  # one stored row changed after sealing: the digest no longer matches
        f["tokens/pass_id"][0] += 1
    with pytest.raises(TraceDamageError, match=paths[1].name):
        offload.join_segments(paths, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert all(p.exists() for p in paths)


def test_a_child_that_dies_is_reported(tmp_path, monkeypatch):
    _rec, paths = segments(tmp_path, "per_pass")
    monkeypatch.setattr(child_process, "_BOOTSTRAP", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(TraceWriteError, match=r"exit status -9.*the segments are kept"):
        offload.join_segments(paths, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists() and all(p.exists() for p in paths)


def test_without_a_python_to_start_the_join_runs_on_the_calling_thread(tmp_path, monkeypatch):
    _rec, paths = segments(tmp_path, "per_pass")
    monkeypatch.setattr(sys, "executable", "")
    out = offload.join_segments(paths, tmp_path / "out.h5")
    with open_trace(out) as trace:
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths) > 0


def _passes(segment: Path) -> int:
    with open_trace(segment) as trace:
        return int(trace.num_passes().sum())


def test_a_small_join_runs_on_the_calling_thread(tmp_path, monkeypatch):
    _rec, paths = segments(tmp_path, "per_token")
    monkeypatch.setattr(offload, "CHILD_MIN_BYTES", sum(p.stat().st_size for p in paths) + 1)

    def no_child(*args, **kwargs):
        raise AssertionError("a join under CHILD_MIN_BYTES started a child")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    out = offload.join_segments(paths, tmp_path / "out.h5")
    with open_trace(out) as trace:
        assert int(trace.num_passes().sum()) == sum(_passes(p) for p in paths) > 0


def test_the_child_imports_no_torch():
    source = child_process._BOOTSTRAP.replace("importlib.import_module(sys.argv[2]).main()",
                                      "importlib.import_module(sys.argv[2]); print('torch' in sys.modules)")
    assert source != child_process._BOOTSTRAP
    for module in ("moetrace.trace.offload", "moetrace.trace.writer_process"):
        done = subprocess.run([sys.executable, "-c", source, child_process._PACKAGE_DIR, module], capture_output=True, text=True, timeout=WAIT_S, check=True)
        assert done.stdout.strip() == "False", module


def orphan(tmp_path: Path, die_with_parent: bool) -> int:
    """Start a parent that starts a child as the join's is started (the bootstrap; with
    ``die_with_parent``, ``_die_with_parent`` as ``main`` calls it), SIGKILL the parent once the
    child runs; the child's pid."""
    pid_file = tmp_path / "child.pid"
    setup = "from moetrace.trace.child import die_with_starter; die_with_starter({parent}); " if die_with_parent else ""
    child_source = child_process._BOOTSTRAP.replace(
        "importlib.import_module(sys.argv[2]).main()",
        f"import os, time; {setup}open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep({WAIT_S})",
    )
    parent_source = (
        "import os, subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child_source!r}.replace('{{parent}}', str(os.getpid())), {child_process._PACKAGE_DIR!r}, 'moetrace.trace.offload']); "
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


def _answer_after_sigint(bootstrap: str) -> tuple[str, int]:
    """Start a child with ``bootstrap`` (its ``main`` replaced by: say ready, read a line, say
    alive), send it SIGINT once ready, then a line; what it printed and its exit status. The child
    starts with SIGINT's default action whatever this process inherited (a shell runs a background
    job with SIGINT ignored, and a child would inherit that)."""
    source = bootstrap.replace("importlib.import_module(sys.argv[2]).main()",
                               "print('ready', flush=True); sys.stdin.readline(); print('alive', flush=True)")
    child = subprocess.Popen([sys.executable, "-c", source, child_process._PACKAGE_DIR, "moetrace.trace.writer_process"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGINT)  # what a Ctrl-C at the terminal sends every process of the foreground group
    printed, _ = child.communicate("go\n", timeout=WAIT_S)
    return printed.strip(), child.returncode


def test_a_ctrl_c_leaves_the_child_running():
    """A Ctrl-C reaches the engine and its writer and dump children alike: the children ignore it
    (the engine dumps its recording while they still run, and they end with it)."""
    assert _answer_after_sigint(child_process._BOOTSTRAP) == ("alive", 0)


def test_negative_control_a_child_without_the_shield_dies_of_a_ctrl_c():
    """The check above can fail: the same child without the bootstrap's SIGINT line dies of it."""
    shield = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    assert shield in child_process._BOOTSTRAP
    printed, status = _answer_after_sigint(child_process._BOOTSTRAP.replace(shield, ""))
    assert printed == "" and status != 0


def _record_and_dump(tmp_path: Path, mode: str, monkeypatch, **files: float) -> tuple[list[str], Path, np.ndarray]:
    """Record 20 passes (``files``: the recording's rotation settings), dump while recording with every
    job small; the kinds of the jobs run in this interpreter, the dump, and the ids' count ``[L, E]``.
    A streaming dump must be a join (of more than one segment), not a rename."""
    monkeypatch.setattr(offload, "CHILD_MIN_BYTES", 1 << 40)  # every dump job is small
    here: list[str] = []
    joined: list[int] = []
    real, real_join = offload.run_job, dump_files.join_segments

    def spy(job):
        here.append(str(job["kind"]))
        return real(job)

    def join(paths, *args, **kwargs):
        assert len(paths) > 1
        joined.append(len(paths))
        return real_join(paths, *args, **kwargs)

    monkeypatch.setattr(offload, "run_job", spy)
    monkeypatch.setattr(session_module, "run_job", spy)
    monkeypatch.setattr(dump_files, "join_segments", join)
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path, max_tokens_per_pass=TOKENS,
        stream_chunk_passes=4, stream_chunk_tokens=32, **files,  # type: ignore[arg-type]
    ))
    rec.start_record()
    rng = np.random.default_rng(1)
    counts = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    for pass_id in range(20):
        with rec.with_forward_pass(pass_id):
            for layer in range(LAYERS):
                ids = rng.integers(-1, EXPERTS, (TOKENS, TOP_K))
                np.add.at(counts[layer], ids[ids >= 0], 1)
                rec.on_select_experts(torch.as_tensor(ids), layer=layer)
    try:
        path = rec.dump_record(tmp_path / f"{mode}.h5")
    finally:
        rec.reset()
    assert len(joined) == (mode != "stat")
    return here, path, counts


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_a_small_dump_while_recording_is_written_by_the_writer_process(tmp_path, monkeypatch, mode):
    """Issue 50: a dump too small for a child of its own is written by the recording's writer
    process, not on the dump thread, so the engine's interpreter writes no dump file either."""
    here, path, counts = _record_and_dump(tmp_path, mode, monkeypatch, segment_passes=8)
    assert here == []
    with open_trace(path) as trace:
        np.testing.assert_array_equal(trace.physical_count(), counts)


def test_negative_control_without_a_writer_process_the_small_dump_runs_here(tmp_path, monkeypatch):
    """The check above can fail: a ``stat`` recording that keeps no files has no writer process, and
    its small dump runs on the dump thread (the spy sees it)."""
    here, path, counts = _record_and_dump(tmp_path, "stat", monkeypatch, segment_passes=0)
    assert here == ["stat"]
    with open_trace(path) as trace:
        np.testing.assert_array_equal(trace.physical_count(), counts)
