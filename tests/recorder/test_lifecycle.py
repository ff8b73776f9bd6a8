"""Lifecycle misuse, hook argument validation, the stat window order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moetrace
from moetrace import ExpertDistributionRecorder, NoOpRecorder, RecorderConfig, RecorderStateError
from moetrace.trace import open_trace
from tests.recorder.helpers import replay


def make(tmp_path, **kw) -> ExpertDistributionRecorder:
    fields = {"num_layers": 2, "num_physical_experts": 8, "top_k": 2, "output_dir": tmp_path}
    fields.update(kw)
    return ExpertDistributionRecorder(RecorderConfig(**fields))


def one_pass(rec, ids=((0, 1),)) -> None:
    with rec.with_forward_pass(), rec.with_current_layer(0):
        rec.on_select_experts(torch.tensor(ids))


def test_window_is_time_ordered_after_wrap(tmp_path):
    rec = make(tmp_path, window=4)
    rec.start_record()
    for i in range(11):
        with rec.with_forward_pass(forward_pass_id=100 + i), rec.with_current_layer(0):
            rec.on_select_experts(torch.tensor([[i % 8, (i + 1) % 8]] * (i + 1)))
    with open_trace(rec.dump_record()) as trace:
        window = trace.window()
    np.testing.assert_array_equal(window.pass_id[0], [107, 108, 109, 110])
    np.testing.assert_array_equal(window.num_tokens[0], [8, 9, 10, 11])
    assert (np.diff(window.timestamp[0]) >= 0).all()
    for row, i in enumerate(range(7, 11)):
        expected = np.zeros(8, dtype=np.int64)
        expected[i % 8] += i + 1
        expected[(i + 1) % 8] += i + 1
        np.testing.assert_array_equal(window.physical_count[0, row, 0], expected)


def test_window_before_wrap_keeps_only_filled_rows(tmp_path):
    rec = make(tmp_path, window=10)
    rec.start_record()
    for _ in range(3):
        one_pass(rec)
    with open_trace(rec.dump_record()) as trace:
        np.testing.assert_array_equal(trace.window().pass_id, [[0, 1, 2]])


def test_lifecycle_misuse(tmp_path):
    rec = make(tmp_path)
    with pytest.raises(RecorderStateError, match="start_record"):
        rec.dump_record()
    with pytest.raises(RecorderStateError, match="not recording"):
        rec.stop_record()
    rec.start_record()
    with pytest.raises(RecorderStateError, match="already recording"):
        rec.start_record()
    one_pass(rec)
    rec.stop_record()
    first = rec.dump_record(tmp_path / "a.h5")
    second = rec.dump_record(tmp_path / "b")  # suffix added; dumping twice is allowed
    assert second.name == "b.h5"
    for path in (first, second):
        with open_trace(path) as trace:
            assert trace.physical_count()[0, :2].tolist() == [1, 1]
    rec.start_record()  # a fresh recording
    assert rec.snapshot().num_passes == 0


def test_reset_discards_and_keeps_recording(tmp_path):
    rec = make(tmp_path, mode="per_pass", stream_chunk_passes=2)
    rec.start_record()
    for _ in range(5):
        one_pass(rec)
    rec.reset()
    assert rec.recording and rec.snapshot().num_passes == 0
    one_pass(rec)
    with open_trace(rec.dump_record()) as trace:
        assert trace.num_rows("passes/pass_id") == 1


def test_passes_do_not_nest(tmp_path):
    rec = make(tmp_path)
    with rec.with_forward_pass(), pytest.raises(RecorderStateError, match="nest"), rec.with_forward_pass():
        pass


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([[0.0, 1.0]]), "integer tensor"),
        (torch.tensor([0, 1]), "2 dimension"),
        (torch.tensor([[0, 1, 2]]), "top_k=2"),
        ([[0, 1]], "torch.Tensor"),
        (torch.tensor([[0, 1]], device="meta"), "recorder counts on cpu"),
    ],
)
def test_bad_hook_arguments(tmp_path, ids, message):
    rec = make(tmp_path)
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(0), pytest.raises(ValueError, match=message):
        rec.on_select_experts(ids)
    assert rec.snapshot().physical_count.sum() == 0


def test_bad_layers_and_missing_layer(tmp_path):
    rec = make(tmp_path)
    with pytest.raises(ValueError, match="outside"):
        rec.with_current_layer(2)
    rec.start_record()
    with rec.with_forward_pass():
        with pytest.raises(RecorderStateError, match="with_current_layer"):
            rec.on_select_experts(torch.tensor([[0, 1]]))
        with pytest.raises(ValueError, match="outside"):
            rec.on_select_experts(torch.tensor([[0, 1]]), layer=-1)
        with rec.with_current_layer(1), pytest.raises(ValueError, match="ep_size=1"):
            rec.on_dispatch(torch.tensor([1, 2]))


def test_per_token_rejects_oversized_pass(tmp_path):
    rec = make(tmp_path, mode="per_token", max_tokens_per_pass=4, stream_chunk_tokens=8)
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(0), pytest.raises(ValueError, match="max_tokens_per_pass"):
        rec.on_select_experts(torch.zeros((5, 2), dtype=torch.long))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"top_k": 9}, "exceeds"),
        ({"ep_size": 3}, "divisible"),
        ({"ep_rank": 1}, "ep_rank"),
        ({"mode": "fast"}, "mode"),
        ({"physical_to_logical": np.zeros((3, 8), dtype=int)}, "shape"),
        ({"physical_to_logical": -np.ones((2, 8), dtype=int)}, "negative"),
        ({"layer_ids": (3, 1)}, "increasing"),
        ({"max_tokens_per_pass": 100, "stream_chunk_tokens": 10}, "stream_chunk_tokens"),
    ],
)
def test_config_validation(fields, message):
    base = {"num_layers": 2, "num_physical_experts": 8, "top_k": 2}
    base.update(fields)
    with pytest.raises(ValueError, match=message):
        RecorderConfig(**base)


def test_noop_default_and_module_api(tmp_path):
    moetrace.set_recorder(None)
    noop = moetrace.get_recorder()
    assert isinstance(noop, NoOpRecorder)
    with noop.with_forward_pass(), noop.with_current_layer(0):
        noop.on_select_experts(torch.tensor([[0, 1]]))
    with pytest.raises(RecorderStateError, match="configure"):
        moetrace.start_record()
    rec = moetrace.configure(num_layers=1, num_physical_experts=4, top_k=2, output_dir=tmp_path)
    assert moetrace.get_recorder() is rec
    moetrace.start_record()
    replay(rec, [[np.array([[0, 1]])]])
    moetrace.stop_record()
    with open_trace(moetrace.dump_record()) as trace:
        assert trace.physical_count().tolist() == [[1, 1, 0, 0]]


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_streaming_dumps_are_consecutive_self_consistent_segments(tmp_path, mode):
    rec = make(tmp_path, mode=mode, stream_chunk_passes=2, max_tokens_per_pass=4, stream_chunk_tokens=8)
    rec.start_record()
    for _ in range(3):
        one_pass(rec, ((0, 1),))
    first = rec.dump_record(tmp_path / "first.h5")
    for _ in range(2):
        one_pass(rec, ((2, 3), (4, 5)))
    rec.stop_record()
    second = rec.dump_record(tmp_path / "second.h5")
    group = "passes/pass_id" if mode == "per_pass" else "tokens/pass_id"
    with open_trace(first) as a, open_trace(second) as b:
        assert a.num_passes().tolist() == [3] and b.num_passes().tolist() == [2]
        assert a.num_tokens().tolist() == [3] and b.num_tokens().tolist() == [4]
        assert a.physical_count()[0].tolist() == [3, 3, 0, 0, 0, 0, 0, 0]
        assert b.physical_count()[0].tolist() == [0, 0, 2, 2, 2, 2, 0, 0]
        assert a.num_rows(group) == 3 and b.num_rows(group) == (2 if mode == "per_pass" else 4)
    assert rec.snapshot().num_passes == 5  # live totals stay cumulative since start_record


def test_recorder_built_under_inference_mode_works_outside_it(tmp_path):
    with torch.inference_mode():
        rec = make(tmp_path, mode="per_token")
    rec.start_record()
    with torch.inference_mode():
        one_pass(rec)
    one_pass(rec)
    rec.stop_record()
    rec.reset()
    rec.start_record()
    one_pass(rec)
    with open_trace(rec.dump_record()) as trace:
        assert trace.num_rows("tokens/topk_ids") == 1


def test_stat_checkpoint_first_written_under_inference_mode_works_outside_it(tmp_path):
    """The checkpoint's host buffers are made on first use: inside inference_mode they must still be normal tensors."""
    with torch.inference_mode():
        rec = make(tmp_path, mode="stat")
        rec.start_record()
        one_pass(rec)
        rec.stop_record()  # writes the first checkpoint
    rec.start_record()
    one_pass(rec)
    rec.stop_record()  # a checkpoint outside inference_mode into the same buffers
    with open_trace(rec.dump_record()) as trace:
        assert trace.physical_count().sum() == rec.snapshot().physical_count.sum() > 0
