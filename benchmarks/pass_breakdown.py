"""Where the long passes of a recording come from (issue 50): each one set against what ran meanwhile.

Run: ``.venv/bin/python benchmarks/pass_breakdown.py [--seconds 20] [--modes stat per_pass per_token]
[--segment-seconds 2] [--pass-ms 20] [--torch-threads 1] [--label NAME]``

The DeepSeek-V3 decode workload of :mod:`pass_bound` (bare, the hooks the whole pass, or paced by
``--pass-ms`` of stand-in device time), recording on, with the recording's steps timed where they
run: on the forward thread, the rotation or checkpoint (``rotate``) and its wait for a free host
buffer (``acquire``: the writer is behind and ``on_overflow="block"`` waits); on the engine's writer
thread, each call to the writer process (``write``: the hand-off's rows down the pipe and written
there; ``rotate_segment``: a segment closed). Per mode: each step's count, total and longest time,
and the passes more than 5 ms over the median grouped by the steps that overlapped them. A
diagnosis, not a figure to compare across checkouts: it wraps internals by name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from deepseek_workload import recorder
from harness import write_results
from pass_bound import OVER_MEDIAN_S, add_pacing_arguments, timed_passes

from moetrace.recording.session import RecordingSession
from moetrace.trace.stream import HostBufferPool
from moetrace.trace.writer_process import RemoteSink

Step = tuple[str, float, float]


def timed(steps: list[Step], owner: type, name: str, step: str) -> None:
    """Wrap ``owner.name`` so that each call appends ``(step, start, end)`` to ``steps``."""
    original: Callable[..., object] = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            steps.append((step, start, time.perf_counter()))

    setattr(owner, name, wrapper)


def breakdown(mode: str, seconds: float, segment_seconds: float, pass_s: float, steps: list[Step]) -> dict[str, object]:
    """One mode's run (``pass_s`` stand-in device time a pass): its passes, its steps, and the long
    passes by the steps overlapping them."""
    with tempfile.TemporaryDirectory(prefix="moetrace-pass-breakdown-") as tmp:
        rec = recorder(mode, Path(tmp), segment_seconds=segment_seconds)
        rec.start_record()
        steps.clear()
        passes = timed_passes(rec, seconds, "cpu", pass_s)
        taken = [step for step in steps if step[2] > passes[0][0]]  # the warm-up's steps left out
        rec.stop_record()
        rec.reset()
    median = statistics.median(d for _, d in passes)
    long = [(t, d) for t, d in passes if d > median + OVER_MEDIAN_S]
    by_step: dict[str, dict[str, float]] = {}
    for step in sorted({s for s, _, _ in taken}):
        times = [b - a for s, a, b in taken if s == step]
        by_step[step] = {"count": len(times), "total_s": sum(times), "max_ms": 1e3 * max(times)}
    overlaps = Counter("+".join(sorted({s for s, a, b in taken if a < t + d and b > t})) or "nothing" for t, d in long)
    return {"passes": len(passes), "median_ms": 1e3 * median, "max_ms": 1e3 * max(d for _, d in passes), "long_passes": len(long),
            "steps": by_step, "long_passes_overlapping": dict(overlaps.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--modes", nargs="*", default=["stat", "per_pass", "per_token"])
    parser.add_argument("--segment-seconds", type=float, default=2.0)
    add_pacing_arguments(parser)
    parser.add_argument("--label", default="now", help="results go to benchmarks/results/pass_breakdown-LABEL.json")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    steps: list[Step] = []
    timed(steps, RecordingSession, "rotate", "rotate")
    timed(steps, HostBufferPool, "acquire", "acquire")
    timed(steps, RemoteSink, "write", "write")
    timed(steps, RemoteSink, "rotate", "rotate_segment")
    results: dict[str, object] = {"seconds": args.seconds, "segment_seconds": args.segment_seconds, "pass_ms": args.pass_ms, "torch_threads": torch.get_num_threads()}
    for mode in args.modes:
        out = results[mode] = breakdown(mode, args.seconds, args.segment_seconds, args.pass_ms / 1e3, steps)
        print(f"{mode}: {out['passes']} passes, median {out['median_ms']:.2f} ms, max {out['max_ms']:.1f} ms, {out['long_passes']} over median + 5 ms", flush=True)
        for step, f in out["steps"].items():  # type: ignore[union-attr]
            print(f"  {step:<15} {f['count']:6d} calls, {f['total_s']:6.2f} s in all, longest {f['max_ms']:7.1f} ms")
        for overlap, count in out["long_passes_overlapping"].items():  # type: ignore[union-attr]
            print(f"  long passes during {overlap}: {count}")
    print(write_results(f"pass_breakdown-{args.label}", results))


if __name__ == "__main__":
    main()
