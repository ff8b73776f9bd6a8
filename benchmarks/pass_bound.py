"""What a recording adds to a forward pass, at the median, p99 and the worst (issue 50, item 4).

Run: ``.venv/bin/python benchmarks/pass_bound.py [--seconds 600] [--modes stat per_pass per_token]
[--segment-seconds 10 2] [--interleaved [--control-cpu-ms MS] [--control-ops-cpu-ms MS]] [--pass-ms 0] [--torch-threads N] [--label NAME]``

For every mode, one process runs the DeepSeek-V3 decode workload (:mod:`deepseek_workload`: 58 MoE
layers, 288 slots, top-8, 256 tokens a pass, the hooks on this machine's CPU) for ``--seconds``
with recording off, then for ``--seconds`` recording with each ``segment_seconds`` setting (the
default 10, then 2), side by side in one run. Per case: the median, p99 and longest pass, the
passes over 20 ms, and the passes more than 5 ms over the case's own median (the bound issue 50
asks: none). With ``--interleaved``, each recording-on case instead takes every other pass, and
a recorder that is not recording takes the passes between (``off_beside_...``): both see the same
host, whose stolen time and other tasks otherwise differ from one ten-minute case to the next. The
recording's work off the forward thread (the writer process) may then reach into the off passes,
so the off figures there are an upper bound on the host's own hiccups. ``--control-cpu-ms`` adds a
third turn, recording off then that much CPU in a busy loop: a pass with a recorded pass's CPU and
nothing of moetrace's, which tells the recording's own hiccups from a longer pass's greater share
of the host's. ``--control-ops-cpu-ms`` adds another, the recorded pass's device ops without
moetrace (:func:`~deepseek_workload.bare_ops`) then that much CPU: the recording's memory work with
none of its host work, hand-offs or files. ``--pass-ms`` adds that many milliseconds of waiting after the hooks of every pass,
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
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_workload import bare_ops, burning, forward, paced_forward, recorder, routes
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


def alternating_passes(works: Sequence[Callable[[], object]], seconds: float, pass_s: float = 0.0,
                       probe: Callable[[], None] | None = None) -> list[list[tuple[float, float]]]:
    """Forward passes for ``seconds`` of wall time, taking the host works in turn (pass ``i`` runs
    ``works[i % len(works)]``: the hooks, :func:`~deepseek_workload.forward`), each then ``pass_s``
    of stand-in device time (:func:`~deepseek_workload.paced_forward`); per work, each of its
    passes' start (``time.perf_counter``) and seconds (host time: what the engine's forward thread
    spends). ``probe``: called just before and just after each timed pass (it keeps its own
    readings: two a pass, in order)."""
    for _ in range(20):  # warm-up: first-call allocations
        for work in works:
            work()
    passes: list[list[tuple[float, float]]] = [[] for _ in works]
    end, turn = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        if probe is not None:
            probe()
        start = time.perf_counter()
        paced_forward(works[turn], pass_s)
        passes[turn].append((start, time.perf_counter() - start))
        if probe is not None:
            probe()
        turn = (turn + 1) % len(works)
    return passes


def timed_passes(rec: moetrace.ExpertDistributionRecorder, seconds: float, device: str, pass_s: float = 0.0,
                 probe: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """:func:`alternating_passes` of the hooks of one recorder."""
    return alternating_passes([functools.partial(forward, rec, routes(device=device))], seconds, pass_s, probe)[0]


def seconds_of(passes: list[tuple[float, float]]) -> list[float]:
    """The seconds of :func:`timed_passes`' passes."""
    return [seconds for _, seconds in passes]


def control_works(off: Callable[[], object], ids: list[torch.Tensor], cpu_s: float | None, ops_cpu_s: float | None = None,
                  staging_rows: int = 0) -> dict[str, Callable[[], None]]:
    """The control passes that take turns beside a recording, by name: ``"control"`` (with ``cpu_s``):
    ``off`` (the hooks of a recorder that is not recording) then ``cpu_s`` of CPU in a busy loop
    (:func:`~deepseek_workload.burning`); ``"ops"`` (with ``ops_cpu_s``): the recorded pass's device
    ops on ``ids`` without moetrace (:func:`~deepseek_workload.bare_ops`, ``staging_rows``: its
    ``per_token`` staging buffer's rows, 0 for none) then ``ops_cpu_s`` of CPU."""
    controls: dict[str, Callable[[], None]] = {}
    if cpu_s is not None:
        controls["control"] = burning(off, cpu_s)
    if ops_cpu_s is not None:
        controls["ops"] = burning(bare_ops(ids, staging_rows=staging_rows), ops_cpu_s)
    return controls


