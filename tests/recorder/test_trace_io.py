"""Atomic dumps, unwritable paths, full disks, and readers refusing bad files."""

from __future__ import annotations

import errno
import json
import os

import h5py
import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig, RecorderStateError
from moetrace.trace import SCHEMA_VERSION, TraceError, TraceWriteError, offload, open_trace
from moetrace.trace.recover import recover
from moetrace.trace.writer import TraceWriter, write_json_atomic
from moetrace.trace.writer_process import RemoteSink
from tests.recorder.helpers import random_passes, replay


def recorded(tmp_path, mode="stat") -> ExpertDistributionRecorder:
    # segment_bytes: several closed segments, so a streaming dump joins them into a new file
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=8, top_k=2, mode=mode, output_dir=tmp_path, stream_chunk_passes=4, stream_chunk_tokens=64, max_tokens_per_pass=16, segment_bytes=64))
    rec.start_record()
    replay(rec, random_passes(np.random.default_rng(0), 9, 2, 8, 2, bad=False))
    return rec


def visible(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if not p.startswith("."))


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_failure_mid_dump_leaves_nothing_and_retry_succeeds(tmp_path, monkeypatch, mode):
    rec = recorded(tmp_path, mode)
    before = rec.snapshot().physical_count.copy()
    original = TraceWriter.commit

    def disk_full(self):
        if self.path.name == "out.h5":  # the dump itself fails, not the segments behind it
            self.abort()
            raise TraceWriteError(f"finishing trace {self.path} failed: {os.strerror(errno.ENOSPC)}")
        return original(self)

    promote = offload.promote

    def disk_full_at_rename(staging, target):  # a streaming dump's join ran in a child: the full disk hits its last step here
        if target.name == "out.h5":
            staging.unlink()
            raise TraceWriteError(f"finishing trace {target} failed: {os.strerror(errno.ENOSPC)}")
        return promote(staging, target)

    monkeypatch.setattr(TraceWriter, "commit", disk_full)
    monkeypatch.setattr(offload, "promote", disk_full_at_rename)
    with pytest.raises(TraceWriteError, match="No space left"):
        rec.dump_record(tmp_path / "out.h5")
    assert visible(tmp_path) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.h5")]  # temp removed
    monkeypatch.setattr(TraceWriter, "commit", original)
    monkeypatch.setattr(offload, "promote", promote)
    path = rec.dump_record(tmp_path / "out.h5")
    with open_trace(path) as trace:
        np.testing.assert_array_equal(trace.physical_count(), before)
        if mode == "per_pass":
            assert trace.num_rows("passes/pass_id") == 9
        if mode == "per_token":
            assert trace.num_rows("tokens/topk_ids") == rec.snapshot().num_tokens


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_a_failed_last_dump_after_stop_keeps_the_session_for_a_retry(tmp_path, monkeypatch, mode):
    """The last streaming dump after stop_record takes the recording's session; when it fails, the
    session comes back, so the retry holds every pass, and once it succeeds there is nothing to dump."""
    rec = recorded(tmp_path, mode)
    rec.stop_record()
    before = rec.snapshot().physical_count.copy()
    promote = offload.promote

    def disk_full_at_rename(staging, target):
        if target.name == "last.h5":
            staging.unlink()
            raise TraceWriteError(f"finishing trace {target} failed: {os.strerror(errno.ENOSPC)}")
        return promote(staging, target)

    monkeypatch.setattr(offload, "promote", disk_full_at_rename)
    with pytest.raises(TraceWriteError, match="No space left"):
        rec.dump_record(tmp_path / "last.h5")
    assert rec.undumped_passes == 9 and rec._files.session is not None  # given back
    monkeypatch.setattr(offload, "promote", promote)
    with open_trace(rec.dump_record(tmp_path / "retry.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), before)
        assert int(trace.num_passes().sum()) == 9
    assert rec.undumped_passes == 0 and rec._files.session is None
    with pytest.raises(RecorderStateError, match="call start_record"):
        rec.dump_record(tmp_path / "again.h5")


def test_a_failed_last_dump_does_not_take_back_a_session_a_new_recording_opened(tmp_path, monkeypatch):
    """The failed dump's session is not given back when a new recording began before it failed: it
    is closed (its writer thread stopped) and its segments are left for ``moetrace recover``."""
    rec = recorded(tmp_path, "per_pass")
    rec.stop_record()
    before, run_id, session = rec.snapshot().physical_count.copy(), rec.run_id, rec._files.session
    promote, started = offload.promote, []

    def new_recording_then_fail(staging, target):
        if target.name == "last.h5":
            rec._run_id = "a-new-recording"  # what start_record on another thread would have set
            started.append(True)
            staging.unlink()
            raise TraceWriteError(f"finishing trace {target} failed: {os.strerror(errno.ENOSPC)}")
        return promote(staging, target)

    monkeypatch.setattr(offload, "promote", new_recording_then_fail)
    with pytest.raises(TraceWriteError):
        rec.dump_record(tmp_path / "last.h5")
    assert started and rec._files.session is None
    assert not session.writer._thread.is_alive()
    monkeypatch.setattr(offload, "promote", promote)
    [rank] = recover(tmp_path, tmp_path / "recovered.h5", run_id=run_id, force=True)  # force: this process still runs
    with open_trace(rank.path) as trace:
        np.testing.assert_array_equal(trace.physical_count(), before)
        assert int(trace.num_passes().sum()) == 9


def test_streaming_writer_failure_is_reported(tmp_path, monkeypatch):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, mode="per_pass", output_dir=tmp_path, stream_chunk_passes=2))
    rec.start_record()

    def broken(self, part):  # the writer process's answer to a write on a full disk
        raise TraceWriteError(f"writing trace segment failed: {os.strerror(errno.ENOSPC)}")

    monkeypatch.setattr(RemoteSink, "write", broken)
    replay(rec, [[np.array([[1]])]] * 4)
    rec._files.session.writer.drain()
    assert any("No space left" in e for e in rec.status()["errors"])
    with pytest.raises(TraceWriteError, match="background trace writer failed"):
        rec.dump_record()
    assert visible(tmp_path) == []


