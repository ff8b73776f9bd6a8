"""Side-by-side timing: variants interleaved in one process, reported as ratios.

Each round runs every variant once in a rotated order (so drift and thermal
effects hit all of them alike); the figure of a variant is the median of its
rounds, and ratios are taken against the baseline variant of the same run.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["RESULTS_DIR", "interleaved", "machine", "write_results"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, warmup: int = 2, inner: int = 1) -> dict[str, float]:
    """Median seconds per call of each variant, measured round-robin."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            for _ in range(inner):
                variants[name]()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(times) for name, times in samples.items()}


def machine() -> str:
    """A one-line description of where a figure was measured."""
    import os

    return f"{platform.machine()} {os.cpu_count()} CPU(s), {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def write_results(name: str, payload: dict[str, object]) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine description added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2) + "\n")
    return path
