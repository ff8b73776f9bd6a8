"""Scrape cost vs recorded passes: exporter latency at 10^2 and 10^5 recorded passes.

Run: ``.venv/bin/python benchmarks/scrape_cost.py [--quick]``

Two stat-mode recorders with the same OLMoE-like shape (16 MoE layers, 64
experts, top-8, EP rank 0 of 8, window 1000) have recorded 10^2 and 10^5
passes (``--quick``: 10^4) through the real hooks (each pass routes 4 tokens
into one layer, round robin, to keep the fill time short; the exporters only
see the totals, whose shape is fixed). Each exporter path is then timed on both
recorders, interleaved round by round in one process:

- ``snapshot``: ``recorder.snapshot()`` alone;
- ``prom text``: the collector through ``prometheus_client.generate_latest``;
- ``prom HTTP``: a GET of ``/metrics`` on :func:`start_http_server`;
- ``prom per-expert``: the collector with ``per_expert=True`` (+ L x E series);
- ``otel collect``: an ``InMemoryMetricReader`` collection of every instrument.

The scrape cost must be flat: the ratio 10^5 / 10^2 close to 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved, write_results
from moetrace.exporters import otel, prometheus

from moetrace import ExpertDistributionRecorder, RecorderConfig

LAYERS, EXPERTS, TOP_K, EP_SIZE, HIDDEN = 16, 64, 8, 8, 2048


def filled_recorder(passes: int, out_dir: Path) -> tuple[ExpertDistributionRecorder, float]:
    """A recorder that has recorded ``passes`` passes; returns it and the fill time in seconds."""
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=EP_SIZE, hidden_size=HIDDEN,
        window=1000, output_dir=out_dir, model="olmoe-shaped", engine="benchmark"))
    gen = torch.Generator().manual_seed(passes)
    ids = [torch.randint(0, EXPERTS, (4, TOP_K), generator=gen) for _ in range(64)]
    sends = torch.full((EP_SIZE,), 4, dtype=torch.int64)
    rec.start_record()
    start = time.perf_counter()
    for i in range(passes):
        with rec.with_forward_pass():
            rec.on_select_experts(ids[i % 64], layer=i % LAYERS)
            rec.on_dispatch(sends, sends, layer=i % LAYERS)
    elapsed = time.perf_counter() - start
    assert rec.snapshot().num_passes == passes
    return rec, elapsed


def paths(rec: ExpertDistributionRecorder, servers: list[prometheus.MetricsServer]) -> dict[str, Callable[[], object]]:
    """The exporter paths timed for one recorder."""
    text = prometheus.register(rec)
    per_expert = prometheus.register(rec, per_expert=True)
    server = prometheus.start_http_server(0, recorder=rec)
    servers.append(server)
    reader = InMemoryMetricReader()
    otel.create_otel_instruments(MeterProvider(metric_readers=[reader]), rec)

    def http() -> bytes:
        with urllib.request.urlopen(server.url) as resp:
            return resp.read()

    return {
        "snapshot": rec.snapshot,
        "prom text": lambda: generate_latest(text),
        "prom HTTP": http,
        "prom per-expert": lambda: generate_latest(per_expert),
        "otel collect": reader.get_metrics_data,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^4 instead of 10^5 passes, fewer rounds")
    args = parser.parse_args()
    small, large = 100, 10_000 if args.quick else 100_000
    rounds = 15 if args.quick else 40
    results: dict[str, object] = {"layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "ep_size": EP_SIZE,
                                  "rounds": rounds, "passes": [small, large]}
    servers: list[prometheus.MetricsServer] = []
    with tempfile.TemporaryDirectory() as tmp:
        recorders = {}
        for passes in (small, large):
            recorders[passes], fill = filled_recorder(passes, Path(tmp))
            print(f"recorded {passes} passes in {fill:.1f} s")
        try:
            variants = {}
            for passes, rec in recorders.items():
                for name, fn in paths(rec, servers).items():
                    variants[(name, passes)] = fn
            times = interleaved({f"{n}@{p}": fn for (n, p), fn in variants.items()}, rounds=rounds, warmup=3)
        finally:
            for server in servers:
                server.close()
    names = list(dict.fromkeys(n for n, _ in variants))
    print(f"\nscrape cost ({LAYERS} layers, {EXPERTS} experts, top-{TOP_K}, EP {EP_SIZE}); median of {rounds} interleaved rounds")
    print(f"{'path':<18}{f'ms @ {small} passes':>20}{f'ms @ {large} passes':>22}{'ratio':>8}")
    table = {}
    for name in names:
        a, b = times[f"{name}@{small}"], times[f"{name}@{large}"]
        table[name] = {f"ms_{small}": a * 1e3, f"ms_{large}": b * 1e3, "ratio": b / a}
        print(f"{name:<18}{a * 1e3:>20.3f}{b * 1e3:>22.3f}{b / a:>8.2f}")
    results["results"] = table
    print(f"wrote {write_results('scrape_cost', results)}")


if __name__ == "__main__":
    main()
