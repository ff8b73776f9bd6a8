"""Recorded counts equal a plain numpy computation, in every mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import open_trace
from tests.recorder.helpers import numpy_counts, olmoe_token_stream, random_passes, replay

MODES = ["stat", "per_pass", "per_token"]


def make(tmp_path, mode: str, **kw) -> ExpertDistributionRecorder:
    fields = {"num_layers": 3, "num_physical_experts": 16, "top_k": 4, "mode": mode, "output_dir": tmp_path, "window": 8, "stream_chunk_passes": 5, "stream_chunk_tokens": 40, "max_tokens_per_pass": 16}
    fields.update(kw)
    return ExpertDistributionRecorder(RecorderConfig(**fields))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_random_routing_matches_numpy(tmp_path, mode, dtype):
    rng = np.random.default_rng(1)
    passes = random_passes(rng, num_passes=23, num_layers=3, num_experts=16, top_k=4)
    expected, invalid = numpy_counts(passes, 16)
    rec = make(tmp_path, mode)
    rec.start_record()
    replay(rec, passes, dtype)
    rec.stop_record()
    snap = rec.snapshot()
    np.testing.assert_array_equal(snap.physical_count, expected)
    np.testing.assert_array_equal(snap.invalid_ids, invalid)
    assert snap.num_passes == 23
    assert snap.num_tokens == sum(p[0].shape[0] for p in passes)
    with open_trace(rec.dump_record(tmp_path / f"{mode}.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), expected)
        np.testing.assert_array_equal(trace.invalid_ids()[0], invalid)
        assert trace.mode == mode and trace.num_passes()[0] == 23
        if mode == "per_pass":
            rows = list(trace.iter_passes(chunk=7))
            per_pass = np.concatenate([c.physical_count for c in rows])
            assert per_pass.shape == (23, 3, 16)
            np.testing.assert_array_equal(per_pass.sum(axis=0), expected)
            np.testing.assert_array_equal(np.concatenate([c.pass_id for c in rows]), np.arange(23))
            for i, layers in enumerate(passes):
                np.testing.assert_array_equal(per_pass[i], numpy_counts([layers], 16)[0])
        if mode == "per_token":
            chunks = list(trace.iter_tokens(chunk=11))
            ids = np.concatenate([c.topk_ids for c in chunks])
            pass_id = np.concatenate([c.pass_id for c in chunks])
            position = np.concatenate([c.position for c in chunks])
            want = np.concatenate([np.stack(layers, axis=1) for layers in passes])  # [M, L, k]
            want = np.where((want >= 0) & (want < 16) | (want == -1), want, -2)
            np.testing.assert_array_equal(ids, want)
            np.testing.assert_array_equal(pass_id, np.concatenate([np.full(len(p[0]), i) for i, p in enumerate(passes)]))
            np.testing.assert_array_equal(position, np.concatenate([np.arange(len(p[0])) for p in passes]))


@pytest.mark.parametrize("domain", ["arxiv", "github"])
def test_real_olmoe_counts_replayed(tmp_path, domain):
    expected, passes = olmoe_token_stream(domain, tokens_per_pass=512, scale=100)
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=3, num_physical_experts=64, top_k=8, output_dir=tmp_path, layer_ids=(0, 7, 15), ep_size=4))
    rec.start_record()
    replay(rec, list(passes))
    rec.stop_record()
    snap = rec.snapshot()
    np.testing.assert_array_equal(snap.physical_count, expected)
    np.testing.assert_array_equal(snap.rank_load, expected.reshape(3, 4, 16).sum(axis=2))
    with open_trace(rec.dump_record()) as trace:
        np.testing.assert_array_equal(trace.physical_count(), expected)
        np.testing.assert_array_equal(trace.layers, [0, 7, 15])


def test_logical_map_folds_replicas(tmp_path):
    # 6 physical slots, 4 logical experts: slots 4 and 5 replicate experts 0 and 3.
    mapping = np.array([[0, 1, 2, 3, 0, 3]] * 2)
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=6, top_k=2, physical_to_logical=mapping, output_dir=tmp_path))
    rec.start_record()
    passes = random_passes(np.random.default_rng(3), 10, 2, 6, 2, bad=False)
    replay(rec, passes)
    physical, _ = numpy_counts(passes, 6)
    logical = np.stack([np.bincount(mapping[layer], weights=physical[layer], minlength=4) for layer in range(2)]).astype(np.int64)
    snap = rec.snapshot()
    assert rec.id_space == "physical"
    np.testing.assert_array_equal(snap.logical_count, logical)
    with open_trace(rec.dump_record()) as trace:
        assert trace.id_space == "physical" and trace.num_logical_experts == 4
        np.testing.assert_array_equal(trace.logical_count(), logical)
        np.testing.assert_array_equal(trace.physical_to_logical, mapping)


def test_dispatch_counts_and_dropped(tmp_path):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=4, top_k=1, ep_size=2, output_dir=tmp_path, hidden_size=8, dtype_bytes=4))
    rec.start_record()
    for _ in range(3):
        with rec.with_forward_pass():
            for layer in range(2):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.tensor([[0], [1], [2]]))
                    rec.on_dispatch(torch.tensor([2, 1]), torch.tensor([1, 3]), dropped=torch.tensor(1))
    snap = rec.snapshot()
    np.testing.assert_array_equal(snap.send_count, [[6, 3], [6, 3]])
    np.testing.assert_array_equal(snap.recv_count, [[3, 9], [3, 9]])
    np.testing.assert_array_equal(snap.dropped, [3, 3])
    # 9 copies per layer; rank 0 sent 3 copies to rank 1: 2 * 3 * 8 * 4 bytes.
    np.testing.assert_array_equal(snap.alltoall_bytes_actual, [192, 192])
    np.testing.assert_array_equal(snap.alltoall_bytes_ideal, [2 * 9 * 8 * 4] * 2)
    with open_trace(rec.dump_record()) as trace:
        np.testing.assert_array_equal(trace.send_count()[0], snap.send_count)
        np.testing.assert_array_equal(trace.dropped_tokens()[0], [3, 3])


def test_disable_region_and_not_recording_count_nothing(tmp_path):
    rec = make(tmp_path, "stat")
    ids = torch.tensor([[0, 1, 2, 3]])
    with rec.with_forward_pass(), rec.with_current_layer(0):
        rec.on_select_experts(ids)  # not recording yet
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(0):
        with rec.disable_this_region():
            rec.on_select_experts(ids)
        rec.on_select_experts(ids, layer=2)
    snap = rec.snapshot()
    assert snap.physical_count[0].sum() == 0
    np.testing.assert_array_equal(snap.physical_count[2, :4], [1, 1, 1, 1])


def test_exception_in_forward_discards_partial_pass(tmp_path):
    rec = make(tmp_path, "per_token")
    rec.start_record()
    with pytest.raises(RuntimeError, match="boom"), rec.with_forward_pass(), rec.with_current_layer(0):
        rec.on_select_experts(torch.tensor([[0, 1, 2, 3]]))
        raise RuntimeError("boom")
    replay(rec, [[np.array([[4, 5, 6, 7]])] * 3])
    snap = rec.snapshot()
    assert snap.num_passes == 1 and snap.physical_count[0, :4].sum() == 0
    with open_trace(rec.dump_record()) as trace:
        ids = next(trace.iter_tokens()).topk_ids
        np.testing.assert_array_equal(ids, [[[4, 5, 6, 7]] * 3])


def test_per_token_layers_not_reached_read_minus_one(tmp_path):
    rec = make(tmp_path, "per_token")
    rec.start_record()
    with rec.with_forward_pass():  # every layer, 5 tokens
        for layer in range(3):
            rec.on_select_experts(torch.full((5, 4), layer + 1), layer=layer)
    with rec.with_forward_pass():  # layer 0 sees 4 tokens, layer 1 only 2, layer 2 none
        rec.on_select_experts(torch.full((4, 4), 7), layer=0)
        rec.on_select_experts(torch.full((2, 4), 8), layer=1)
    with open_trace(rec.dump_record()) as trace:
        ids = next(trace.iter_tokens()).topk_ids
    assert ids.shape == (9, 3, 4)
    np.testing.assert_array_equal(ids[:5, :, 0], [[1, 2, 3]] * 5)
    np.testing.assert_array_equal(ids[5:, :, 0], [[7, 8, -1], [7, 8, -1], [7, -1, -1], [7, -1, -1]])
