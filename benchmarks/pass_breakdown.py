"""Where the long passes of a recording come from (issue 50): each one set against what ran meanwhile.

Run: ``.venv/bin/python benchmarks/pass_breakdown.py [--seconds 20] [--modes stat per_pass per_token] [--control-cpu-ms MS]
[--segment-seconds 2] [--pass-ms 20] [--torch-threads 1] [--label NAME]``

The DeepSeek-V3 decode workload of :mod:`pass_bound` (bare, the hooks the whole pass, or paced by
``--pass-ms`` of stand-in device time), recording on, with the recording's steps timed where they
run: on the forward thread, the rotation or checkpoint (``rotate``) and its wait for a free host
buffer (``acquire``: the writer is behind and ``on_overflow="block"`` waits), and a part of a
checkpoint's window copied at a pass end (``window_copy``); on the engine's writer thread, each
call to the writer process (``write``: the hand-off's rows down the pipe and written there;
``rotate_segment``: a segment closed); on any thread, Python's garbage collector (``gc0``-``gc2``,
by generation). Per mode: each step's count, total and longest time, the passes more than 5 ms
over the median grouped by the steps that overlapped them, and the forward thread's page faults
over all its passes.

Each long pass is also split by where its threads were (Linux ``/proc/.../schedstat``, read before
and after every pass): the forward thread on a core, waiting for one (runnable, another task on
it), or off one beyond the pass's stand-in sleep (blocked: the GIL, a lock, a page fault's I/O),
with its page faults (``getrusage``), the machine's stolen time (a virtual machine's host ran
something else: ``/proc/stat``), and the CPU the engine's writer thread and the writer process used
meanwhile; and over the whole run, each of those three's seconds on a core (``on_core_s``).

With ``--control-cpu-ms MS`` the recorded passes take turns with control passes (the hooks of a
recorder that is not recording, then MS of CPU in a busy loop), split the same way under
``control``: the same host and about the same CPU a pass, with nothing of moetrace's, so a long
recorded pass can be told from one the host would have made anyway. A diagnosis, not a figure to
compare across checkouts: it wraps internals by name.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from deepseek_workload import forward, recorder, routes
from harness import write_results
from pass_bound import OVER_MEDIAN_S, add_pacing_arguments, alternating_passes, control_works

from moetrace.recording.session import RecordingSession
from moetrace.recording.window import StatWindow
from moetrace.trace.stream import HostBufferPool
from moetrace.trace.writer_process import RemoteSink

Step = tuple[str, float, float]


def timed_collections(steps: list[Step]) -> None:
    """Append ``("gc0" | "gc1" | "gc2", start, end)`` to ``steps`` for each run of Python's cyclic
    garbage collector (any thread: it runs in the one whose allocation set it off, holding the GIL)."""
    started: list[float] = []

    def collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            steps.append((f"gc{info['generation']}", started.pop(), time.perf_counter()))

    gc.callbacks.append(collection)


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


class Schedstat:
    """One Linux task's ``/proc/<pid>/task/<tid>/schedstat``: nanoseconds on a core, and waiting for one."""

    def __init__(self, pid: int, tid: int) -> None:
        self._fd = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)

    def read(self) -> tuple[int, int]:
        """``(on a core, runnable but waiting)`` so far, nanoseconds."""
        on_core, waiting, _ = os.pread(self._fd, 128, 0).split()
        return int(on_core), int(waiting)

    def close(self) -> None:
        os.close(self._fd)


