"""Retention: a long-running recorder's output directory stays within its bound, on a fast clock.

A real recorder dumps per_pass traces every "hour" of an injected clock; after
every dump the directory is measured. Never removed: the newest dump, a file a
reader holds open (a real h5py reader in this process takes HDF5's lock), a
writer's temporary, and the crash-safety files (segments, journal).
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.analysis.deployment import analyze_deployment
from moetrace.trace.files import SEGMENT_RE
from moetrace.trace.reader import open_trace
from moetrace.trace.retention import Retention, RetentionPolicy
from tests.analysis.helpers import random_passes, replay_pass

L, E, K = 2, 8, 2


def _bytes(directory) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file())


def _recorder(tmp_path, policy, mode="per_pass") -> ExpertDistributionRecorder:
    cfg = RecorderConfig(num_layers=L, num_physical_experts=E, top_k=K, mode=mode, output_dir=tmp_path, max_tokens_per_pass=64,
                         stream_chunk_tokens=4096, stream_chunk_passes=16, segment_seconds=0, retention=policy)
    return ExpertDistributionRecorder(cfg)


def test_byte_bound_holds_and_nothing_live_or_open_is_removed(tmp_path):
    policy = RetentionPolicy(max_bytes=120_000, max_dumps=4)
    rec = _recorder(tmp_path, policy)
    rng = np.random.default_rng(0)
    rec.start_record()
    held = None
    reader = None
    foreign = tmp_path / "notes.h5"
    with h5py.File(foreign, "w") as f:  # not a moetrace trace: never ours to remove
        f["x"] = np.zeros(10)
    temporary = tmp_path / ".moetrace-x.h5.tmp-host-1-0123abcd"
    temporary.write_bytes(b"\0" * 1000)
    written = []
    for i in range(24):
        for ids in random_passes(rng, 12, L, E, K, max_tokens=40):
            replay_pass(rec, ids)
        written.append(rec.dump_record(tmp_path / f"dump{i:02d}.h5"))
        if i == 5:
            held = written[3]
            reader = open_trace(held)  # an analyst has this one open
        assert _bytes(tmp_path) - foreign.stat().st_size - temporary.stat().st_size <= policy.max_bytes, i
        assert written[-1].exists()  # the newest dump is always kept
        if held is not None:
            assert held.exists() and reader.num_passes().sum() > 0
    stats = rec.status()["retention"]
    assert stats["removed_files"] > 0 and stats["compacted_files"] > 0 and stats["busy_skips"] > 0
    assert not stats["over_bound"] and stats["directory_bytes"] <= policy.max_bytes
    assert foreign.exists() and temporary.exists()
    reader.close()
    snap = rec.snapshot()
    assert snap.retention["removed_files"] == stats["removed_files"]
    rec.stop_record()


def test_count_bound_compacts_and_keeps_totals(tmp_path):
    clock = [1_800_000_000.0]
    rng = np.random.default_rng(1)
    rec = _recorder(tmp_path, None)
    rec.start_record()
    dumps, totals = [], []
    for i in range(6):
        for ids in random_passes(rng, 5, L, E, K):
            replay_pass(rec, ids)
        dumps.append(rec.dump_record(tmp_path / f"d{i}.h5"))
        with open_trace(dumps[-1]) as t:
            totals.append(t.logical_count().copy())
    rec.stop_record()
    retention = Retention(RetentionPolicy(max_dumps=2), tmp_path, clock=lambda: clock[0])
    stats = retention.apply()
    assert stats.compacted_files == 4 and stats.removed_files == 0
    for path, want in zip(dumps, totals, strict=True):
        with open_trace(path) as t:
            np.testing.assert_array_equal(t.logical_count(), want)  # the totals survive compaction
            assert (t.mode == "stat") == (path in dumps[:4])
            assert (t.attrs.get("compacted_from") == "per_pass") == (path in dumps[:4])
    series = analyze_deployment(dumps)  # compacted recordings still form the series
    assert [int(r.logical_count.sum()) for r in series.recordings] == [int(t.sum()) for t in totals]
    assert retention.apply().compacted_files == 4  # idempotent


def test_age_bound_on_a_fast_clock(tmp_path):
    now = [0.0]
    rng = np.random.default_rng(2)
    rec = _recorder(tmp_path, None, mode="stat")
    dumps = []
    for i in range(5):
        rec.start_record()
        for ids in random_passes(rng, 3, L, E, K):
            replay_pass(rec, ids)
        dumps.append(rec.dump_record(tmp_path / f"s{i}.h5"))
        rec.stop_record()
        rec.reset()
    with open_trace(dumps[0]) as t:
        created = float(t.attrs["created_unix"])
    retention = Retention(RetentionPolicy(max_age_seconds=86400.0), tmp_path, clock=lambda: now[0])
    now[0] = created + 86400.0 - 1
    assert retention.apply().removed_files == 0
    now[0] = created + 10 * 86400.0
    stats = retention.apply()
    assert stats.removed_files == 4 and [p.exists() for p in dumps] == [False] * 4 + [True]


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        RetentionPolicy(max_bytes=0)
    with pytest.raises(ValueError, match="RetentionPolicy"):
        RecorderConfig(num_layers=1, num_physical_experts=2, top_k=1, retention={"max_dumps": 3})  # type: ignore[arg-type]


def test_no_time_bound_means_no_segment_per_pass_after_a_dump(tmp_path):
    """segment_seconds=0 (no time bound): after a dump the recorder closed a segment at every pass end."""
    rec = _recorder(tmp_path, None)
    rec.start_record()
    rng = np.random.default_rng(3)
    for ids in random_passes(rng, 3, L, E, K):
        replay_pass(rec, ids)
    rec.dump_record(tmp_path / "first.h5")
    for ids in random_passes(rng, 20, L, E, K):
        replay_pass(rec, ids)
    closed = [p for p in tmp_path.iterdir() if SEGMENT_RE.match(p.name)]
    assert closed == []  # nothing closes a segment before the next dump: no size or time bound was reached
    rec.dump_record(tmp_path / "second.h5")
    with open_trace(tmp_path / "second.h5") as t:
        assert int(t.num_passes().sum()) == 20
    rec.stop_record()
