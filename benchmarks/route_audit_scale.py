"""``moetrace audit`` at DeepSeek-V3 shape: time and peak memory, and the live row checks' cost per request.

Synthetic routes of 58 MoE layers, 256 experts, top-8 (DeepSeek-V3) for ``--requests`` requests of
``--positions`` positions each. The recorded side is a :class:`RecordedSource` that regenerates each
request from its seed when read (as a trace is read request by request), so the audit holds only the
returned routes (``int16``, what the client holds) plus one recorded request. Faults are planted in
the returned routes: 5% of the requests shifted by one position, 5% holding another request's rows.
The live figure is :func:`moetrace.route_checks.row_faults` on one request's ``[positions, 61 model
layers, 8]`` rows (3 dense layers at ``-1``), what the capturer adds when it hands a request out.

Usage::

    python benchmarks/route_audit_scale.py [--requests 200] [--positions 512]

Prints the figures and writes ``benchmarks/results/route_audit_scale.json``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results

LAYERS, EXPERTS, TOP_K, DENSE = 58, 256, 8, 3


def routes(seed: int, positions: int) -> np.ndarray:
    """``[positions, 58, 8]`` distinct ids per row (a random base plus 8 spaced offsets)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, EXPERTS, (positions, LAYERS, 1))
    return ((base + np.arange(TOP_K) * (EXPERTS // TOP_K)) % EXPERTS).astype(np.int16)


def main() -> None:
    from moetrace.analysis.route_audit import RecordedSource, audit_routes
    from moetrace.route_checks import row_faults
    from moetrace.routes import RouteSet

    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--positions", type=int, default=512)
    args = parser.parse_args()
    n, p = args.requests, args.positions

    def recorded() -> Iterator[tuple[str, np.ndarray]]:
        for i in range(n):
            yield f"r{i}", routes(i, p)

    returned = {f"r{i}": (0, routes(i, p)) for i in range(n)}
    shifted = list(range(0, n, 20))
    foreign = list(range(10, n, 20))
    for i in shifted:
        returned[f"r{i}"][1][1:] = routes(i, p)[:-1]
    for i in foreign:
        returned[f"r{i}"] = (0, routes((i + 1) % n, p))
    held = sum(a.nbytes for _, a in returned.values())
    source = RecordedSource(recorded, EXPERTS, TOP_K, tuple(range(LAYERS)), describe="synthetic")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    report = audit_routes(RouteSet(returned, num_experts=EXPERTS), source)
    seconds = time.perf_counter() - start
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    failed = {r.request: set(r.faults) for r in report.failed}
    expected = {f"r{i}": {"shifted"} for i in shifted} | {f"r{i}": {"foreign"} for i in foreign}
    assert failed == expected, "the audit must name exactly the planted faults"
    rows = n * p * LAYERS

    one = np.concatenate([routes(0, p), np.full((p, DENSE, TOP_K), -1, dtype=np.int16)], axis=1)
    timings = []
    for _ in range(20):
        t0 = time.perf_counter()
        row_faults(one, num_experts=EXPERTS, routed_layers=range(LAYERS))
        timings.append(time.perf_counter() - t0)
    live_ms = 1e3 * float(np.median(timings))

    figures = {
        "requests": n, "positions": p, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "rows": rows,
        "audit_seconds": round(seconds, 2), "rows_per_second": round(rows / seconds),
        "returned_bytes_held": held, "peak_rss_bytes_before_audit": rss_before, "peak_rss_bytes": rss_peak,
        "planted": {"shifted": len(shifted), "foreign": len(foreign)}, "named_exactly": True,
        "live_row_checks_ms_per_request": round(live_ms, 2),
    }
    for key, value in figures.items():
        print(f"{key}: {value}")
    write_results("route_audit_scale", figures)


if __name__ == "__main__":
    main()
