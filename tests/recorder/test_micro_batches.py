"""A layer given in several calls per pass: the micro-batches of two-batch overlap.

SGLang's two-batch overlap (TBO) splits a pass's tokens into two micro-batches and runs
each MoE layer's ``select_experts`` once per micro-batch, inside the same
``with_current_layer`` (``models/deepseek_v2.py``: ``op_select_experts`` with a
``tbo_subbatch_index``), so the recorder sees two ``on_select_experts`` calls for one layer
in one pass, staggered across layers (micro-batch 0 runs a stage ahead). SGLang's own
``per_token`` gatherer refuses TBO ("DetailSinglePassGatherer does not support TBO yet");
moetrace's must keep both micro-batches: each call's rows follow the layer's earlier rows,
so a token's position in the pass is its row in the whole batch, and the request rows of
the engine's :class:`~moetrace.batch.PassBatch` (built for the whole batch) still apply.

The same holds under CUDA-graph capture: the capture bakes each call's row offset into the
graph, so offsets start over at each capture (engines warm each graph up eagerly first).
TBO needs DeepEP and a GPU, so SGLang cannot run it here; these tests drive the recorder
as its hooks would be driven and compare with the ids fed (the numpy oracle).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.batch import PassBatch
from moetrace.recording.pass_counter import PassCounter
from moetrace.testing import CpuGraph, assert_no_host_sync
from moetrace.trace import open_trace
from tests.recorder.helpers import numpy_counts

LAYERS, EXPERTS, TOP_K, MAX_TOKENS = 4, 16, 2, 24


def make(tmp_path, mode: str) -> ExpertDistributionRecorder:
    return ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path,
        max_tokens_per_pass=MAX_TOKENS, window=64, stream_chunk_passes=4, stream_chunk_tokens=40, segment_seconds=0,
    ))


def routed(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """``[L, T, k]`` distinct ids per token, a few -1 ids and one out-of-range id."""
    ids = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]) for _ in range(LAYERS)])
    if tokens:
        ids[1, 0, 1] = -1
        ids[2, tokens - 1, 0] = EXPERTS + 3
    return ids.astype(np.int64)


def tbo_order(split: int) -> list[tuple[int, int]]:
    """``(layer, micro_batch)`` in the staggered order TBO runs them: micro-batch 1 one layer behind."""
    order = []
    for layer in range(LAYERS + 1):
        if layer < LAYERS:
            order.append((layer, 0))
        if layer > 0:
            order.append((layer - 1, 1))
    return order if split else [(layer, 0) for layer in range(LAYERS)]


def run_tbo(recorder: ExpertDistributionRecorder, ids: np.ndarray | torch.Tensor, split: int) -> None:
    """One pass's layers as two micro-batches ``[:split]`` and ``[split:]`` (``split`` 0: one batch)."""
    for layer, micro in tbo_order(split):
        rows = ids[layer, :split] if micro == 0 and split else ids[layer, split:] if micro else ids[layer]
        with recorder.with_current_layer(layer):
            recorder.on_select_experts(torch.as_tensor(rows))


def schedule(seed: int, count: int = 14) -> list[tuple[np.ndarray, int]]:
    """Passes ``(ids [L, T, k], split)``: split passes, a whole one, an empty micro-batch, a decode of one token."""
    rng = np.random.default_rng(seed)
    passes = []
    for i in range(count):
        tokens = [9, 1, 6, 24][i] if i < 4 else int(rng.integers(2, MAX_TOKENS + 1))
        split = [4, 0, 6, 11][i] if i < 4 else int(rng.integers(1, tokens))
        passes.append((routed(rng, tokens), split))
    return passes


