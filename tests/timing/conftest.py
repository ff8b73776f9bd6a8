"""Shared by the timing tests: one 2-rank gloo EP run with rank 1's expert compute delayed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from moetrace import ExpertDistributionRecorder
from moetrace.reference import (
    EPSpec,
    ModelConfig,
    ReferenceMoEModel,
    Request,
    ServingLoop,
    launch,
    zipf_bias,
)

DELAY_S = 0.02
PASSES = 10
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2,
                    dense_layers=(0,), router_bias=tuple(zipf_bias(8, 1.0, seed=0).tolist()), seed=5)
LAYERS = len(MODEL.moe_layer_ids)


def _time_delays(model: ReferenceMoEModel) -> list[float]:
    """Wrap every EP layer's injected sleep with its own ``perf_counter`` readings; returns the list the
    slept seconds go into (one per layer and pass), independent of moetrace's phase clock."""
    slept: list[float] = []
    for layer in model.moe_layers:
        def timed(sleep=layer._delay) -> None:  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            sleep()
            slept.append(time.perf_counter() - start)

        layer._delay = timed  # type: ignore[union-attr]
    return slept


def _worker(rank: int, world: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    inputs = [torch.randint(0, MODEL.vocab_size, (2, 6 + rank), generator=torch.Generator().manual_seed(10 * p + rank)) for p in range(PASSES)]
    counts, slept = {}, {}
    for mode in ("exact", "padded"):
        model = ReferenceMoEModel(MODEL, ep=EPSpec(world, rank, mode, max_tokens=16))
        readings = _time_delays(model)
        for timing in (False, True):
            model.set_expert_delay(DELAY_S if (timing and rank == 1) else 0.0)
            recorder = ExpertDistributionRecorder(model.recorder_config(timing=timing, output_dir=out_dir))
            recorder.start_record()
            with torch.inference_mode():
                model(inputs[0], recorder=recorder)  # warm-up pass
                recorder.reset()
                readings.clear()
                for ids in inputs:
                    model(ids, recorder=recorder)
            if timing:
                slept[mode] = list(readings)
            recorder.stop_record()
            recorder.dump_record(Path(out_dir) / f"{mode}-{'timed' if timing else 'plain'}.h5")
            snap = recorder.snapshot()
            counts[(mode, timing)] = (snap.physical_count, snap.send_count, snap.recv_count)
    # The serving loop (continuous batching over forward_batch) times the same EP layers.
    model = ReferenceMoEModel(MODEL, ep=EPSpec(world, rank, "exact"))
    model.set_expert_delay(DELAY_S if rank == 1 else 0.0)
    recorder = ExpertDistributionRecorder(model.recorder_config(timing=True, output_dir=out_dir))
    loop = ServingLoop(model, max_running=4, max_tokens_per_pass=32, num_kv_slots=256, capture=False, recorder=recorder)
    recorder.start_record()
    loop.run([Request(rid=f"r{rank}-{i}", prompt=[1 + i, 2, 3], max_new_tokens=3) for i in range(3)])
    recorder.stop_record()
    serving = recorder.snapshot().timing
    return {"counts": counts, "serving": serving, "slept": slept}


@pytest.fixture(scope="session")
def ep_run(tmp_path_factory):
    """``(directory, per-rank results)``: ``{exact,padded}-{timed,plain}.h5`` gathered stat traces."""
    out = tmp_path_factory.mktemp("stragglers")
    results = launch(_worker, 2, str(out), backend="gloo", threads_per_rank=1, timeout=240)
    return out, results
