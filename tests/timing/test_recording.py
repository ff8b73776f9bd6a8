"""Recording phase timing: the hooks' contract, aggregates, trace layout, modes and old traces."""

from __future__ import annotations

import time

import h5py
import numpy as np
import pytest
import torch

import moetrace
from moetrace import PHASES, ExpertDistributionRecorder, RecorderConfig, RecorderStateError
from moetrace.analysis.summary import analyze_trace
from moetrace.analysis.timeline import build_timeline
from moetrace.analysis.timing import analyze_timing
from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel
from moetrace.testing import assert_no_host_sync
from moetrace.timing import HISTOGRAM_EDGES, bucket_quantile
from moetrace.trace.integrity import reseal, unsealed
from moetrace.trace.merge import merge_traces
from moetrace.trace.reader import open_trace
from tests.analysis.helpers import files_written_here

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2, dense_layers=(1,))


def _config(tmp_path, **fields) -> RecorderConfig:
    base = {"num_layers": 2, "num_physical_experts": 4, "top_k": 2, "timing": True, "output_dir": tmp_path}
    base.update(fields)
    return RecorderConfig(**base)


def _sleepy_pass(recorder, expert_s: float = 0.002, spans: list | None = None) -> None:
    """One pass of 2 layers; ``spans`` gets ``(layer, inner, outer)`` seconds of each expert phase:
    the sleep alone, and the whole ``with_phase`` block around it (an independent bracket)."""
    with recorder.with_forward_pass():
        for layer in range(2):
            with recorder.with_current_layer(layer):
                with recorder.with_phase("route"):
                    recorder.on_select_experts(torch.tensor([[0, 1], [2, 3]]))
                outer = time.perf_counter()
                with recorder.with_phase("expert"):
                    inner = time.perf_counter()
                    time.sleep(expert_s)
                    inner = time.perf_counter() - inner
                if spans is not None:
                    spans.append((layer, inner, time.perf_counter() - outer))


def test_timing_hooks_pass_the_no_host_sync_check():
    model = ReferenceMoEModel(MODEL, ep=EPSpec(1, 0, "padded", max_tokens=64))
    recorder = ExpertDistributionRecorder(model.recorder_config(timing=True))
    recorder.start_record()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), assert_no_host_sync():
        model(ids, recorder=recorder)  # hooks, phase scopes and the pass end
        model(ids, recorder=recorder)
    timing = recorder.snapshot().timing
    assert timing is not None and timing["step_count"] == 2
    assert (timing["phase_count"] == 2).all()


def test_with_phase_is_a_shared_null_context_when_off(tmp_path):
    off = ExpertDistributionRecorder(_config(tmp_path, timing=False))
    off.start_record()
    on = ExpertDistributionRecorder(_config(tmp_path))
    with off.with_forward_pass(), off.with_current_layer(0):
        assert off.with_phase("expert") is off.with_phase("route")
    with on.with_forward_pass(), on.with_current_layer(0):  # not recording: nothing timed
        assert on.with_phase("expert") is off.with_phase("route")
    on.start_record()
    with on.with_forward_pass(), on.with_current_layer(0), on.disable_this_region():
        assert on.with_phase("expert") is off.with_phase("route")
    assert moetrace.NoOpRecorder().with_phase("expert") is off.with_phase("route")


def test_with_phase_errors_say_what_to_do(tmp_path):
    recorder = ExpertDistributionRecorder(_config(tmp_path))
    recorder.start_record()
    with pytest.raises(ValueError, match=r"unknown phase 'gate'.*route"):
        recorder.with_phase("gate")
    with recorder.with_forward_pass():
        with pytest.raises(RecorderStateError, match="with_current_layer"):
            recorder.with_phase("expert")
    with pytest.raises(ValueError, match="timing must be True or False"):
        _config(tmp_path, timing="yes")