def mode_cases(tmp: Path, mode: str, seconds: float, segment_seconds: list[float], device: str = "cpu", pass_s: float = 0.0,
               interleaved: bool = False, control_cpu_s: float | None = None, ops_cpu_s: float | None = None) -> dict[str, dict[str, float]]:
    """Recording off, then on with each ``segment_seconds``: one mode's figures (hooks on ``device``,
    ``pass_s`` stand-in device time a pass). ``interleaved``: per setting, ``seconds`` of passes
    taken in turn by a recorder that is not recording and one that is (:func:`alternating_passes`),
    so that both see the same host; the off passes are then ``off_beside_segment_seconds_<s>``.
    ``control_cpu_s`` (with ``interleaved``): a turn of the hooks of a recorder that is not
    recording then that much CPU in a busy loop (:func:`~deepseek_workload.burning`),
    ``control_beside_segment_seconds_<s>``: a pass that takes a recorded pass's CPU, with nothing of
    moetrace's running. ``ops_cpu_s`` (with ``interleaved``): a turn of the recorded pass's device
    ops without moetrace (:func:`~deepseek_workload.bare_ops`, in ``per_token`` with its move of
    the pass's rows into a staging buffer of the default chunk) then that much CPU,
    ``ops_beside_segment_seconds_<s>``: the recording's memory work with none of its host work,
    hand-offs or files. The turns go off, on, then the controls: the pass after a recorded one is a
    control's, so work the recording leaves running lands there, and the recording's long passes
    over a control's are a lower bound on its own."""
    out: dict[str, dict[str, float]] = {}
    if not interleaved:
        out["off"] = figures(seconds_of(timed_passes(recorder(mode, tmp, device=device), seconds, device, pass_s)))
    ids = routes(device=device)
    for setting in segment_seconds:
        rec = recorder(mode, tmp, segment_seconds=setting, device=device)
        rec.start_record()
        if interleaved:
            off = functools.partial(forward, recorder(mode, tmp, device=device), ids)
            controls = control_works(off, ids, control_cpu_s, ops_cpu_s, rec.config.stream_chunk_tokens if mode == "per_token" else 0)
            off_passes, on, *beside = alternating_passes([off, functools.partial(forward, rec, ids), *controls.values()], seconds, pass_s)
            out[f"off_beside_segment_seconds_{setting:g}"] = figures(seconds_of(off_passes))
            for name, passes in zip(controls, beside, strict=True):
                out[f"{name}_beside_segment_seconds_{setting:g}"] = figures(seconds_of(passes))
        else:
            on = timed_passes(rec, seconds, device, pass_s)
        rec.stop_record()
        rec.reset()  # the run's files go
        out[f"on_segment_seconds_{setting:g}"] = figures(seconds_of(on))
    for case, f in out.items():
        print(f"{mode:<10} {case:<38} median {f['median_ms']:6.2f}  p99 {f['p99_ms']:6.2f}  max {f['max_ms']:7.1f} ms"
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
    parser.add_argument("--interleaved", action="store_true",
                        help="per setting, alternate passes between recording off and on (the same host for both) instead of off then on")
    parser.add_argument("--control-cpu-ms", type=float, default=None,
                        help="with --interleaved: a third turn, recording off then this much CPU (ms) in a busy loop")
    parser.add_argument("--control-ops-cpu-ms", type=float, default=None,
                        help="with --interleaved: a turn of the recorded pass's device ops without moetrace, then this much CPU (ms) in a busy loop")
    add_pacing_arguments(parser)
    parser.add_argument("--label", default="now", help="results go to benchmarks/results/pass_bound-LABEL.json")
    args = parser.parse_args()
    if (args.control_cpu_ms is not None or args.control_ops_cpu_ms is not None) and not args.interleaved:
        parser.error("--control-cpu-ms and --control-ops-cpu-ms need --interleaved: a control takes its turn beside the recording")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results: dict[str, object] = {"seconds_per_case": args.seconds, "pass_ms": args.pass_ms, "torch_threads": torch.get_num_threads(), "moetrace": str(Path(moetrace.__file__).parent),
                                  "load_average_start": os.getloadavg()[0], "interleaved": args.interleaved,
                                  "control_cpu_ms": args.control_cpu_ms, "control_ops_cpu_ms": args.control_ops_cpu_ms}
    with tempfile.TemporaryDirectory(prefix="moetrace-pass-bound-") as tmp:
        for mode in args.modes:
            results[mode] = mode_cases(Path(tmp), mode, args.seconds, args.segment_seconds, pass_s=args.pass_ms / 1e3, interleaved=args.interleaved,
                                       control_cpu_s=None if args.control_cpu_ms is None else args.control_cpu_ms / 1e3,
                                       ops_cpu_s=None if args.control_ops_cpu_ms is None else args.control_ops_cpu_ms / 1e3)
    print(write_results(f"pass_bound-{args.label}", results))


if __name__ == "__main__":
    main()
