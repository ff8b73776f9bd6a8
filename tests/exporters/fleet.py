"""A simulated EP fleet: one process per EP rank, each with the real recorder and its own exporter.

Every rank draws the routing of the whole fleet for a pass from one seeded
generator (so each rank can compute, without communication, what the others'
dispatch sends it), records its own tokens' routing through the real hooks
(``on_select_experts``), and reports its dispatch (``on_dispatch``: copies
sent to each EP rank, copies received from each) as an all-to-all EP engine
(DeepEP) would. The routing is skewed (a Zipf-like preference over slots, a
different one per layer), the top-k ids of a token are distinct, and no token
is dropped, so what rank ``r``'s experts receive is exactly the load that
``moetrace analyze`` computes from every rank's routing.

:func:`fleet_rank` is one rank (spawned by :func:`moetrace.reference.launch`
in a gloo group, which gives the ranks one ``run_id``, or run alone as
``python -m tests.exporters.fleet`` for a benchmark). Shapes: :data:`SMALL`
(tests) and :data:`DSV3` (DeepSeek-V3: 58 MoE layers 3..60, 256 experts on
288 slots, top-8, EP 72).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from moetrace.exporters import prometheus

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.layout import RankLayout


@dataclasses.dataclass(frozen=True)
class FleetShape:
    """Model and fleet shape: ``layers`` MoE layers from model layer ``first_layer``, ``experts`` logical
    experts on ``slots`` physical slots (slot ``p`` holds expert ``p % experts``), ``ep`` ranks, ``tokens`` per pass."""

    name: str
    layers: int
    first_layer: int
    experts: int
    slots: int
    top_k: int
    ep: int
    tokens: int

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.first_layer, self.first_layer + self.layers))


SMALL = FleetShape("small", layers=4, first_layer=1, experts=16, slots=16, top_k=2, ep=4, tokens=32)
DSV3 = FleetShape("dsv3", layers=58, first_layer=3, experts=256, slots=288, top_k=8, ep=72, tokens=128)
SHAPES = {s.name: s for s in (SMALL, DSV3)}


def layout(shape: FleetShape, rank: int) -> RankLayout:
    """DP attention with an all-to-all EP (SGLang with DeepEP): each rank routes its own tokens."""
    r = shape.ep
    return RankLayout(rank=rank, world_size=r, tp_size=r, tp_rank=rank, dp_size=r, dp_rank=rank, ep_size=r, ep_rank=rank,
                      attn_tp_size=1, router_tp_size=1, source="sglang")


def recorder_config(shape: FleetShape, rank: int, out: Path, mode: str = "per_pass", **fields: object) -> RecorderConfig:
    """Rank ``rank``'s recorder: its EP rank and layout, slot ``p`` holding expert ``p % experts``; ``fields`` override."""
    mapping = np.tile(np.arange(shape.slots) % shape.experts, (shape.layers, 1))
    return RecorderConfig(num_layers=shape.layers, num_physical_experts=shape.slots, top_k=shape.top_k, ep_size=shape.ep,
                          ep_rank=rank, layer_ids=shape.layer_ids, physical_to_logical=mapping, mode=mode,
                          layout=layout(shape, rank), hidden_size=7168, dtype_bytes=2, model=f"fleet-{shape.name}",
                          engine="moetrace.fleet-sim", output_dir=out, max_tokens_per_pass=shape.tokens, segment_seconds=0,
                          **fields)  # type: ignore[arg-type]


def fleet_routing(shape: FleetShape, seed: int, pass_index: int) -> np.ndarray:
    """Physical ids ``[ep, layers, tokens, top_k]`` of every rank's tokens in one pass (the same on every rank)."""
    prefs = np.random.default_rng([seed, 1 << 20])
    weights = 1.0 / (1.0 + np.arange(shape.slots)) ** 0.8
    cdf = np.empty((shape.layers, shape.slots))
    for layer in range(shape.layers):  # a different hot set per layer
        p = weights[prefs.permutation(shape.slots)]
        cdf[layer] = np.cumsum(p / p.sum())
    cdf[:, -1] = 1.0
    rng = np.random.default_rng([seed, pass_index])
    u = rng.random((shape.layers, shape.ep * shape.tokens))
    base = np.stack([np.searchsorted(cdf[layer], u[layer], side="right") for layer in range(shape.layers)])
    base = base.reshape(shape.layers, shape.ep, shape.tokens).transpose(1, 0, 2)
    stride = shape.slots // shape.top_k  # top-k ids base + j * stride: distinct
    return (base[..., None] + stride * np.arange(shape.top_k)) % shape.slots


def copies_to_ranks(ids: np.ndarray, shape: FleetShape) -> np.ndarray:
    """``[..., layers, tokens, top_k]`` ids -> copies per destination EP rank ``[..., layers, ep]``."""
    dest = ids // (shape.slots // shape.ep)
    lead = dest.shape[:-2]  # [..., layers]
    rows = np.arange(int(np.prod(lead))).reshape(*lead, 1, 1) * shape.ep
    counts = np.bincount((rows + dest).reshape(-1), minlength=int(np.prod(lead)) * shape.ep)
    return counts.reshape(*lead, shape.ep)