def test_stat_aggregates_and_percentiles(tmp_path):
    recorder = ExpertDistributionRecorder(_config(tmp_path))
    recorder.start_record()
    spans: list = []
    for _ in range(6):
        _sleepy_pass(recorder, 0.004, spans)
    timing = recorder.snapshot().timing
    assert timing["step_count"] == 6
    assert (timing["phase_count"][:, [0, 2]] == 6).all() and (timing["phase_count"][:, [1, 3]] == 0).all()
    expert = timing["phase_seconds_sum"][:, 2]
    inner = np.array([sum(i for la, i, _ in spans if la == layer) for layer in range(2)])
    outer = np.array([sum(o for la, _, o in spans if la == layer) for layer in range(2)])
    # the phase lies between the sleep it encloses and the block around it: exact, however loaded the machine
    assert (expert >= inner).all() and (expert <= outer).all() and (inner >= 6 * 0.004).all()
    assert timing["phase_histogram"].sum() == 6 * 2 * 2
    p50 = bucket_quantile(timing["phase_histogram"][:, 2], 0.5)
    longest = np.array([max(o for la, _, o in spans if la == layer) for layer in range(2)])
    assert ((p50 > 0.9 * 0.004) & (p50 <= 1.1 * longest)).all()  # buckets: P50 within 8%
    assert np.isnan(timing["peak_memory_bytes"])  # CPU: no device memory figure
    path = recorder.dump_record(tmp_path / "stat.h5")
    with open_trace(path) as trace:
        assert trace.attrs["schema_version"] == 2 and trace.has_timing
        assert trace.attrs["timing_clock"] == "perf_counter"
        stat = trace.timing_stat()
        rows = trace.timing_rows()
    np.testing.assert_allclose(stat["phase_seconds_sum"][0], timing["phase_seconds_sum"])
    np.testing.assert_array_equal(stat["histogram_edges"], HISTOGRAM_EDGES)
    assert rows["phase"].shape == (6, 2, len(PHASES)) and list(rows["pass_id"]) == list(range(6))
    assert (rows["rank"] == 0).all()
    # Not-entered phases: duration 0, start NaN; entered ones start after the pass start, in order (strictly where a
    # sleep lies between: nothing else makes a clock advance).
    assert np.isnan(rows["phase_start"][:, :, 1]).all() and (rows["phase"][:, :, 1] == 0).all()
    assert (rows["phase_start"][:, :, 0] <= rows["phase_start"][:, :, 2]).all()
    assert (rows["phase_start"][:, 0, 2] < rows["phase_start"][:, 1, 0]).all()
    assert (rows["step"] >= rows["layer"].sum(axis=1)).all()


def test_bucket_quantile_matches_numpy_within_a_bucket():
    rng = np.random.default_rng(0)
    values = rng.lognormal(np.log(3e-3), 0.5, size=5000)
    hist = np.bincount(np.searchsorted(HISTOGRAM_EDGES, values, side="right"), minlength=len(HISTOGRAM_EDGES) + 1)
    for q in (0.5, 0.95, 0.99):
        exact = np.quantile(values, q)
        assert abs(bucket_quantile(hist, q) / exact - 1) < 0.16
    assert np.isnan(bucket_quantile(np.zeros(len(HISTOGRAM_EDGES) + 1), 0.5))


