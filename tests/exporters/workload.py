"""Workloads for exporter and control tests: the reference MoE runtime with OLMoE-fitted routing.

``dense_model`` stacks dense reference ``MoELayer`` s whose routers carry a
per-expert bias fitted to the real OLMoE-1B-7B counts (layers 0, 7, 15), so
the load is skewed the way a real model's is. ``ep_worker`` runs the sharded
``EPMoELayer`` on one rank of a ``torch.distributed`` (gloo) job with its own
Prometheus exporter, as an operator would run one exporter per rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from moetrace.exporters import prometheus

from moetrace import ExpertDistributionRecorder, RecorderConfig, RecorderSnapshot
from moetrace.dispatch import build_dispatch_layout, expert_capacity
from moetrace.reference.ep import EPMoELayer
from moetrace.reference.experts import SwiGLUExperts
from moetrace.reference.moe import MoELayer
from moetrace.reference.router import TopKRouter, olmoe_bias

LAYER_IDS = (0, 7, 15)  # the OLMoE layers the counts were recorded at
HIDDEN = 32
INTERMEDIATE = 48


def config(tmp: Path, *, num_experts: int = 16, top_k: int = 2, ep_size: int = 1, ep_rank: int = 0, **kw) -> RecorderConfig:
    """A recorder config matching the reference model built by :func:`dense_model` / :func:`ep_worker`."""
    return RecorderConfig(num_layers=len(LAYER_IDS), num_physical_experts=num_experts, top_k=top_k, ep_size=ep_size,
                          ep_rank=ep_rank, layer_ids=LAYER_IDS, hidden_size=HIDDEN, dtype_bytes=4,
                          model="reference-olmoe-fitted", engine="moetrace.reference", output_dir=tmp, **kw)


def _router(index: int, num_experts: int, top_k: int) -> TopKRouter:
    return TopKRouter(HIDDEN, num_experts, top_k, bias=3.0 * olmoe_bias(num_experts, layer=index), seed=index)


def dense_model(num_experts: int = 16, top_k: int = 2, capacity_factor: float | None = 1.0) -> list[MoELayer]:
    """Three dense reference MoE layers (``moe_index`` 0..2, model layers 0, 7, 15)."""
    return [
        MoELayer(_router(i, num_experts, top_k), SwiGLUExperts(HIDDEN, INTERMEDIATE, num_experts, seed=i),
                 capacity_factor=capacity_factor, moe_index=i, layer_id=layer_id)
        for i, layer_id in enumerate(LAYER_IDS)
    ]


def forward(recorder: ExpertDistributionRecorder, layers: list, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """One forward pass of ``tokens`` random hidden states through ``layers``, reported to ``recorder``."""
    x = torch.randn(tokens, HIDDEN, generator=generator)
    with recorder.with_forward_pass():
        for layer in layers:
            x = x + layer(x, recorder)
    return x


def routers(num_experts: int = 16, top_k: int = 2) -> list[TopKRouter]:
    """The routers of :func:`dense_model` alone, for a single-process view of one EP rank."""
    return [_router(i, num_experts, top_k) for i in range(len(LAYER_IDS))]


def route_pass(recorder: ExpertDistributionRecorder, layer_routers: list[TopKRouter], tokens: int,
               generator: torch.Generator, capacity_factor: float = 1.0) -> None:
    """One pass as EP rank ``recorder.config.ep_rank`` sees it: route, build the dispatch layout, report.

    Runs the real router and :func:`~moetrace.dispatch.build_dispatch_layout`
    (send counts per destination rank, capacity drops) without the experts or
    the all-to-all, so a single process can stand for one rank of ``ep_size``.
    """
    cfg = recorder.config
    x = torch.randn(tokens, HIDDEN, generator=generator)
    with recorder.with_forward_pass():
        for index, router in enumerate(layer_routers):
            with recorder.with_current_layer(index):
                ids, weights = router(x)
                capacity = expert_capacity(tokens, cfg.top_k, cfg.num_physical_experts, capacity_factor)
                layout = build_dispatch_layout(ids, weights, cfg.num_physical_experts, cfg.ep_size, capacity)
                recorder.on_select_experts(ids)
                recorder.on_dispatch(layout.send_counts, None, layout.dropped)


def snapshot_json(snap: RecorderSnapshot) -> dict[str, object]:
    """The snapshot's numbers as JSON (for results crossing a process boundary)."""
    return {
        "num_passes": snap.num_passes, "num_tokens": snap.num_tokens, "rank": snap.rank,
        "physical_count": snap.physical_count.tolist(), "rank_load": snap.rank_load.tolist(),
        "send_count": snap.send_count.tolist(), "recv_count": snap.recv_count.tolist(),
        "dropped": snap.dropped.tolist(), "balancedness": snap.balancedness,
        "layer_imbalance": snap.layer_imbalance.tolist(), "alltoall_bytes_actual": snap.alltoall_bytes_actual.tolist(),
    }


def ep_worker(rank: int, world_size: int, ports: list[int], tmp: str, num_experts: int, tokens: int) -> int:
    """One EP rank: serve its own exporter on ``ports[rank]``, run passes until ``tmp/stop`` appears.

    Rank 0 watches for the stop file and broadcasts the decision, so every rank
    runs the same number of passes (the all-to-alls are collective). After
    stopping, each rank writes ``rank{r}.json`` (its snapshot) and keeps
    serving until ``tmp/done`` appears, so Prometheus can scrape the final values.
    """
    out = Path(tmp)
    recorder = ExpertDistributionRecorder(config(out, num_experts=num_experts, ep_size=world_size, ep_rank=rank))
    per_rank = num_experts // world_size
    layers = [
        EPMoELayer(_router(i, num_experts, 2), SwiGLUExperts(HIDDEN, INTERMEDIATE, per_rank, first=rank * per_rank, seed=i),
                   ep_size=world_size, ep_rank=rank, mode="exact", capacity_factor=1.0, moe_index=i, layer_id=layer_id)
        for i, layer_id in enumerate(LAYER_IDS)
    ]
    generator = torch.Generator().manual_seed(1000 + rank)
    server = prometheus.start_http_server(ports[rank], recorder=recorder)
    try:
        recorder.start_record()
        stop = torch.zeros(1, dtype=torch.int64)
        deadline = time.monotonic() + 120
        while not stop.item():
            forward(recorder, layers, tokens, generator)
            time.sleep(0.005)
            stop.fill_(int((out / "stop").exists() or time.monotonic() > deadline))
            dist.broadcast(stop, src=0)
        recorder.stop_record()
        (out / f"rank{rank}.json").write_text(json.dumps(snapshot_json(recorder.snapshot())))
        while not (out / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return recorder.num_passes
    finally:
        server.close()
