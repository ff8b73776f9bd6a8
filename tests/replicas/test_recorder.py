"""ReplicaRecorder: lifecycle, trace round trip, snapshot counters, threads, bounded memory."""

from __future__ import annotations

import gc
import math
import threading
import tracemalloc

import numpy as np
import pytest

import moetrace
from moetrace.replicas import LATENCY_BUCKETS, Candidate, ReplicaRecorder, ReplicaStateError
from moetrace.trace.replica_requests import read_requests


def _drive(rec: ReplicaRecorder, rid: str, replica: int, t: float, finish: bool = True) -> None:
    cands = [Candidate(r, queue=r, match_tokens=10 * r, match_blocks=r) for r in range(rec.num_replicas)]
    rec.on_arrival(rid, 100, session="s", t=t)
    rec.on_decision(rid, replica, "cache_aware", "prefix_match", cands, t=t + 0.01)
    rec.on_start(rid, t=t + 0.02)
    rec.on_first_token(rid, t=t + 0.1)
    if finish:
        rec.on_finish(rid, 5, 10 * replica, t=t + 1.0)


def test_round_trip_and_snapshot(tmp_path):
    rec = ReplicaRecorder(3, output_dir=tmp_path, chunk_rows=4, block_size=16)
    _drive(rec, "ignored", 0, 0.0)  # not recording: a no-op
    rec.start_record()
    for i in range(10):
        _drive(rec, f"r{i}", i % 3, float(i), finish=i < 9)
    rec.on_migration("s", 0, 2, t=3.0)
    snap = rec.snapshot()
    assert snap.decisions.sum() == 10 and snap.finished == 9 and snap.migrations == 1
    assert snap.running.tolist() == [1, 0, 0]  # r9 on replica 0 started, not finished
    assert snap.hit_tokens.tolist() == [0, 30, 60] and snap.regret_tokens.tolist() == [4 * 20, 3 * 10, 0]
    near = LATENCY_BUCKETS.index(0.1)  # TTFT 0.1 s (+- rounding): the 0.1 or the next bucket
    assert snap.ttft_buckets.sum() == 10 and snap.ttft_buckets[:, near : near + 2].sum() == 10
    path = rec.dump_record(tmp_path / "r.h5")
    t = read_requests(path)
    q = t.requests
    assert sorted(q["id"]) == sorted(f"r{i}" for i in range(10))
    i9 = t.index_of("r9")
    assert q["finished"][i9] == 0 and math.isnan(q["e2e"][i9]) and q["ttft"][i9] == pytest.approx(0.1)
    i4 = t.index_of("r4")
    assert (q["replica"][i4], q["cached_tokens"][i4], q["predicted_tokens"][i4], q["best_tokens"][i4]) == (1, 10, 10, 20)
    assert q["queue_wait"][i4] == pytest.approx(0.02) and q["e2e"][i4] == pytest.approx(1.0)
    assert t.policies[q["policy"][i4]] == "cache_aware" and t.reasons[q["reason"][i4]] == "prefix_match"
    s, n = q["cand_start"][i4], q["cand_count"][i4]
    assert n == 3 and t.candidates["request_seq"][s] == q["seq"][i4] and t.candidates["match_tokens"][s : s + n].tolist() == [0, 10, 20]
    assert t.migrations["target"].tolist() == [2] and t.block_size == 16 and t.clock == "monotonic"
    # the in-flight request stays in flight: the next dump has it, finished
    rec.on_finish("r9", 5, 0, t=20.0)
    t2 = read_requests(rec.dump_record(tmp_path / "r2.h5"))
    assert t2.requests["id"].tolist() == ["r9"] and t2.requests["finished"].tolist() == [1]
    rec.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_state_errors(tmp_path):
    rec = ReplicaRecorder(2, output_dir=tmp_path)
    with pytest.raises(ReplicaStateError, match="start_record"):
        rec.dump_record()
    rec.start_record()
    with pytest.raises(ReplicaStateError, match="not in flight"):
        rec.on_decision("nope", 0, "random", "random")
    rec.on_arrival("a", 1)
    with pytest.raises(ReplicaStateError, match="outside"):
        rec.on_decision("a", 5, "random", "random")
    with pytest.raises(ReplicaStateError, match="unknown"):
        rec.on_decision("a", 0, "fastest", "random")
    with pytest.raises(ValueError, match="positive"):
        ReplicaRecorder(0)
    rec.close()