def record_pass(recorder: ExpertDistributionRecorder, shape: FleetShape, seed: int, pass_index: int) -> None:
    """One pass on this rank: its own routing through ``on_select_experts``, its dispatch through ``on_dispatch``."""
    rank = recorder.config.ep_rank
    ids = fleet_routing(shape, seed, pass_index)
    to_ranks = copies_to_ranks(ids, shape)  # [source, L, dest]
    send = torch.from_numpy(to_ranks[rank])  # [L, R]: what this rank sends to each rank
    recv = torch.from_numpy(np.ascontiguousarray(to_ranks[:, :, rank].T))  # [L, R]: what each rank sends here
    own = torch.from_numpy(ids[rank])
    with recorder.with_forward_pass():
        for layer in range(shape.layers):
            with recorder.with_current_layer(layer):
                recorder.on_select_experts(own[layer])
                recorder.on_dispatch(send[layer], recv[layer])


def write_rank_traces(shape: FleetShape, passes: int, out: Path, run_id: str, **fields: object) -> list[Path]:
    """``shape.ep`` per-rank ``per_pass`` traces of one run, written in this process by one recorder a rank
    (each with its rank's id and layout and ``run_id``) fed the fleet's routing pass by pass (no dispatch)."""
    recorders = [ExpertDistributionRecorder(recorder_config(shape, rank, out, run_id=run_id, **fields)) for rank in range(shape.ep)]
    for rec in recorders:
        rec.start_record()
    for index in range(passes):
        ids = torch.from_numpy(fleet_routing(shape, 0, index))  # [R, L, T, k]
        for rank, rec in enumerate(recorders):
            with rec.with_forward_pass():
                for layer in range(shape.layers):
                    with rec.with_current_layer(layer):
                        rec.on_select_experts(ids[rank, layer])
    paths = []
    for rec in recorders:
        rec.stop_record()
        paths.append(rec.dump_record(out / "fleet.h5"))
    return paths


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def fleet_rank(rank: int, world_size: int, shape_name: str, out: str, passes: int, seed: int = 0, dump: bool = True,
               render_rounds: int = 0, timeout: float = 120.0, ports: list[int] | None = None) -> int:
    """One EP rank: record ``passes`` passes with its exporter up, dump its trace, wait for ``out/done``.

    Serves ``/metrics`` on ``ports[rank]`` (a free one without ``ports``) and writes
    ``rank{r}.port`` (the port) when the exporter is up, then ``rank{r}.json``
    (passes, received per layer, the dumped path, and with ``render_rounds`` the render times
    of the default and the ``per_ep_rank`` scrape) once recorded. Returns the passes recorded.
    """
    shape, out_dir = SHAPES[shape_name], Path(out)
    recorder = ExpertDistributionRecorder(recorder_config(shape, rank, out_dir, mode="per_pass" if dump else "stat"))
    server = prometheus.start_http_server(ports[rank] if ports else 0, recorder=recorder)
    try:
        _write_json(out_dir / f"rank{rank}.port", server.port)
        recorder.start_record()
        for index in range(passes):
            record_pass(recorder, shape, seed, index)
        recorder.stop_record()
        snap = recorder.snapshot()
        result: dict[str, object] = {"passes": snap.num_passes, "received": snap.recv_count.sum(axis=1).tolist(),
                                     "series": _series(recorder, False), "series_per_ep_rank": _series(recorder, True)}
        if dump:
            result["path"] = str(recorder.dump_record(out_dir / f"fleet-{shape.name}.h5"))
        if render_rounds:
            result["render_s"] = render_times(recorder, render_rounds)
        _write_json(out_dir / f"rank{rank}.json", result)
        deadline = time.monotonic() + timeout
        while not (out_dir / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return snap.num_passes
    finally:
        server.close()


def _series(recorder: ExpertDistributionRecorder, per_ep_rank: bool) -> int:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(prometheus.register(recorder, per_ep_rank=per_ep_rank)).decode()
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def render_times(recorder: ExpertDistributionRecorder, rounds: int) -> dict[str, list[float]]:
    """Seconds to render one scrape (``generate_latest``), default and ``per_ep_rank``, interleaved round by round."""
    from prometheus_client import generate_latest

    registries = {"default": prometheus.register(recorder), "per_ep_rank": prometheus.register(recorder, per_ep_rank=True)}
    times: dict[str, list[float]] = {name: [] for name in registries}
    for _ in range(rounds):
        for name, registry in registries.items():
            start = time.perf_counter()
            generate_latest(registry)
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of a simulated EP fleet (no process group: it does not dump)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dsv3")
    parser.add_argument("--out", required=True)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--render-rounds", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fleet_rank(args.rank, SHAPES[args.shape].ep, args.shape, args.out, args.passes, args.seed, dump=False,
               render_rounds=args.render_rounds, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
