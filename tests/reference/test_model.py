"""ReferenceMoEModel: dense == EP on one rank, layer numbering with gaps, recorder evidence, timing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel, zipf_bias
from moetrace.testing import assert_no_host_sync

from ..phase_ticks import TICK_S, counting_clock

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5, num_experts=8, top_k=2,
                     dense_layers=(0, 3), router_bias=tuple(zipf_bias(8, 1.0).tolist()), seed=7)


def _ids(b: int = 3, s: int = 11) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))


def test_layer_numbering_has_gaps():
    model = ReferenceMoEModel(CONFIG)
    assert model.moe_layer_ids == (1, 2, 4)
    assert [layer.layer_id for layer in model.moe_layers] == [1, 2, 4]
    assert [layer.moe_index for layer in model.moe_layers] == [0, 1, 2]
    assert model.recorder_config().layer_ids == (1, 2, 4)
    with pytest.raises(ValueError, match="every layer is dense"):
        ModelConfig(num_layers=2, dense_layers=(0, 1))
    with pytest.raises(ValueError, match="top_k=3 exceeds num_experts=2"):
        ModelConfig(num_experts=2, top_k=3)


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_dense_and_single_rank_ep_models_agree(mode):
    dense = ReferenceMoEModel(CONFIG)
    ep = ReferenceMoEModel(CONFIG, ep=EPSpec(1, 0, mode, max_tokens=64))
    with torch.inference_mode():
        diff = (dense(_ids()) - ep(_ids())).abs().max().item()
    assert diff <= 1e-5


def test_recorder_sees_every_moe_layer_and_matches_layouts():
    model = ReferenceMoEModel(CONFIG, ep=EPSpec(1, 0, "exact"))
    recorder = ExpertDistributionRecorder(model.recorder_config())
    recorder.start_record()
    expert, send = np.zeros((3, 8), np.int64), np.zeros((3, 1), np.int64)
    with torch.inference_mode():
        for pass_id in (10, 11):
            model(_ids(), recorder=recorder, forward_pass_id=pass_id)
            for i, layer in enumerate(model.moe_layers):
                expert[i] += layer.last_layout.expert_counts.numpy()
                send[i] += layer.last_layout.send_counts.numpy()
    snap = recorder.snapshot()
    assert snap.num_passes == 2
    np.testing.assert_array_equal(snap.physical_count, expert)
    np.testing.assert_array_equal(snap.send_count, send)
    np.testing.assert_array_equal(snap.recv_count, send)
    assert snap.physical_count.sum() == 2 * 3 * 33 * 2  # passes x MoE layers x tokens x k


def test_global_recorder_is_looked_up_at_forward_time():
    import moetrace

    model = ReferenceMoEModel(CONFIG)
    recorder = ExpertDistributionRecorder(model.recorder_config())
    moetrace.set_recorder(recorder)  # installed after the model was built
    recorder.start_record()
    with torch.inference_mode():
        model(_ids())
    assert recorder.snapshot().physical_count.sum() == 3 * 33 * 2


def test_padded_model_forward_has_no_host_sync():
    model = ReferenceMoEModel(CONFIG, ep=EPSpec(1, 0, "padded", max_tokens=64))
    recorder = ExpertDistributionRecorder(model.recorder_config())
    capturer = RoutedExpertsCapturer(CONFIG.num_layers, CONFIG.top_k, 64, 128)
    recorder.start_record()
    with torch.inference_mode(), assert_no_host_sync():
        model(_ids(), recorder=recorder, capturer=capturer)
    assert recorder.snapshot().num_passes == 1


def test_phase_timing_records_every_phase_when_enabled():
    model = ReferenceMoEModel(CONFIG, ep=EPSpec(1, 0, "exact"))
    untimed = ExpertDistributionRecorder(model.recorder_config())
    with counting_clock():
        timed = ExpertDistributionRecorder(model.recorder_config(timing=True))
    for recorder in (untimed, timed):
        recorder.start_record()
    with torch.inference_mode():
        model(_ids(), recorder=untimed)
        model(_ids(), recorder=timed)
    assert untimed.snapshot().timing is None
    timing = timed.snapshot().timing
    assert timing is not None
    assert (timing["phase_count"] == 1).all()
    # each phase's duration reached the sums: one tick of the counting clock per bracket (tests/phase_ticks.py)
    np.testing.assert_allclose(timing["phase_seconds_sum"], TICK_S)