def test_threads(tmp_path):
    rec = ReplicaRecorder(4, output_dir=tmp_path, chunk_rows=64)
    rec.start_record()

    def worker(k: int) -> None:
        for i in range(500):
            _drive(rec, f"{k}-{i}", (k + i) % 4, float(i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    t = read_requests(rec.dump_record(tmp_path / "t.h5"))
    rec.close()
    assert len(t) == 4000 and len(set(t.requests["id"])) == 4000
    assert len(t.candidates["replica"]) == 16000
    assert np.array_equal(t.candidates["request_seq"][t.requests["cand_start"]], t.requests["seq"])


def test_memory_is_bounded(tmp_path):
    """Host memory after 25k decisions is no larger than after 5k: rows stream to the segment file."""
    rec = ReplicaRecorder(8, output_dir=tmp_path, chunk_rows=1024)
    rec.start_record()
    cands = [Candidate(r) for r in range(8)]

    def run(start: int, n: int) -> None:
        for i in range(start, start + n):
            rid = str(i)
            rec.on_arrival(rid, 100, t=0.0)
            rec.on_decision(rid, i % 8, "random", "random", cands, t=0.0)
            rec.on_finish(rid, 1, 0, t=1.0)

    tracemalloc.start()
    run(0, 5_000)
    gc.collect()
    first = tracemalloc.get_traced_memory()[0]
    run(5_000, 20_000)
    gc.collect()
    second = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert second < first + 2_000_000, (first, second)
    assert len(rec._rows) < rec.chunk_rows and rec.in_flight == 0
    assert len(read_requests(rec.dump_record(tmp_path / "m.h5"))) == 25_000
    rec.close()


def test_import_moetrace_stays_lean():
    import subprocess
    import sys

    code = "import sys, moetrace; print(any(m.startswith('moetrace.replicas') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    assert moetrace is not None


def test_writer_failure_is_reported_at_dump_and_reset_recovers(tmp_path, monkeypatch):
    """A failed background append surfaces as ReplicaStateError at dump_record; after reset() recording works again."""
    rec = ReplicaRecorder(2, output_dir=tmp_path, chunk_rows=64)
    rec.start_record()
    _drive(rec, "a", 0, 0.0)

    def broken(name, rows):
        raise OSError("disk full")

    monkeypatch.setattr(rec._segment.writer, "append", broken)
    with pytest.raises(ReplicaStateError, match=r"background trace writer failed \(disk full\); call reset\(\)"):
        rec.dump_record(tmp_path / "bad.h5")
    assert not (tmp_path / "bad.h5").exists()
    rec.reset()
    _drive(rec, "b", 1, 2.0)
    t = read_requests(rec.dump_record(tmp_path / "good.h5"))
    rec.close()
    assert list(t.requests["id"]) == ["b"]


def test_reset_while_recording_keeps_recording_and_dumps(tmp_path):
    """reset() while recording forgets what was recorded and goes on recording; the next dump holds what followed."""
    rec = ReplicaRecorder(2, output_dir=tmp_path)
    rec.start_record()
    _drive(rec, "a", 0, 0.0)
    rec.reset()
    assert rec.recording
    _drive(rec, "b", 1, 2.0)
    t = read_requests(rec.dump_record(tmp_path / "after-reset.h5"))
    rec.close()
    assert list(t.requests["id"]) == ["b"]