def test_reset_clears_timing(tmp_path):
    recorder = ExpertDistributionRecorder(_config(tmp_path))
    recorder.start_record()
    _sleepy_pass(recorder, 0.0)
    recorder.reset()
    assert recorder.snapshot().timing["step_count"] == 0
    _sleepy_pass(recorder, 0.0)
    with open_trace(recorder.dump_record(tmp_path / "after-reset.h5")) as trace:
        assert len(trace.timing_rows()["pass_id"]) == 1


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_streaming_modes_write_timing_rows_and_merge_joins_them(tmp_path, mode):
    paths = []
    for rank in range(2):
        cfg = _config(tmp_path, mode=mode, ep_size=2, ep_rank=rank, stream_chunk_passes=3, max_tokens_per_pass=8, stream_chunk_tokens=64)
        recorder = ExpertDistributionRecorder(cfg)
        recorder.start_record()
        for _ in range(7):
            _sleepy_pass(recorder, 0.0)
        first = recorder.dump_record(tmp_path / f"{mode}-{rank}-a.h5")
        _sleepy_pass(recorder, 0.0)
        second = recorder.dump_record(tmp_path / f"{mode}-{rank}-b.h5")
        with open_trace(first) as a, open_trace(second) as b:
            assert list(a.timing_rows()["pass_id"]) == list(range(7))
            assert list(b.timing_rows()["pass_id"]) == [7]  # a streaming dump holds the passes since the previous one
            assert a.timing_stat()["step_count"][0] == 7 and b.timing_stat()["step_count"][0] == 1
        with h5py.File(first, "r+") as f:  # per-rank files of one run, as EP ranks would write them
            f.attrs["rank"], f.attrs["world_size"], f.attrs["run_id"] = rank, 2, "shared-run"
        reseal(first)  # edited on purpose: its checksums are recomputed
        with open_trace(first) as trace:  # a per-rank file analyses and draws as that rank
            assert analyze_timing(trace)["rank_labels"] == [rank]
            assert {e["pid"] for e in build_timeline(trace)["traceEvents"]} == {rank}
        paths.append(first)
    merged = merge_traces(paths, tmp_path / f"{mode}-merged.h5")
    with open_trace(merged) as trace:
        rows = trace.timing_rows()
        assert trace.has_timing and trace.timing_stat()["phase_seconds_sum"].shape == (2, 2, len(PHASES))
    assert list(rows["pass_id"]) == sorted(list(range(7)) * 2) and list(rows["rank"][:2]) == [0, 1]


def test_version_1_traces_stay_readable(tmp_path):
    with files_written_here():  # unsealed() reaches this process only
        recorder = ExpertDistributionRecorder(_config(tmp_path, timing=False))
        recorder.start_record()
    _sleepy_pass(recorder, 0.0)
    with unsealed():  # version 1 traces predate checksums too
        path = recorder.dump_record(tmp_path / "v1.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 1
    report = analyze_trace(path)
    assert report.timing is None and report.to_dict()["timing"] is None
    with open_trace(path) as trace, pytest.raises(Exception, match="no phase timing"):
        trace.timing_rows()


def test_without_an_expert_phase_stragglers_are_not_judged(tmp_path):
    recorder = ExpertDistributionRecorder(_config(tmp_path))
    recorder.start_record()
    for _ in range(2):
        with recorder.with_forward_pass(), recorder.with_current_layer(0), recorder.with_phase("route"):
            pass
    with open_trace(recorder.dump_record(tmp_path / "route-only.h5")) as trace:
        report = analyze_timing(trace)
    assert report["expert_timed"] is False and "slowest_rank_share" not in report
    assert [row["phase"] for row in report["phase_table"]] == ["route"]


def test_a_refused_timed_pass_leaves_the_recorder_usable(tmp_path, monkeypatch):
    """Timing refuses inside CUDA-graph capture (``TimingCaptureError``); the pass ends cleanly all the same."""
    from moetrace.timing import TimingCaptureError

    recorder = ExpertDistributionRecorder(_config(tmp_path))
    recorder.start_record()

    def refuse(recorded: bool, device: object) -> None:
        raise TimingCaptureError("phase timing cannot run inside CUDA-graph capture")

    monkeypatch.setattr(recorder._timing, "begin_pass", refuse)
    with pytest.raises(TimingCaptureError), recorder.with_forward_pass():
        pass
    monkeypatch.undo()
    _sleepy_pass(recorder, 0.0)  # not "already active"
    assert recorder.snapshot().timing["step_count"] == 1