def token_rows(path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    with open_trace(path) as trace:
        chunks = list(trace.iter_tokens())
        return (np.concatenate([c.topk_ids for c in chunks]), np.concatenate([c.pass_id for c in chunks]),
                np.concatenate([c.position for c in chunks]), np.concatenate([c.request for c in chunks]),
                np.concatenate([c.request_position for c in chunks]))


def expected_ids(passes: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """Every token's ``[L, k]`` as the trace stores it (out-of-range ids as -2), in pass order."""
    ids = np.concatenate([p.transpose(1, 0, 2) for p, _ in passes])
    return np.where((ids >= EXPERTS) | (ids < -1), -2, ids)


def recorded_micro_batches(tmp_path, mode: str, count: int = 14) -> tuple[ExpertDistributionRecorder, list[tuple[np.ndarray, int]]]:
    """A recording of ``count`` passes of :func:`schedule` run as micro-batches, and the passes."""
    rec = make(tmp_path, mode)
    rec.start_record()
    passes = schedule(seed=1, count=count)
    for ids, split in passes:
        with rec.with_forward_pass():
            run_tbo(rec, ids, split)
    return rec, passes


def assert_every_token_counted_once(tmp_path, rec: ExpertDistributionRecorder, passes: list[tuple[np.ndarray, int]], mode: str) -> None:
    """The dumped counts, invalid ids, tokens (and ``per_token`` rows) equal the numpy oracle's."""
    counts, invalid = numpy_counts([list(p) for p, _ in passes], EXPERTS)
    tokens = sum(p.shape[1] for p, _ in passes)
    with open_trace(rec.dump_record(tmp_path / f"{mode}.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), counts)
        np.testing.assert_array_equal(trace.invalid_ids()[0], invalid)
        assert int(trace.num_tokens().sum()) == tokens
        if mode == "per_token":
            ids, pass_id, position, _, _ = token_rows(trace.path)
            np.testing.assert_array_equal(ids, expected_ids(passes))
            np.testing.assert_array_equal(pass_id, np.concatenate([np.full(p.shape[1], i) for i, (p, _) in enumerate(passes)]))
            np.testing.assert_array_equal(position, np.concatenate([np.arange(p.shape[1]) for p, _ in passes]))


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_micro_batches_count_every_token_once(tmp_path, mode):
    rec, passes = recorded_micro_batches(tmp_path, mode)
    assert_every_token_counted_once(tmp_path, rec, passes, mode)


def test_micro_batch_rows_keep_their_requests(tmp_path):
    """The batch names the whole pass's rows; the second micro-batch's rows land after the first's."""
    rec = make(tmp_path, "per_token")
    rec.start_record()
    rng = np.random.default_rng(5)
    expected_request, expected_position = [], []
    for step in range(6):
        count = np.array([5, 1, 3, 2]) if step % 2 == 0 else np.array([1, 1, 1, 1])
        start = np.array([0, 7 + step, 2, 11 + step])
        batch = PassBatch.of([f"r{j}" for j in range(4)], start, count, prefill=count > 1)
        ids = routed(rng, int(count.sum()))
        with rec.with_forward_pass(batch=batch):
            run_tbo(rec, ids, split=int(count[:2].sum()))
        expected_request.append(np.repeat(np.arange(4), count))
        expected_position.append(np.concatenate([np.arange(s, s + c) for s, c in zip(start, count, strict=True)]))
    _, _, _, request, request_position = token_rows(rec.dump_record(tmp_path / "rows.h5"))
    with open_trace(tmp_path / "rows.h5") as trace:
        names = [str(name) for name in trace.request_table()]
    np.testing.assert_array_equal(np.array(names)[request], np.array([f"r{j}" for j in np.concatenate(expected_request)]))
    np.testing.assert_array_equal(request_position, np.concatenate(expected_position))


def test_micro_batches_over_max_tokens_are_refused_and_count_nothing(tmp_path):
    rec = make(tmp_path, "per_token")
    rec.start_record()
    ids = torch.as_tensor(routed(np.random.default_rng(2), 16))
    with rec.with_forward_pass():
        with rec.with_current_layer(0):
            rec.on_select_experts(ids[0])
            with pytest.raises(ValueError, match=r"pass of 32 tokens after 16 rows already given for layer 0 .*max_tokens_per_pass=24"):
                rec.on_select_experts(ids[0])
    with open_trace(rec.dump_record(tmp_path / "refused.h5")) as trace:
        assert int(trace.physical_count()[0].sum()) == int((ids[0] >= 0).sum())  # only the accepted call counted
        assert int(trace.num_tokens().sum()) == 16


def test_micro_batches_under_graph_capture_and_replay(tmp_path):
    """Two graphs (two batch sizes) captured outside a pass, each after an eager warm-up as SGLang does:
    each capture's micro-batch offsets start at row 0; replays write every token at its row."""
    rec = make(tmp_path, "per_token")
    graphs = {}
    for size, split in ((12, 5), (20, 8)):
        static = torch.full((LAYERS, size, TOP_K), -1, dtype=torch.int64)
        run_tbo(rec, static, split)  # eager warm-up (not recording: the hooks do nothing)
        graph = CpuGraph()
        with graph.capture():
            run_tbo(rec, static, split)
        graphs[size] = (graph, static)
    rec.start_record()
    rng = np.random.default_rng(9)
    passes = []
    for i in range(10):
        size = (12, 20)[i % 2]
        ids = routed(rng, int(rng.integers(1, size + 1)))
        graph, static = graphs[size]
        static.fill_(-1)
        static[:, : ids.shape[1]] = torch.as_tensor(ids)
        with rec.with_forward_pass(), assert_no_host_sync():
            graph.replay()
        passes.append((ids, 0))
    ids, _, position, _, _ = token_rows(rec.dump_record(tmp_path / "graphs.h5"))
    np.testing.assert_array_equal(ids, expected_ids(passes))
    np.testing.assert_array_equal(position, np.concatenate([np.arange(p.shape[1]) for p, _ in passes]))


def test_micro_batch_hooks_do_not_sync(tmp_path):
    rec = make(tmp_path, "per_token")
    rec.start_record()
    for ids, split in schedule(seed=4, count=6):
        with rec.with_forward_pass(), assert_no_host_sync():
            run_tbo(rec, torch.as_tensor(ids), split)
    assert rec.num_passes == 6
    with open_trace(rec.dump_record(tmp_path / "synced.h5")) as trace:
        assert int(trace.num_tokens().sum()) == sum(ids.shape[1] for ids, _ in schedule(seed=4, count=6))


@pytest.mark.parametrize("mode", ["stat", "per_token"])
def test_negative_control_overwriting_micro_batches_is_caught(tmp_path, monkeypatch, mode):
    """The defect these tests guard against: each call staging at row 0 drops the first micro-batch
    from the counts and the tokens alike (both are taken from the stage at pass end), which the
    oracle comparison of :func:`test_micro_batches_count_every_token_once` catches."""

    staged_after_earlier_calls = PassCounter.add_select

    def at_row_zero(self, layer, topk_ids):
        self.layer_rows[layer] = 0  # every call stages from row 0, over the layer's earlier rows
        staged_after_earlier_calls(self, layer, topk_ids)

    monkeypatch.setattr(PassCounter, "add_select", at_row_zero)
    rec, passes = recorded_micro_batches(tmp_path, mode, count=4)
    with pytest.raises(AssertionError):
        assert_every_token_counted_once(tmp_path, rec, passes, mode)


def test_negative_control_capture_offsets_that_never_start_over_are_caught(tmp_path, monkeypatch):
    """Without the restart at each capture the second graph's rows land after the first graph's
    (or overflow): the rows then disagree with the ids fed, which the graph test checks."""
    rec = make(tmp_path, "per_token")
    monkeypatch.setattr(PassCounter, "restart_rows", lambda self: None)
    static = torch.full((LAYERS, 12, TOP_K), -1, dtype=torch.int64)
    for _ in range(2):
        graph = CpuGraph()
        with graph.capture():
            run_tbo(rec, static, 5)
    rec.start_record()
    ids = routed(np.random.default_rng(3), 12)
    static.copy_(torch.as_tensor(ids))
    with rec.with_forward_pass():
        graph.replay()
    _, _, position, _, _ = token_rows(rec.dump_record(tmp_path / "shifted.h5"))
    assert not np.array_equal(position, np.arange(12))
