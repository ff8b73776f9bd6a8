"""Injected slowness is found: 2 gloo EP ranks, rank 1's expert compute delayed by a fixed sleep.

One spawn; each rank runs the reference EP model in both exchange modes with
timing on (rank 1 sleeping ``DELAY_S`` in every layer's ``expert`` phase), and
once with timing off on the same inputs. The stat-mode dumps (gathered over
both ranks) are analysed here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder
from moetrace.analysis.timing import analyze_timing
from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel, launch, zipf_bias
from moetrace.trace.reader import open_trace

DELAY_S = 0.02
PASSES = 10
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2,
                    dense_layers=(0,), router_bias=tuple(zipf_bias(8, 1.0, seed=0).tolist()), seed=5)
LAYERS = len(MODEL.moe_layer_ids)


def _worker(rank: int, world: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    inputs = [torch.randint(0, MODEL.vocab_size, (2, 6 + rank), generator=torch.Generator().manual_seed(10 * p + rank)) for p in range(PASSES)]
    counts = {}
    for mode in ("exact", "padded"):
        model = ReferenceMoEModel(MODEL, ep=EPSpec(world, rank, mode, max_tokens=16))
        for timing in (False, True):
            model.set_expert_delay(DELAY_S if (timing and rank == 1) else 0.0)
            recorder = ExpertDistributionRecorder(model.recorder_config(timing=timing, output_dir=out_dir))
            recorder.start_record()
            with torch.inference_mode():
                model(inputs[0], recorder=recorder)  # warm-up pass
                recorder.reset()
                for ids in inputs:
                    model(ids, recorder=recorder)
            recorder.stop_record()
            recorder.dump_record(Path(out_dir) / f"{mode}-{'timed' if timing else 'plain'}.h5")
            snap = recorder.snapshot()
            counts[(mode, timing)] = (snap.physical_count, snap.send_count, snap.recv_count)
    return {"counts": counts}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stragglers")
    results = launch(_worker, 2, str(out), backend="gloo", threads_per_rank=1, timeout=240)
    return out, results


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_injected_slow_rank_is_named_and_its_wait_measured(run, mode):
    out, _ = run
    with open_trace(out / f"{mode}-timed.h5") as trace:
        report = analyze_timing(trace)
    assert report is not None and report["ranks"] == 2 and report["passes"] == PASSES
    # Rank 1 is slowest in expert compute in at least 90% of passes.
    assert report["slowest_rank_share"][1] >= 0.9
    layer_passes = PASSES * LAYERS
    # Wait cost: sum over passes and layers of (max_r - mean_r) expert time = delay / 2 per layer-pass on 2 ranks.
    per_layer_pass = report["wait_seconds"] / layer_passes
    assert 0.7 * DELAY_S / 2 < per_layer_pass < 1.5 * DELAY_S / 2, per_layer_pass
    assert report["wait_share"] > 0
    # Rank 0 idles for about the injected delay in every layer ...
    idle0 = report["expert_wait_seconds_by_rank"][0] / layer_passes
    assert 0.7 * DELAY_S < idle0 < 1.5 * DELAY_S, idle0
    assert report["expert_wait_seconds_by_rank"][1] < 0.1 * report["expert_wait_seconds_by_rank"][0]
    # ... and that wait is absorbed by rank 0's exchange phases (its all-to-all waits for rank 1), not by rank 1's.
    excess0 = report["exchange_excess_seconds_by_rank"][0] / layer_passes
    assert 0.7 * DELAY_S < excess0 < 1.5 * DELAY_S, excess0
    assert report["exchange_excess_seconds_by_rank"][1] == 0.0
    # The reference runtime's combine all-to-all is the first collective after the expert phase: it absorbs the wait.
    combine_gap = (report["combine_seconds_by_rank"][0] - report["combine_seconds_by_rank"][1]) / layer_passes
    assert combine_gap > 0.7 * DELAY_S


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_phases_sum_to_the_layer_time(run, mode):
    out, _ = run
    with open_trace(out / f"{mode}-timed.h5") as trace:
        rows = trace.timing_rows()
        report = analyze_timing(trace)
    for coverage in report["phase_coverage_by_rank"]:
        assert 0.9 <= coverage <= 1.0 + 1e-9, coverage
    # Per layer and pass as well, not only in total.
    phases = rows["phase"].sum(axis=2)  # [N, L]
    assert np.all(phases <= rows["layer"] + 1e-9)
    assert np.all(phases >= 0.9 * rows["layer"])


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_counts_identical_with_timing_on_and_off(run, mode):
    out, results = run
    for rank_result in results:
        plain = rank_result["counts"][(mode, False)]
        timed = rank_result["counts"][(mode, True)]
        for a, b in zip(plain, timed, strict=True):
            np.testing.assert_array_equal(a, b)
    with open_trace(out / f"{mode}-plain.h5") as plain, open_trace(out / f"{mode}-timed.h5") as timed:
        np.testing.assert_array_equal(plain.physical_count(per_rank=True), timed.physical_count(per_rank=True))
        np.testing.assert_array_equal(plain.send_count(), timed.send_count())
        assert not plain.has_timing and timed.has_timing
        assert analyze_timing(plain) is None
