"""Serving-loop throughput with routed-experts capture on vs off, interleaved in one process.

The same requests (prompts of 16-64 tokens, 8-32 new tokens, staggered
arrivals) run through :class:`~moetrace.reference.ServingLoop` on the
reference model, once with capture off (no capturer) and once with every
request asking for its routed experts (capture in every MoE layer, one
host copy per pass, per-request slicing at the end). Rounds alternate the
two variants; the figure is the median. Both wall-clock time (the harness)
and this process's CPU time are reported: on a shared machine other
processes inflate wall time at random, while single-threaded CPU time only
counts the work done here.

Usage::

    python benchmarks/capture_overhead.py [--rounds 5] [--requests 32]

Prints a table and writes ``benchmarks/results/capture_overhead.json``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, machine, write_results

from moetrace.reference import (
    ModelConfig,
    ReferenceMoEModel,
    Request,
    ServingLoop,
    routed_positions,
)

CONFIG = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=6, num_experts=8, top_k=2,
                     dense_layers=(0,), seed=0)
LOOP = {"max_running": 16, "max_tokens_per_pass": 256, "chunk_size": 64, "num_kv_slots": 4096, "max_len": 128}


def _requests(count: int, capture: bool, prefix: str) -> list[Request]:
    rng = np.random.default_rng(0)
    return [Request(f"{prefix}{i}", rng.integers(0, CONFIG.vocab_size, int(rng.integers(16, 65))).tolist(),
                    int(rng.integers(8, 33)), arrival_step=i // 4, return_routed_experts=capture)
            for i in range(count)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = ReferenceMoEModel(CONFIG)
    tokens = sum(routed_positions(len(r.prompt), r.max_new_tokens) for r in _requests(args.requests, False, ""))
    counter = itertools.count()

    def serve(capture: bool) -> None:
        loop = ServingLoop(model, capture=capture, **LOOP)
        results = loop.run(_requests(args.requests, capture, f"{next(counter)}-"))
        assert len(results) == args.requests

    cpu: dict[str, list[float]] = {"capture_off": [], "capture_on": []}

    def cpu_timed(name: str, capture: bool) -> Any:
        def run() -> None:
            start = time.process_time()
            serve(capture)
            cpu[name].append(time.process_time() - start)
        return run

    warmup = 1
    wall = interleaved({name: cpu_timed(name, name == "capture_on") for name in cpu}, rounds=args.rounds, warmup=warmup)
    cpu_median = {name: statistics.median(samples[warmup:]) for name, samples in cpu.items()}
    figures = {}
    for clock, seconds in (("wall", wall), ("cpu", cpu_median)):
        throughput = {name: tokens / s for name, s in seconds.items()}
        ratio = throughput["capture_on"] / throughput["capture_off"]
        figures[clock] = {"seconds": seconds, "tokens_per_s": throughput, "throughput_ratio_on_off": ratio, "overhead_percent": (1 - ratio) * 100}
    payload = {
        "requests": args.requests, "tokens": tokens, "rounds": args.rounds, "threads": args.threads,
        "model": {k: str(v) for k, v in vars(CONFIG).items()}, "loop": LOOP, **figures,
    }
    print(f"capture overhead: {args.requests} requests, {tokens} routed positions, {args.rounds} interleaved rounds; {machine()}")
    print(f"{'clock':<6}{'variant':<14}{'s/run':>10}{'tokens/s':>12}")
    for clock, fig in figures.items():
        for name in ("capture_off", "capture_on"):
            print(f"{clock:<6}{name:<14}{fig['seconds'][name]:>10.3f}{fig['tokens_per_s'][name]:>12.0f}")
        print(f"{clock:<6}throughput on/off = {fig['throughput_ratio_on_off']:.4f} (overhead {fig['overhead_percent']:+.2f}%)")
    print(f"wrote {write_results('capture_overhead', payload)}")
    return payload


if __name__ == "__main__":
    main()