class ThreadProbe:
    """Readings around each pass (:func:`pass_bound.alternating_passes`' ``probe``): the forward thread's
    time on a core and waiting for one, the engine's writer thread's and the writer process's time on one."""

    def __init__(self, session: RecordingSession) -> None:
        process = session._process
        if process is None:
            raise SystemExit("pass_breakdown: the recording has no writer process (none could be started); nothing to split")
        self._forward = Schedstat(os.getpid(), threading.get_native_id())
        self._writer_thread = Schedstat(os.getpid(), session.writer._thread.native_id)  # type: ignore[arg-type]
        self._writer_process = Schedstat(process.pid, process.pid)
        self._machine = os.open("/proc/stat", os.O_RDONLY)
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self.readings: list[tuple[int, ...]] = []

    def __call__(self) -> None:
        on_core, waiting = self._forward.read()
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        stolen = int(os.pread(self._machine, 256, 0).split(b"\n", 1)[0].split()[8])  # the "cpu" line's steal, in clock ticks
        self.readings.append((on_core, waiting, self._writer_thread.read()[0], self._writer_process.read()[0], usage.ru_minflt, usage.ru_majflt, stolen))

    def close(self) -> None:
        for stat in (self._forward, self._writer_thread, self._writer_process):
            stat.close()
        os.close(self._machine)

    def on_core_s(self) -> dict[str, float]:
        """Seconds on a core from the first pass's start to the last one's end: the forward thread,
        the engine's writer thread and the writer process."""
        first, last = self.readings[0], self.readings[-1]
        return {name: (last[i] - first[i]) / 1e9 for name, i in (("forward_thread", 0), ("writer_thread", 2), ("writer_process", 3))}

    def split(self, index: int, seconds: float, pass_s: float) -> dict[str, float]:
        """Pass ``index`` (``seconds`` long, ``pass_s`` of it a sleep), milliseconds: the forward
        thread on a core, waiting for one, and blocked beyond the sleep; the writer thread and the
        writer process on a core; the machine's stolen time (all cores); and (counts) the forward
        thread's minor and major page faults."""
        before, after = self.readings[2 * index], self.readings[2 * index + 1]
        on_core, waiting, writer_thread, writer_process, minor, major, stolen = (b - a for a, b in zip(before, after, strict=True))
        return {"ms": 1e3 * seconds, "on_core_ms": on_core / 1e6, "waiting_for_core_ms": waiting / 1e6,
                "blocked_ms": 1e3 * (seconds - pass_s) - (on_core + waiting) / 1e6,
                "writer_thread_ms": writer_thread / 1e6, "writer_process_ms": writer_process / 1e6,
                "stolen_ms": 1e3 * stolen / self._ticks_per_s, "minor_faults": minor, "major_faults": major}


def turn_figures(passes: list[tuple[float, float]], turn: int, turns: int, probe: ThreadProbe, pass_s: float,
                 taken: list[Step]) -> dict[str, object]:
    """The figures of one turn's passes (``passes``: :func:`pass_bound.alternating_passes`' for turn
    ``turn`` of ``turns``, so its pass ``i`` is the probe's pass ``i * turns + turn``): median and
    longest, the long passes by the recording's steps (``taken``) overlapping them, the median
    pass's split and each long one's, and the forward thread's page faults."""
    median = statistics.median(d for _, d in passes)
    long_indices = [i for i, (_, d) in enumerate(passes) if d > median + OVER_MEDIAN_S]
    long = [passes[i] for i in long_indices]
    splits = [probe.split(i * turns + turn, d, pass_s) for i, (_, d) in enumerate(passes)]
    typical = {key: statistics.median(s[key] for s in splits) for key in splits[0]}
    overlaps = Counter("+".join(sorted({s for s, a, b in taken if a < t + d and b > t})) or "nothing" for t, d in long)
    return {"passes": len(passes), "median_ms": 1e3 * median, "max_ms": 1e3 * max(d for _, d in passes), "long_passes": len(long),
            "long_passes_overlapping": dict(overlaps.most_common()),
            "median_pass_split": typical, "long_pass_splits": [splits[i] for i in long_indices],
            "forward_thread_faults": {"minor": sum(s["minor_faults"] for s in splits), "major": sum(s["major_faults"] for s in splits),
                                      "passes_with_faults": sum(1 for s in splits if s["minor_faults"] or s["major_faults"]),
                                      "most_in_a_pass": max(s["minor_faults"] + s["major_faults"] for s in splits)}}


