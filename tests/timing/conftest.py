"""Shared by the timing tests: one 2-rank gloo EP run with rank 1's expert compute delayed,
recorded on the machine's clock and on the counting clock (tests/phase_ticks.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
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

from ..phase_ticks import counting_clock

DELAY_S = 0.02
PASSES = 10
RUNS = ("plain", "timed", "ticks")
"""Each mode's recordings: no timing; the machine's clock; the counting clock (tests/phase_ticks.py)."""
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2,
                    dense_layers=(0,), router_bias=tuple(zipf_bias(8, 1.0, seed=0).tolist()), seed=5)
LAYERS = len(MODEL.moe_layer_ids)


def _inject_delays(model: ReferenceMoEModel, sleep: Callable[[float], None]) -> list[float]:
    """Make every EP layer's injected delay call ``sleep(expert_delay_s)``, timed with the harness's own
    ``perf_counter`` (independent of moetrace's phase clock); returns the list the timed seconds go into
    (one per delayed layer and pass)."""
    slept: list[float] = []
    for layer in model.moe_layers:
        def delay(layer=layer) -> None:  # type: ignore[no-untyped-def]
            if layer.expert_delay_s:
                start = time.perf_counter()
                sleep(layer.expert_delay_s)
                slept.append(time.perf_counter() - start)

        layer._delay = delay  # type: ignore[union-attr]
    return slept


def _recorder(model: ReferenceMoEModel, timing: str, out_dir: str, rank: int) -> tuple[ExpertDistributionRecorder, list[float]]:
    """A recorder for one run (``plain``: no timing; ``timed``: the machine's clock, rank 1 sleeping
    ``DELAY_S``; ``ticks``: the counting clock, rank 1's delay moving it), and the list of rank 1's timed delays."""
    model.set_expert_delay(DELAY_S if (timing != "plain" and rank == 1) else 0.0)
    if timing != "ticks":
        return ExpertDistributionRecorder(model.recorder_config(timing=timing == "timed", output_dir=out_dir)), _inject_delays(model, time.sleep)
    with counting_clock() as sleep:
        return ExpertDistributionRecorder(model.recorder_config(timing=True, output_dir=out_dir)), _inject_delays(model, sleep)


def _worker(rank: int, world: int, out_dir: str) -> dict:
    torch.manual_seed(0)
    inputs = [torch.randint(0, MODEL.vocab_size, (2, 6 + rank), generator=torch.Generator().manual_seed(10 * p + rank)) for p in range(PASSES)]
    counts, slept = {}, {}
    for mode in ("exact", "padded"):
        model = ReferenceMoEModel(MODEL, ep=EPSpec(world, rank, mode, max_tokens=16))
        for timing in RUNS:
            recorder, readings = _recorder(model, timing, out_dir, rank)
            recorder.start_record()
            with torch.inference_mode():
                model(inputs[0], recorder=recorder)  # warm-up pass
                recorder.reset()
                readings.clear()
                for ids in inputs:
                    model(ids, recorder=recorder)
            if timing == "timed":
                slept[mode] = list(readings)
            recorder.stop_record()
            recorder.dump_record(Path(out_dir) / f"{mode}-{timing}.h5")
            snap = recorder.snapshot()
            counts[(mode, timing)] = (snap.physical_count, snap.send_count, snap.recv_count)
    # The serving loop (continuous batching over forward_batch) times the same EP layers, on the counting clock.
    model = ReferenceMoEModel(MODEL, ep=EPSpec(world, rank, "exact"))
    recorder, _ = _recorder(model, "ticks", out_dir, rank)
    loop = ServingLoop(model, max_running=4, max_tokens_per_pass=32, num_kv_slots=256, capture=False, recorder=recorder)
    recorder.start_record()
    loop.run([Request(rid=f"r{rank}-{i}", prompt=[1 + i, 2, 3], max_new_tokens=3) for i in range(3)])
    recorder.stop_record()
    serving = recorder.snapshot().timing
    return {"counts": counts, "serving": serving, "slept": slept}


@pytest.fixture(scope="session")
def ep_run(tmp_path_factory):
    """``(directory, per-rank results)``: ``{exact,padded}-{plain,timed,ticks}.h5`` gathered stat traces."""
    out = tmp_path_factory.mktemp("stragglers")
    results = launch(_worker, 2, str(out), backend="gloo", threads_per_rank=1, timeout=240)
    return out, results
