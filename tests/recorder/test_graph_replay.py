"""CUDA-graph semantics on CPU: capture once, replay many passes with no Python hook running.

:class:`moetrace.testing.CpuGraph` logs the tensor ops a capture runs and
replays exactly those on the same static buffers, as a CUDA graph replay does.
An engine captures its decode graphs at start-up, before anyone starts
recording, then fills the static inputs (real rows, then -1 padding rows) and
replays. Every mode must give the same results as the numpy oracle of the real
rows, whatever the real token count of each pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.testing import CpuGraph, GraphCaptureError, assert_no_host_sync
from moetrace.timing import TimingCaptureError
from moetrace.trace import open_trace
from tests.recorder.helpers import numpy_counts

LAYERS, EXPERTS, TOP_K, RANKS, BATCH = 3, 8, 2, 2, 6


def make(tmp_path, mode: str, **changes) -> ExpertDistributionRecorder:
    config = dict(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=RANKS, mode=mode, output_dir=tmp_path,
        max_tokens_per_pass=16, window=64, stream_chunk_passes=5, stream_chunk_tokens=20, segment_seconds=0,
    )
    config.update(changes)
    return ExpertDistributionRecorder(RecorderConfig(**config))


class Engine:
    """A toy MoE step over static buffers: ids ``[L, B, k]`` in, hooks per layer (send counts computed on the device)."""

    def __init__(self, recorder: ExpertDistributionRecorder, capturer: RoutedExpertsCapturer | None = None) -> None:
        self.recorder, self.capturer = recorder, capturer
        self.ids = torch.full((LAYERS, BATCH, TOP_K), -1, dtype=torch.int64)

    def step(self) -> None:
        per_rank = EXPERTS // RANKS
        for layer in range(LAYERS):
            with self.recorder.with_current_layer(layer):
                ids = self.ids[layer]
                self.recorder.on_select_experts(ids)
                valid = (ids >= 0).long().reshape(-1)
                send = torch.zeros(RANKS, dtype=torch.int64).scatter_add_(0, (ids.clamp(min=0) // per_rank).reshape(-1), valid)
                self.recorder.on_dispatch(send)
                if self.capturer is not None:
                    self.capturer.capture(layer, ids)

    def fill(self, real: np.ndarray) -> None:
        """Copy a pass's real rows ``[L, n, k]`` into the static buffer; the other rows are -1 padding."""
        self.ids.fill_(-1)
        self.ids[:, : real.shape[1]] = torch.as_tensor(real)


def real_passes(seed: int = 0, count: int = 40) -> list[np.ndarray]:
    """Passes ``[L, n, k]`` with n in 0..BATCH (some -1 ids inside real rows too)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = [BATCH, 1, 0, 3, 5][i % 5] if i < 10 else int(rng.integers(0, BATCH + 1))
        ids = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(n)]) if n else np.zeros((0, TOP_K), np.int64) for _ in range(LAYERS)])
        if n:
            ids[0, 0, 1] = -1  # a real token with one padding id still counts as a token
        out.append(ids.astype(np.int64))
    return out


def send_oracle(passes: list[np.ndarray]) -> np.ndarray:
    send = np.zeros((LAYERS, RANKS), dtype=np.int64)
    for ids in passes:
        for layer in range(LAYERS):
            valid = ids[layer][ids[layer] >= 0]
            send[layer] += np.bincount(valid // (EXPERTS // RANKS), minlength=RANKS)
    return send


def captured(engine: Engine, within_pass: bool) -> CpuGraph:
    """Capture the step as an engine does at start-up (recording off); vLLM-style inside a pass, SGLang-style outside."""
    graph = CpuGraph()
    engine.fill(np.zeros((LAYERS, BATCH, TOP_K), np.int64))
    with graph.capture():
        if within_pass:
            with engine.recorder.with_forward_pass():
                engine.step()
        else:
            engine.step()
    return graph


def replay_all(engine: Engine, graph: CpuGraph, passes: list[np.ndarray]) -> None:
    for real in passes:
        engine.fill(real)
        with engine.recorder.with_forward_pass(), assert_no_host_sync():
            graph.replay()


def record_replays(tmp_path, mode: str, seed: int, within_pass: bool = False) -> tuple[ExpertDistributionRecorder, list[np.ndarray]]:
    """Capture at start-up (recording off), then start recording and replay ``real_passes(seed)``."""
    rec = make(tmp_path, mode)
    engine = Engine(rec)
    graph = captured(engine, within_pass)
    rec.start_record()
    passes = real_passes(seed)
    replay_all(engine, graph, passes)
    return rec, passes


def column(chunks: list, name: str) -> np.ndarray:
    """One field of a trace's pass or token chunks, concatenated."""
    return np.concatenate([getattr(c, name) for c in chunks])