def test_unwritable_output_paths(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rec = recorded(tmp_path)
    with pytest.raises(TraceWriteError, match="cannot create output directory"):
        rec.dump_record(blocker / "sub" / "t.h5")
    streaming = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, mode="per_token", output_dir=blocker))
    with pytest.raises(TraceWriteError, match="not a directory"):
        streaming.start_record()
    assert not streaming.recording


def test_reader_refuses_bad_files(tmp_path):
    good = recorded(tmp_path).dump_record(tmp_path / "good.h5")
    missing = tmp_path / "missing.h5"
    text = tmp_path / "text.h5"
    text.write_text("hello")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    newer = tmp_path / "newer.h5"
    newer.write_bytes(good.read_bytes())
    with h5py.File(newer, "a") as f:
        f.attrs["schema_version"] = 99
    unfinished = tmp_path / "unfinished.h5"
    unfinished.write_bytes(good.read_bytes())
    with h5py.File(unfinished, "a") as f:
        f.attrs["complete"] = False
    cases = {
        missing: "no such file",
        text: "not an HDF5 file or truncated",
        truncated: "truncated",
        foreign: "not a moetrace trace",
        newer: "schema version 99 is newer",
        unfinished: "incomplete",
    }
    for path, message in cases.items():
        with pytest.raises(TraceError, match=message) as info:
            open_trace(path)
        assert str(path) in str(info.value)
    with open_trace(good) as trace, pytest.raises(TraceError, match="has no /tokens/topk_ids"):
        trace._read("tokens/topk_ids")


def test_trace_attributes_are_self_describing(tmp_path):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=8, top_k=2, ep_size=2, output_dir=tmp_path, model="tiny", engine="reference", layer_ids=(1, 3)))
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(1):
        rec.on_select_experts(torch.tensor([[1, 6]]))
    with open_trace(rec.dump_record()) as trace:
        attrs = trace.attrs
    assert attrs["schema"] == "moetrace" and attrs["schema_version"] == SCHEMA_VERSION
    assert attrs["model"] == "tiny" and attrs["engine"] == "reference" and attrs["mode"] == "stat"
    assert attrs["id_space"] == "logical" and attrs["ep_size"] == 2 and attrs["num_logical_experts"] == 8
    assert attrs["complete"] is True or attrs["complete"] == 1


def test_write_json_atomic_replaces_whole_or_leaves_the_old_file(tmp_path):
    """A document that fails to serialise leaves the previous file and no temporary; one that works replaces it."""
    target = tmp_path / "doc.json"
    assert write_json_atomic(target, {"v": 1}) == target
    with pytest.raises(TypeError):
        write_json_atomic(target, {"v": 2, "bad": object()})
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]
    write_json_atomic(str(target), {"v": 3})
    assert json.loads(target.read_text()) == {"v": 3} and sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]
