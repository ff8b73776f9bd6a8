"""Distributed analysis: records/s of 4 per-rank traces, in one process vs on a LocalCluster of 2 workers.

Run: ``.venv/bin/python benchmarks/analysis_dask.py [--quick]``

Four ``per_token`` traces of one run (ranks 0..3 of EP 4; OLMoE-like: 16 MoE
layers, 64 experts, top-8, skewed Gumbel top-k routing, 256 tokens per pass)
are written with :class:`~moetrace.trace.TraceWriter`. They are analysed as
one run by :func:`moetrace.analysis.distributed.analyze_traces` in this
process (the single-process fold) and on a ``LocalCluster`` of 2
single-threaded worker processes (the cluster is started once, outside the
timing). The reports are checked identical first; then both are timed, rounds
interleaved, and the figure is routing records (tokens) per second.

Each run also records CPU seconds: this process's, plus (on the cluster) every
worker's. On a shared machine the wall-clock rates carry the other jobs' load;
the CPU seconds per record do not, and ``single CPU s / cluster CPU s`` is the
parallel efficiency that the expected speedup on more cores is derived from
(docs/analysis.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis_throughput import EXPERTS, LAYERS, TOP_K, write_token_trace
from harness import write_results

from moetrace.analysis.distributed import analyze_traces, make_tasks
from moetrace.trace import TraceHeader

RANKS = 4


def write_rank_trace(path: Path, rank: int, tokens: int, run_id: str) -> None:
    """One rank's ``per_token`` trace: ``tokens`` tokens, pass ids shared by all ranks."""
    rng = np.random.default_rng(rank)
    logits = np.log(np.roll(np.arange(1, EXPERTS + 1, dtype=np.float64) ** -1.2, 5 * rank))
    header = TraceHeader(mode="per_token", id_space="logical", num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K,
                         ep_size=RANKS, layer_ids=np.arange(LAYERS), physical_to_logical=np.tile(np.arange(EXPERTS), (LAYERS, 1)),
                         model="olmoe-like", rank=rank, world_size=RANKS, run_id=run_id)
    write_token_trace(path, header, tokens, logits, rng)


def timed(paths: list[Path], client: Any) -> tuple[float, float]:
    """``(wall s, CPU s)`` of one analysis; CPU includes the workers' when ``client`` is given."""
    def worker_cpu() -> float:
        return sum(client.run(time.process_time).values()) if client is not None else 0.0

    cpu0, workers0, wall0 = time.process_time(), worker_cpu(), time.perf_counter()
    analyze_traces(paths, client=client)
    wall = time.perf_counter() - wall0
    return wall, time.process_time() - cpu0 + worker_cpu() - workers0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2^16 tokens per rank instead of 2^18")
    args = parser.parse_args()
    from distributed import Client, LocalCluster

    tokens = 1 << 16 if args.quick else 1 << 18
    rounds = 2
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"run-rank{r}.h5" for r in range(RANKS)]
        for rank, path in enumerate(paths):
            write_rank_trace(path, rank, tokens, run_id="bench")
        records = RANKS * tokens
        size_mb = sum(p.stat().st_size for p in paths) / 1e6
        tasks = len(make_tasks(paths))
        start = time.perf_counter()
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                          silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
            startup = time.perf_counter() - start
            local = analyze_traces(paths).to_dict()
            assert analyze_traces(paths, client=client).to_dict() == local, "Dask and single-process reports differ"
            samples: dict[str, list[tuple[float, float]]] = {"single process": [], "LocalCluster(2)": []}
            for r in range(rounds):
                order = ["single process", "LocalCluster(2)"][:: 1 if r % 2 == 0 else -1]
                for name in order:
                    samples[name].append(timed(paths, client if name != "single process" else None))
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in samples.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in samples.items()}
    results = {
        "ranks": RANKS, "tokens_per_rank": tokens, "records": records, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K,
        "files_mb": size_mb, "tasks": tasks, "rounds": rounds, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
        "cluster_startup_s": startup, "wall_s": wall, "cpu_s": cpu,
        "records_per_s": {name: records / t for name, t in wall.items()},
        "records_per_cpu_s": {name: records / t for name, t in cpu.items()},
        "speedup": wall["single process"] / wall["LocalCluster(2)"],
        "cpu_efficiency": cpu["single process"] / cpu["LocalCluster(2)"], "identical": True,
    }
    print(f"{RANKS} per-rank per_token traces, {records:,} tokens ({size_mb:.0f} MB), {tasks} tasks; median of {rounds} "
          f"interleaved rounds on {os.cpu_count()} CPUs (load average {results['load_average']:.1f}); "
          f"cluster startup {startup:.1f} s (not timed)")
    print(f"{'':<18}{'wall s':>9}{'tokens/s':>14}{'CPU s':>9}{'tokens/CPU s':>15}")
    for name in wall:
        print(f"{name:<18}{wall[name]:>9.2f}{records / wall[name]:>14,.0f}{cpu[name]:>9.2f}{records / cpu[name]:>15,.0f}")
    print(f"speedup {results['speedup']:.2f}x wall; CPU efficiency of the cluster run {results['cpu_efficiency']:.2f}; reports identical")
    print(f"wrote {write_results('analysis_dask', results)}")


if __name__ == "__main__":
    main()