def oracle(passes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts, invalid = numpy_counts([list(p) for p in passes], EXPERTS)
    return counts, invalid, np.array([p.shape[1] for p in passes])


@pytest.mark.parametrize("within_pass", [False, True])
def test_stat_mode_under_replay_is_exact(tmp_path, within_pass):
    rec, passes = record_replays(tmp_path, "stat", seed=0, within_pass=within_pass)
    counts, _, tokens = oracle(passes)
    snap = rec.snapshot()
    assert snap.num_passes == len(passes) and snap.num_tokens == tokens.sum()
    np.testing.assert_array_equal(snap.physical_count, counts)
    np.testing.assert_array_equal(snap.send_count, send_oracle(passes))
    assert rec.status()["tokens"] == tokens.sum()
    with open_trace(rec.dump_record(tmp_path / "stat.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), counts)
        assert int(trace.num_tokens().sum()) == tokens.sum()
        window = trace.window()
        np.testing.assert_array_equal(window.num_tokens[0], tokens)
        expected = np.stack([numpy_counts([list(p)], EXPERTS)[0] for p in passes])
        np.testing.assert_array_equal(window.physical_count[0], expected)


def test_per_pass_mode_under_replay_is_exact(tmp_path):
    rec, passes = record_replays(tmp_path, "per_pass", seed=1)
    with open_trace(rec.dump_record(tmp_path / "pp.h5")) as trace:
        rows = list(trace.iter_passes())
        np.testing.assert_array_equal(column(rows, "num_tokens"), oracle(passes)[2])
        np.testing.assert_array_equal(column(rows, "physical_count"), np.stack([numpy_counts([list(p)], EXPERTS)[0] for p in passes]))
        np.testing.assert_array_equal(column(rows, "send_count").sum(axis=0), send_oracle(passes))
        assert int(trace.num_tokens().sum()) == oracle(passes)[2].sum()


def test_per_token_mode_under_replay_streams_every_real_token(tmp_path):
    rec, passes = record_replays(tmp_path, "per_token", seed=2)
    with open_trace(rec.dump_record(tmp_path / "pt.h5")) as trace:
        chunks = list(trace.iter_tokens())
        expected = np.concatenate([p.transpose(1, 0, 2) for p in passes])
        np.testing.assert_array_equal(column(chunks, "topk_ids"), expected)
        np.testing.assert_array_equal(column(chunks, "pass_id"), np.concatenate([np.full(p.shape[1], i) for i, p in enumerate(passes)]))
        np.testing.assert_array_equal(column(chunks, "position"), np.concatenate([np.arange(p.shape[1]) for p in passes]))
        np.testing.assert_array_equal(trace.physical_count(), oracle(passes)[0])
        assert int(trace.num_tokens().sum()) == len(expected)
        assert int(trace.num_passes().sum()) == len(passes)


def test_gate_switches_captured_ops_off_and_on_without_recapture(tmp_path):
    rec = make(tmp_path, "stat")
    engine = Engine(rec)
    graph = captured(engine, within_pass=False)
    first, off, second = real_passes(seed=3, count=12), real_passes(seed=4, count=7), real_passes(seed=5, count=9)
    replay_all(engine, graph, off)  # before any recording: counts nothing
    rec.start_record()
    replay_all(engine, graph, first)
    rec.stop_record()
    replay_all(engine, graph, off)  # stopped: counts nothing, leaks nothing into the next recording
    with open_trace(rec.dump_record(tmp_path / "a.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), oracle(first)[0])
        assert int(trace.num_tokens().sum()) == oracle(first)[2].sum()
    rec.start_record()
    replay_all(engine, graph, second)
    with open_trace(rec.dump_record(tmp_path / "b.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), oracle(second)[0])
        np.testing.assert_array_equal(trace.send_count(), send_oracle(second)[None])
        assert int(trace.num_tokens().sum()) == oracle(second)[2].sum()


def test_capturer_under_replay_returns_each_request_rows(tmp_path):
    rec = make(tmp_path, "stat")
    capturer = RoutedExpertsCapturer(LAYERS, TOP_K, 16, num_kv_slots=400)
    engine = Engine(rec, capturer)
    graph = captured(engine, within_pass=False)
    capturer.on_forward_end(torch.arange(BATCH))  # the capture pass's rows (real engines reset slots after warm-up)
    passes = real_passes(seed=6)
    slot, table, expected = 0, torch.zeros((len(passes), BATCH), dtype=torch.int64), []
    rec.start_record()
    for i, real in enumerate(passes):
        engine.fill(real)
        n = real.shape[1]
        table[i, :n] = torch.arange(slot, slot + n)
        with rec.with_forward_pass():
            graph.replay()
        capturer.on_forward_end(table[i, :n])
        slot += n
        expected.append(real.transpose(1, 0, 2))
    for i, real in enumerate(passes):
        np.testing.assert_array_equal(capturer.get_routed_experts(table, i, real.shape[1]), expected[i])


@pytest.mark.parametrize("recording", [False, True])
def test_timing_refuses_capture_recording_or_not(tmp_path, recording):
    rec = make(tmp_path, "stat", timing=True)
    if recording:
        rec.start_record()
    engine = Engine(rec)
    with pytest.raises(TimingCaptureError, match="timing=False"), CpuGraph().capture():
        with rec.with_forward_pass():
            engine.step()


def test_capture_refuses_host_reads():
    graph = CpuGraph()
    x = torch.zeros(3)
    with pytest.raises(GraphCaptureError, match="item"), graph.capture():
        x.add_(1).sum().item()
    assert x.sum() == 0  # a capture runs nothing: what it wrote is put back
