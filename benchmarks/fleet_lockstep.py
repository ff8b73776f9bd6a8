"""What recording costs a fleet in lockstep (issue 50, item 2): R ranks, a gloo barrier per pass.

Run: ``.venv/bin/python benchmarks/fleet_lockstep.py [--ranks 2 4 8] [--modes stat per_pass per_token]
[--passes 300] [--rounds 3] [--pass-ms 0 30] [--overlap] [--control [--control-cpu-ms MS]] [--label NAME]``

Each of R processes runs the DeepSeek-V3 decode workload through the hooks (:mod:`deepseek_workload`:
58 MoE layers, 288 slots, top-8, 256 tokens a pass), then ``dist.barrier()`` (gloo), which stands in for
the all-to-all: under expert parallelism the next pass waits for the slowest rank, so one rank's pause is
every rank's. ``--pass-ms`` adds that many milliseconds of waiting per pass on every rank, standing in for
the forward's device time (0: the issue's bare workload, where the hooks are the whole pass), after the
hooks or, with ``--overlap``, alongside them (a GPU's host queueing a pass while the device runs). Recording
off and on alternate, ``--rounds`` times ``--passes`` passes each, in one launch (side by side); the figure
per mode and R is the fleet's throughput with recording on over off (medians of the rounds), with the
longest pass and the passes over the median + 5 ms on rank 0 (the fleet's hiccups), and where its passes'
time went: the median CPU of a pass's host work and its wait in the barrier, recording off and on. ``--control``
replaces recording in the "on" rounds with its device ops on plain tensors (the hooks' two per layer
and the pass end's count: :func:`~deepseek_workload.bare_ops`): where ranks outnumber cores, what their sharing the cores costs
with no moetrace host work and no files at all. ``--control-cpu-ms`` adds that many milliseconds of CPU
(a busy loop on the forward thread) to each control pass, after its device ops: whether a pass's host CPU
alone, with nothing of moetrace's, costs the fleet what recording does.
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_workload import bare_ops, burning, forward, paced_forward, recorder, routes
from harness import write_results

from moetrace.reference.launcher import launch


def passes(host_work: Callable[[], object], count: int, pass_s: float, overlapped: bool) -> np.ndarray:
    """``count`` lockstep passes (``host_work`` and the stand-in wait, :func:`~deepseek_workload.paced_forward`,
    then the barrier); ``[count, 3]`` seconds: each whole pass, the CPU its host work took (this thread),
    and its wait in the barrier (for the slowest rank: under ``--overlap`` where the ranks' host work shows)."""
    times = np.empty((count, 3))
    for i in range(count):
        start, cpu = time.perf_counter(), time.thread_time()
        paced_forward(host_work, pass_s, overlapped)
        cpu, waiting = time.thread_time() - cpu, time.perf_counter()
        dist.barrier()
        end = time.perf_counter()
        times[i] = end - start, cpu, end - waiting
    return times


def rank_main(rank: int, world: int, mode: str, output_dir: str, count: int, rounds: int, pass_s: float, overlapped: bool, settings: dict[str, object],
              control_cpu_s: float | None) -> dict[str, object]:
    """One rank: ``rounds`` of recording off then on, ``count`` passes each (``settings``: recorder config fields); its pass times.
    With ``control_cpu_s`` (not ``None``) the "on" rounds run the hooks' device ops on plain tensors instead
    (:func:`~deepseek_workload.bare_ops`), then that many seconds of CPU (:func:`~deepseek_workload.burning`)."""
    out = Path(output_dir) / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    ids = routes(seed=rank)
    rec = recorder(mode, out, **settings)
    hooks = functools.partial(forward, rec, ids)
    bare = None if control_cpu_s is None else burning(bare_ops(ids), control_cpu_s)
    for warm in (hooks, bare):  # warm-up
        if warm is not None:
            passes(warm, 20, pass_s, overlapped)
    off: list[np.ndarray] = []
    on: list[np.ndarray] = []
    for _ in range(rounds):
        off.append(passes(hooks, count, pass_s, overlapped))
        if bare is not None:
            on.append(passes(bare, count, pass_s, overlapped))
            continue
        rec.start_record()  # collective: the run id and the rotation period from rank 0
        on.append(passes(hooks, count, pass_s, overlapped))
        rec.stop_record()
        rec.reset()
    return {"off": off, "on": on}


def summary(result: dict[str, list[np.ndarray]]) -> dict[str, float]:
    """Rank 0's rounds: throughput on / off (median of rounds), pass-time figures with recording on, and
    per case the median host CPU and barrier wait of a pass (:func:`passes`)."""
    off = [len(r) / r[:, 0].sum() for r in result["off"]]
    on = [len(r) / r[:, 0].sum() for r in result["on"]]
    on_all, off_all = np.concatenate(result["on"]), np.concatenate(result["off"])
    on_times = on_all[:, 0]
    median = float(np.median(on_times))
    return {
        "passes_per_s_off": statistics.median(off), "passes_per_s_on": statistics.median(on), "on_over_off": statistics.median(on) / statistics.median(off),
        "median_on_ms": 1e3 * median, "p99_on_ms": 1e3 * float(np.percentile(on_times, 99)), "max_on_ms": 1e3 * float(on_times.max()),
        "over_median_5ms_on": int((on_times > median + 5e-3).sum()), "median_off_ms": 1e3 * float(np.median(off_all[:, 0])),
        "host_cpu_off_ms": 1e3 * float(np.median(off_all[:, 1])), "host_cpu_on_ms": 1e3 * float(np.median(on_all[:, 1])),
        "barrier_off_ms": 1e3 * float(np.median(off_all[:, 2])), "barrier_on_ms": 1e3 * float(np.median(on_all[:, 2])),
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--modes", nargs="*", default=["stat", "per_pass", "per_token"])
    parser.add_argument("--passes", type=int, default=300, help="passes per round and case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pass-ms", type=float, nargs="*", default=[0.0], help="stand-in device time per pass (ms)")
    parser.add_argument("--overlap", action="store_true", help="the hooks run alongside the stand-in device time (a GPU's host queueing ahead), not before it")
    parser.add_argument("--segment-seconds", type=float, default=None, help="RecorderConfig.segment_seconds (default: the recorder's)")
    parser.add_argument("--control", action="store_true",
                        help='the "on" rounds run the hooks\' device ops on plain tensors, without moetrace: what the ranks sharing this machine\'s cores costs by itself')
    parser.add_argument("--control-cpu-ms", type=float, default=0.0, help="with --control: CPU (ms) a control pass burns after its device ops")
    parser.add_argument("--label", default="now")
    args = parser.parse_args()
    control_cpu_s = args.control_cpu_ms / 1e3 if args.control else None
    settings = {} if args.segment_seconds is None else {"segment_seconds": args.segment_seconds}
    results: dict[str, object] = {"settings": settings, "passes": args.passes, "rounds": args.rounds, "overlapped": args.overlap, "control": args.control, "control_cpu_ms": args.control_cpu_ms, "load_average_start": os.getloadavg()[0]}
    for pass_ms in args.pass_ms:
        for world in args.ranks:
            for mode in args.modes:
                with tempfile.TemporaryDirectory(prefix="moetrace-lockstep-") as tmp:
                    [first, *_] = launch(rank_main, world, mode, tmp, args.passes, args.rounds, pass_ms / 1e3, args.overlap, settings, control_cpu_s, backend="gloo", threads_per_rank=1, timeout=3600)
                figures = summary(first)
                results[f"pass_ms_{pass_ms:g}/R{world}/{mode}"] = figures
                print(f"pass {pass_ms:4g} ms  R={world}  {mode:<10} on/off {figures['on_over_off']:.3f}  ({figures['passes_per_s_on']:.1f} vs {figures['passes_per_s_off']:.1f} passes/s;"
                      f" on: median {figures['median_on_ms']:.1f} p99 {figures['p99_on_ms']:.1f} max {figures['max_on_ms']:.1f} ms,"
                      f" {figures['over_median_5ms_on']} over median+5 ms; host CPU {figures['host_cpu_off_ms']:.2f} -> {figures['host_cpu_on_ms']:.2f} ms,"
                      f" barrier {figures['barrier_off_ms']:.1f} -> {figures['barrier_on_ms']:.1f} ms; load {figures['load_average']:.2f})", flush=True)
    print(write_results(f"fleet_lockstep-{args.label}", results))


if __name__ == "__main__":
    main()