def breakdown(mode: str, seconds: float, segment_seconds: float, pass_s: float, steps: list[Step],
              control_cpu_s: float | None = None) -> dict[str, object]:
    """One mode's run (``pass_s`` stand-in device time a pass): its passes, its steps, the long
    passes by the steps overlapping them, and each long pass split by where its threads were.
    ``control_cpu_s``: the recorded passes take turns with control passes (hooks of a recorder that
    is not recording, then that much CPU in a busy loop: :func:`~deepseek_workload.burning`), whose
    figures are under ``control``: the same host and CPU a pass, nothing of moetrace's."""
    with tempfile.TemporaryDirectory(prefix="moetrace-pass-breakdown-") as tmp:
        rec = recorder(mode, Path(tmp), segment_seconds=segment_seconds)
        rec.start_record()
        session = rec._files.session
        assert session is not None  # every mode keeps files while it records
        probe = ThreadProbe(session)
        steps.clear()
        ids = routes()
        controls = control_works(functools.partial(forward, recorder(mode, Path(tmp)), ids), ids, control_cpu_s)
        turns = alternating_passes([functools.partial(forward, rec, ids), *controls.values()], seconds, pass_s, probe)
        taken = [step for step in steps if step[2] > turns[0][0][0]]  # the warm-up's steps left out
        probe.close()
        rec.stop_record()
        rec.reset()
    by_step: dict[str, dict[str, float]] = {}
    for step in sorted({s for s, _, _ in taken}):
        times = [b - a for s, a, b in taken if s == step]
        by_step[step] = {"count": len(times), "total_s": sum(times), "max_ms": 1e3 * max(times)}
    out = {**turn_figures(turns[0], 0, len(turns), probe, pass_s, taken), "steps": by_step, "on_core_s": probe.on_core_s()}
    if control_cpu_s is not None:
        out["control"] = turn_figures(turns[1], 1, len(turns), probe, pass_s, taken)
    return out


def split_line(name: str, split: dict[str, float]) -> str:
    """One pass's :meth:`ThreadProbe.split`, as a line."""
    return (f"{name:<12} {split['ms']:6.1f} ms: forward thread on a core {split['on_core_ms']:5.1f}, waiting for one {split['waiting_for_core_ms']:5.1f}, "
            f"blocked {split['blocked_ms']:5.1f}, page faults {split['minor_faults']:g} minor {split['major_faults']:g} major; "
            f"writer thread on a core {split['writer_thread_ms']:5.1f}, writer process {split['writer_process_ms']:5.1f}; stolen {split['stolen_ms']:4.0f}")


def print_turn(name: str, figures: dict[str, object], indent: str) -> None:
    """One turn's :func:`turn_figures` as lines, each after ``indent``."""
    print(f"{indent}{name}: {figures['passes']} passes, median {figures['median_ms']:.2f} ms, max {figures['max_ms']:.1f} ms, "
          f"{figures['long_passes']} over median + 5 ms", flush=True)
    for overlap, count in figures["long_passes_overlapping"].items():  # type: ignore[attr-defined]
        print(f"{indent}  long passes during {overlap}: {count}")
    faults = figures["forward_thread_faults"]
    print(f"{indent}  forward thread's page faults in its passes: {faults['minor']} minor, {faults['major']} major, "  # type: ignore[index]
          f"in {faults['passes_with_faults']} passes, at most {faults['most_in_a_pass']} in one")  # type: ignore[index]
    print(f"{indent}  " + split_line("median pass", figures["median_pass_split"]))  # type: ignore[arg-type]
    for split in figures["long_pass_splits"]:  # type: ignore[attr-defined]
        print(f"{indent}  " + split_line("long pass", split))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--modes", nargs="*", default=["stat", "per_pass", "per_token"])
    parser.add_argument("--segment-seconds", type=float, default=2.0)
    parser.add_argument("--control-cpu-ms", type=float, default=None,
                        help="recorded passes take turns with control passes: recording off, then this much CPU (ms) in a busy loop")
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
    timed(steps, StatWindow, "copy_cut", "window_copy")
    timed_collections(steps)
    results: dict[str, object] = {"seconds": args.seconds, "segment_seconds": args.segment_seconds, "pass_ms": args.pass_ms, "torch_threads": torch.get_num_threads(),
                                  "control_cpu_ms": args.control_cpu_ms}
    control_cpu_s = None if args.control_cpu_ms is None else args.control_cpu_ms / 1e3
    for mode in args.modes:
        out = results[mode] = breakdown(mode, args.seconds, args.segment_seconds, args.pass_ms / 1e3, steps, control_cpu_s)
        print_turn(mode, out, "")
        for step, f in out["steps"].items():  # type: ignore[union-attr]
            print(f"  {step:<15} {f['count']:6d} calls, {f['total_s']:6.2f} s in all, longest {f['max_ms']:7.1f} ms")
        on_core = out["on_core_s"]
        print(f"  on a core over the run: forward thread {on_core['forward_thread']:.1f} s, "  # type: ignore[index]
              f"writer thread {on_core['writer_thread']:.1f} s, writer process {on_core['writer_process']:.1f} s")  # type: ignore[index]
        if "control" in out:
            print_turn("control", out["control"], "  ")  # type: ignore[arg-type]
    print(write_results(f"pass_breakdown-{args.label}", results))


if __name__ == "__main__":
    main()
