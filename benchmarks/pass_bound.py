"""What a recording adds to a forward pass, at the median, p99 and the worst (issue 50, item 4).

Run: ``.venv/bin/python benchmarks/pass_bound.py [--seconds 600] [--modes stat per_pass per_token]
[--segment-seconds 10 2] [--pass-ms 0] [--torch-threads N] [--label NAME]``

For every mode, one process runs the DeepSeek-V3 decode workload (:mod:`deepseek_workload`: 58 MoE
layers, 288 slots, top-8, 256 tokens a pass, the hooks on this machine's CPU) for ``--seconds``
with recording off, then for ``--seconds`` recording with each ``segment_seconds`` setting (the
default 10, then 2), side by side in one run. Per case: the median, p99 and longest pass, the
passes over 20 ms, and the passes more than 5 ms over the case's own median (the bound issue 50
asks: none). ``--pass-ms`` adds that many milliseconds of waiting after the hooks of every pass,
standing in for the forward's device time (0, the default: the issue's bare workload, 700-900
passes a second here, 20-90x what a DeepSeek-V3 rank runs on a GPU, so the streaming modes hand the
writer process more rows a second than one niced core writes, and ``on_overflow="block"`` makes the
engine wait for it). ``--torch-threads`` sets torch's intra-op threads, which run the hooks'
device ops on this CPU (default: torch's own, one per core): with two, each op's parallel region
waits for a second thread that the writer process may hold, an artifact of the CPU standing in for
the device (paced at 20 ms, 131 of 400 passes' hooks took over 5 ms with 2 threads, 2-3 with 1).
The script uses only the public recorder API, so the code before a change is
measured with the very same script: ``cd <old checkout> && .venv/bin/python <this script>``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_workload import forward, paced_forward, recorder, routes
from harness import write_results

import moetrace

#: A pass this much over its case's median counts as a hiccup (issue 50's bound).
OVER_MEDIAN_S = 5e-3
#: The issue table's threshold.
LONG_PASS_S = 20e-3


def figures(times: list[float]) -> dict[str, float]:
    """Median / p99 / max pass (ms), passes over 20 ms and over the median + 5 ms."""
    median = statistics.median(times)
    return {
        "passes": len(times), "median_ms": 1e3 * median, "p99_ms": 1e3 * float(np.percentile(times, 99)), "max_ms": 1e3 * max(times),
        "over_20ms": sum(t > LONG_PASS_S for t in times), "over_median_5ms": sum(t > median + OVER_MEDIAN_S for t in times),
        "load_average": os.getloadavg()[0],
    }


def timed_passes(rec: moetrace.ExpertDistributionRecorder, seconds: float, device: str, pass_s: float = 0.0,
                 probe: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """Forward passes for ``seconds`` of wall time, each the hooks then ``pass_s`` of stand-in device
    time (:func:`~deepseek_workload.paced_forward`); each one's start (``time.perf_counter``) and
    seconds (host time: what the engine's forward thread spends). ``probe``: called just before and
    just after each timed pass (it keeps its own readings: two a pass, in order)."""
    ids = routes(device=device)
    one_pass = functools.partial(forward, rec, ids)
    for _ in range(20):  # warm-up: first-call allocations
        one_pass()
    passes: list[tuple[float, float]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if probe is not None:
            probe()
        start = time.perf_counter()
        paced_forward(one_pass, pass_s)
        passes.append((start, time.perf_counter() - start))
        if probe is not None:
            probe()
    return passes


def seconds_of(passes: list[tuple[float, float]]) -> list[float]:
    """The seconds of :func:`timed_passes`' passes."""
    return [seconds for _, seconds in passes]


def mode_cases(tmp: Path, mode: str, seconds: float, segment_seconds: list[float], device: str = "cpu", pass_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Recording off, then on with each ``segment_seconds``: one mode's figures (hooks on ``device``, ``pass_s`` stand-in device time a pass)."""
    rec = recorder(mode, tmp, device=device)
    out = {"off": figures(seconds_of(timed_passes(rec, seconds, device, pass_s)))}
    for setting in segment_seconds:
        rec = recorder(mode, tmp, segment_seconds=setting, device=device)
        rec.start_record()
        times = seconds_of(timed_passes(rec, seconds, device, pass_s))
        rec.stop_record()
        rec.reset()  # the run's files go
        out[f"on_segment_seconds_{setting:g}"] = figures(times)
    for case, f in out.items():
        print(f"{mode:<10} {case:<26} median {f['median_ms']:6.2f}  p99 {f['p99_ms']:6.2f}  max {f['max_ms']:7.1f} ms"
              f"  over 20 ms {f['over_20ms']:4d}  over median+5 ms {f['over_median_5ms']:4d}  ({f['passes']} passes, load {f['load_average']:.2f})", flush=True)
    return out


def add_pacing_arguments(parser: argparse.ArgumentParser) -> None:
    """``--pass-ms`` (stand-in device time a pass) and ``--torch-threads`` (set them before the first op)."""
    parser.add_argument("--pass-ms", type=float, default=0.0, help="stand-in device time after each pass's hooks (ms; 0: the bare workload)")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads for the hooks' CPU ops (default: torch's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="seconds per case (the issue asks 600 on an idle machine)")
    parser.add_argument("--modes", nargs="*", default=["stat", "per_pass", "per_token"])
    parser.add_argument("--segment-seconds", type=float, nargs="*", default=[10.0, 2.0], help="RecorderConfig.segment_seconds of the recording-on cases")
    add_pacing_arguments(parser)
    parser.add_argument("--label", default="now", help="results go to benchmarks/results/pass_bound-LABEL.json")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results: dict[str, object] = {"seconds_per_case": args.seconds, "pass_ms": args.pass_ms, "torch_threads": torch.get_num_threads(), "moetrace": str(Path(moetrace.__file__).parent),
                                  "load_average_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="moetrace-pass-bound-") as tmp:
        for mode in args.modes:
            results[mode] = mode_cases(Path(tmp), mode, args.seconds, args.segment_seconds, pass_s=args.pass_ms / 1e3)
    print(write_results(f"pass_bound-{args.label}", results))


if __name__ == "__main__":
    main()
