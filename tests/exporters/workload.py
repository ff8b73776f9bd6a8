"""Workloads for exporter and control tests: the reference MoE runtime with OLMoE-fitted routing.

:func:`serving_loop` builds the reference model (:class:`ReferenceMoEModel`,
MoE layers 1..3 after a dense layer 0, routers biased to the real OLMoE-1B-7B
expert counts so the load is skewed like a real model's, expert capacity 1.0
so tokens get dropped) behind its continuous-batching :class:`ServingLoop`.
:func:`ep_worker` runs the same model sharded over ``torch.distributed``
(gloo) ranks, each rank with its own Prometheus exporter, as an operator runs
one exporter per rank. :func:`route_pass` stands one process in for one rank
of a larger EP group (real routers and dispatch layout, no all-to-all).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from moetrace.exporters import prometheus

from moetrace import ExpertDistributionRecorder, RecorderConfig, RecorderSnapshot
from moetrace.dispatch import expert_capacity
from moetrace.dispatch_layout import build_dispatch_layout
from moetrace.reference import (
    EPSpec,
    ModelConfig,
    ReferenceMoEModel,
    Request,
    ServingLoop,
    TopKRouter,
    olmoe_bias,
)

MODEL = "reference-olmoe-fitted"
NUM_EXPERTS = 16


def model_config() -> ModelConfig:
    """4 layers (layer 0 dense, MoE layers 1, 2, 3), 16 experts, top-2, OLMoE-fitted router bias."""
    bias = 3.0 * olmoe_bias(NUM_EXPERTS, layer=0)
    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=4, num_experts=NUM_EXPERTS,
                       top_k=2, dense_layers=(0,), router_bias=tuple(bias.tolist()), capacity_factor=1.0)


def requests(count: int, seed: int = 0, prefix: str = "r") -> list[Request]:
    """``count`` generation requests arriving two per loop step."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt_len = int(torch.randint(4, 24, (), generator=gen))
        out.append(Request(f"{prefix}{i}", torch.randint(0, 128, (prompt_len,), generator=gen).tolist(),
                           max_new_tokens=int(torch.randint(1, 6, (), generator=gen)), arrival_step=i // 2))
    return out


def serving_loop(tmp: Path, ep: EPSpec | None = None, capture: bool = False, **recorder_fields) -> tuple[ServingLoop, ExpertDistributionRecorder]:
    """The reference model behind a serving loop, reporting to a new recorder (``output_dir=tmp``).

    ``capture`` keeps a routed-experts capturer (for ``return_routed_experts`` requests).
    """
    model = ReferenceMoEModel(model_config(), ep=ep)
    recorder = ExpertDistributionRecorder(model.recorder_config(output_dir=tmp, model=MODEL, **recorder_fields))
    loop = ServingLoop(model, max_running=8, max_tokens_per_pass=64, num_kv_slots=2048, capture=capture, recorder=recorder)
    return loop, recorder


def serve(loop: ServingLoop, count: int, seed: int = 0) -> int:
    """Serve ``count`` requests to completion; returns the passes run."""
    return sum(p.forward_pass_id is not None for p in _steps(loop, requests(count, seed)))


def _steps(loop: ServingLoop, reqs: list[Request]):
    loop.submit(reqs)
    yield from loop.steps()


# ---------------------------------------------------------------------- one process as one EP rank
def rank_config(tmp: Path, ep_size: int, ep_rank: int) -> RecorderConfig:
    """Recorder config for :func:`route_pass`: three MoE layers (model layers 1..3) of the model above."""
    c = model_config()
    return RecorderConfig(num_layers=3, num_physical_experts=c.num_experts, top_k=c.top_k, ep_size=ep_size,
                          ep_rank=ep_rank, layer_ids=c.moe_layer_ids, hidden_size=c.hidden_size, dtype_bytes=4,
                          model=MODEL, engine="moetrace.reference", output_dir=tmp)


def routers() -> list[TopKRouter]:
    """OLMoE-biased reference routers, one per MoE layer (layer ``i`` fitted to OLMoE layer ``i``)."""
    c = model_config()
    return [TopKRouter(c.hidden_size, c.num_experts, c.top_k, bias=3.0 * olmoe_bias(c.num_experts, layer=i), seed=i)
            for i in range(3)]


def route_pass(recorder: ExpertDistributionRecorder, layer_routers: list[TopKRouter], tokens: int,
               generator: torch.Generator, capacity_factor: float = 1.0) -> None:
    """One pass as EP rank ``recorder.config.ep_rank`` sees it: route, build the dispatch layout, report.

    Runs the real router and :func:`~moetrace.dispatch_layout.build_dispatch_layout`
    (send counts per destination rank, capacity drops) without the experts or
    the all-to-all, so a single process can stand for one rank of ``ep_size``.
    """
    cfg = recorder.config
    x = torch.randn(tokens, model_config().hidden_size, generator=generator)
    with recorder.with_forward_pass():
        for index, router in enumerate(layer_routers):
            with recorder.with_current_layer(index):
                ids, weights = router(x)
                capacity = expert_capacity(tokens, cfg.top_k, cfg.num_physical_experts, capacity_factor)
                layout = build_dispatch_layout(ids, weights, cfg.num_physical_experts, cfg.ep_size, capacity)
                recorder.on_select_experts(ids)
                recorder.on_dispatch(layout.send_counts, None, layout.dropped)


# ---------------------------------------------------------------------- real EP ranks
def snapshot_json(snap: RecorderSnapshot) -> dict[str, object]:
    """The snapshot's numbers as JSON (for results crossing a process boundary)."""
    return {
        "num_passes": snap.num_passes, "num_tokens": snap.num_tokens, "rank": snap.rank,
        "physical_count": snap.physical_count.tolist(), "rank_load": snap.rank_load.tolist(),
        "send_count": snap.send_count.tolist(), "recv_count": snap.recv_count.tolist(),
        "dropped": snap.dropped.tolist(), "balancedness": snap.balancedness,
        "layer_imbalance": snap.layer_imbalance.tolist(), "alltoall_bytes_actual": snap.alltoall_bytes_actual.tolist(),
    }


def ep_worker(rank: int, world_size: int, ports: list[int], tmp: str) -> int:
    """One EP rank: serve its own exporter on ``ports[rank]`` and requests until ``tmp/stop`` appears.

    Rank 0 watches for the stop file and stops the loop (all ranks stop at the
    same step). Then each rank writes ``rank{r}.json`` (its snapshot) and keeps
    its exporter up until ``tmp/done`` appears, so Prometheus can scrape the
    final values. Returns the passes recorded.
    """
    out = Path(tmp)
    loop, recorder = serving_loop(out, ep=EPSpec(world_size, rank))
    server = prometheus.start_http_server(ports[rank], recorder=recorder, per_ep_rank=True)  # the test reads the matrices
    try:
        recorder.start_record()
        deadline = time.monotonic() + 120
        for _ in _steps(loop, requests(2000, seed=rank, prefix=f"rank{rank}-")):
            if rank == 0 and ((out / "stop").exists() or time.monotonic() > deadline):
                loop.stop()
        recorder.stop_record()
        (out / f"rank{rank}.json").write_text(json.dumps(snapshot_json(recorder.snapshot())))
        while not (out / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return recorder.num_passes
    finally:
        server.close()
