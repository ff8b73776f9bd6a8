"""What a dump costs the forward pass, and the dump's own time, at DeepSeek-V3 decode size (issue 37).

Run: ``.venv/bin/python benchmarks/dump_stall.py [--quick] [--passes 3000 10000] [--label NAME]``

The workload is DeepSeek-V3's decode shape: 58 MoE layers, 288 physical slots, top-8,
256-token passes, recorded through the hooks on this machine's CPU (each pass is the 58
``on_select_experts`` calls and the pass end), with 2 s segments (``segment_seconds=2``;
``--segment-seconds 0``: no time rotations, and in ``stat`` mode no checkpoints, so that what is
left is the dump's own cost).
For every mode (``stat``, ``per_pass``, ``per_token``) and every size (3,000 and 10,000
passes by default), one process:

1. records ``N`` passes, then calls ``dump_record`` on another thread (what the control
   endpoint, an engine's dump endpoint or a periodic dump does) while this thread keeps
   running forward passes until the dump is written: **while recording**;
2. records ``N`` more passes, ``stop_record``, and dumps again the same way (the forward
   passes go on, not recorded): **after stop**.

Figures per case: a normal forward pass (median and max of the 300 passes before the dump),
the longest forward pass while the dump ran (its 99th percentile and the passes over 50 ms)
beside the same figures for as many passes run right after it without a dump (the control:
what the recording's own hand-offs and segment rotations cost over that many passes),
the longest time the dump's threads held the recorder lock that every pass end takes (the
bound on what a pass end can wait for the dump itself), the forward thread's longest wait for
a free host buffer (the segment writer behind), the dump's wall time and its time per dumped
pass, the segments it joined and its seconds in each step (validate, copy, seal, fsync, seen on
this process's threads, and the whole join, which since issue 37's child-process join runs in
a child for segments of this size: :class:`DumpBreakdown`), the 1-minute load average; beside them ``numpy.save`` of the same
rows (per pass and per token), measured in the same process. ``--writers child in-process``
measures each case twice in one run: as shipped (a dump's file written in a child process once it
is 8 MiB or more: :mod:`moetrace.trace.offload`) and with every file written on the dump thread of
this process, as before that child (``CHILD_MIN_BYTES`` out of reach). The API used (``dump_record(path)`` from a thread) is
the same in every moetrace version, so ``PYTHONPATH=<older checkout>`` measures the code
before a change with this very script (``--label before``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_workload import LAYERS, SLOTS, TOKENS, TOP_K, forward, routes
from harness import write_results

import moetrace
from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace import dump as dump_module
from moetrace.trace import integrity, join, offload, open_trace
from moetrace.trace.stream import HostBufferPool
from moetrace.trace.writer import TraceWriter

#: ``--writers``: the smallest dump file sent to a child process (``offload.CHILD_MIN_BYTES``).
WRITERS = {"child": offload.CHILD_MIN_BYTES, "in-process": 1 << 62}
NORMAL = 300  # passes before each dump that give "a normal forward pass"


class TimedLock:
    """The recorder's lock, timed: the longest time a dump's threads (the caller's and the background
    ``moetrace-dump`` thread) held it, which is what a pass end can wait for."""

    def __init__(self, lock: threading.RLock, watched: tuple[str, ...]) -> None:
        self._lock, self._watched = lock, watched
        self._depth, self._since, self.longest = 0, 0.0, 0.0

    def __enter__(self) -> bool:
        self._lock.acquire()
        if threading.current_thread().name in self._watched:
            if self._depth == 0:
                self._since = time.perf_counter()
            self._depth += 1
        return True

    def __exit__(self, *exc: object) -> None:
        if threading.current_thread().name in self._watched:
            self._depth -= 1
            if self._depth == 0:
                self.longest = max(self.longest, time.perf_counter() - self._since)
        self._lock.release()


class DumpBreakdown:
    """Where the dump's time goes: seconds in each step, counted on the dump's threads only.

    Wraps, for the duration of one dump, the steps :func:`moetrace.trace.join.concat_segments` and
    :meth:`TraceWriter.commit <moetrace.trace.writer.TraceWriter.commit>` take: validating each segment
    (``open_trace``), copying its rows (``append_from``), sealing the digests and the ``fsync``.
    """

    THREADS = ("bench-dump", "moetrace-dump")  # the caller's thread (it did every step before issue 37) and the background one

    def __init__(self) -> None:
        self.seconds = {"validate": 0.0, "copy": 0.0, "seal": 0.0, "fsync": 0.0, "join": 0.0}
        self.calls = {name: 0 for name in self.seconds}
        self.segments = 0  # segments handed to join_segments (in a child, its steps are not seen here)
        self._patches = [(join, "open_trace", "validate"), (TraceWriter, "append_from", "copy"), (integrity, "seal", "seal"), (os, "fsync", "fsync"),
                         (dump_module, "join_segments", "join")]
        self.buffer_wait = 0.0  # the longest wait of the forward (main) thread for a free host buffer (writer behind)
        self._saved: list[tuple[object, str, object]] = []

    def _timed(self, original: Callable[..., object], step: str) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            if threading.current_thread().name not in self.THREADS:
                return original(*args, **kwargs)
            start = time.perf_counter()
            if step == "join":
                self.segments += len(args[0])  # type: ignore[arg-type]
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[step] += time.perf_counter() - start
                self.calls[step] += 1

        return timed

    def _waited(self, original: Callable[..., object]) -> Callable[..., object]:
        def acquire(pool: HostBufferPool, block: bool = True) -> object:
            if not block or threading.current_thread() is not threading.main_thread():
                return original(pool, block)
            start = time.perf_counter()
            try:
                return original(pool, block)
            finally:
                self.buffer_wait = max(self.buffer_wait, time.perf_counter() - start)

        return acquire

    def __enter__(self) -> DumpBreakdown:
        self._saved.append((HostBufferPool, "acquire", HostBufferPool.acquire))
        HostBufferPool.acquire = self._waited(HostBufferPool.acquire)  # type: ignore[method-assign]
        for owner, name, step in self._patches:
            original = getattr(owner, name, None)
            if original is None:  # an older moetrace (PYTHONPATH) without this step
                continue
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(original, step))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


def dump_under_load(rec: ExpertDistributionRecorder, ids: list[torch.Tensor], path: Path) -> dict[str, float]:
    """Dump on another thread while this one keeps running forward passes; the figures."""
    lock = rec._lock
    timed = rec._lock = TimedLock(lock, DumpBreakdown.THREADS)  # type: ignore[assignment]
    done = threading.Event()
    result: dict[str, object] = {}

    def dump() -> None:
        start = time.perf_counter()
        try:
            result["path"] = rec.dump_record(path)
        except BaseException as exc:  # reported below
            result["error"] = exc
        result["seconds"] = time.perf_counter() - start
        done.set()

    thread = threading.Thread(target=dump, name="bench-dump")
    during: list[float] = []
    with DumpBreakdown() as breakdown:
        thread.start()
        while not done.is_set():
            during.append(forward(rec, ids))
        thread.join()
    rec._lock = lock  # type: ignore[assignment]
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    with open_trace(result["path"]) as trace:  # type: ignore[arg-type]
        passes = int(trace.num_passes().sum())
        rows = int(trace._file["tokens/topk_ids"].shape[0]) if "tokens/topk_ids" in trace._file else 0
    size = Path(result["path"]).stat().st_size  # type: ignore[arg-type]
    Path(result["path"]).unlink()  # type: ignore[arg-type]
    seconds = float(result["seconds"])  # type: ignore[arg-type]
    return {
        "dump_seconds": seconds, "dumped_passes": passes, "dumped_token_rows": rows, "file_mb": size / 1e6,
        "dump_ms_per_pass": 1e3 * seconds / max(passes, 1), "passes_during_dump": len(during),
        "longest_pass_ms": 1e3 * max(during), "p99_pass_ms": 1e3 * float(np.percentile(during, 99)),
        "longest_lock_hold_ms": 1e3 * timed.longest, "segments_joined": breakdown.segments or breakdown.calls["validate"],
        "passes_over_50ms": sum(t > 0.05 for t in during), "longest_buffer_wait_ms": 1e3 * breakdown.buffer_wait,
        **{f"dump_{step}_seconds": seconds for step, seconds in breakdown.seconds.items()},
    }


def case(tmp: Path, mode: str, passes: int, ids: list[torch.Tensor], segment_seconds: float) -> dict[str, dict[str, float]]:
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=SLOTS, top_k=TOP_K, mode=mode, output_dir=tmp,
        max_tokens_per_pass=TOKENS, segment_seconds=segment_seconds,
    ))
    out: dict[str, dict[str, float]] = {}
    rec.start_record()
    for label in ("while_recording", "after_stop"):
        times = [forward(rec, ids) for _ in range(passes)]
        normal = times[-NORMAL:]
        if label == "after_stop":
            rec.stop_record()
        figures = dump_under_load(rec, ids, tmp / f"{mode}-{label}.h5")
        control = [forward(rec, ids) for _ in range(figures["passes_during_dump"])]  # as many passes again, no dump
        figures.update({"normal_pass_ms": 1e3 * statistics.median(normal), "normal_max_pass_ms": 1e3 * max(normal), "load_average": os.getloadavg()[0],
                        "control_longest_pass_ms": 1e3 * max(control), "control_p99_pass_ms": 1e3 * float(np.percentile(control, 99)),
                        "control_passes_over_50ms": sum(t > 0.05 for t in control)})
        out[label] = figures
        print(f"{mode:<10}{passes:>7} {label:<16} normal {figures['normal_pass_ms']:6.1f} ms (max {figures['normal_max_pass_ms']:6.1f})"
              f"  longest during dump {figures['longest_pass_ms']:8.1f} ms (p99 {figures['p99_pass_ms']:6.1f}; {figures['passes_over_50ms']} over 50 ms)"
              f"  same passes without a dump {figures['control_longest_pass_ms']:8.1f} ms (p99 {figures['control_p99_pass_ms']:6.1f}; {figures['control_passes_over_50ms']} over 50 ms)"
              f"  lock held {figures['longest_lock_hold_ms']:8.1f} ms  dump {figures['dump_seconds']:6.2f} s = {figures['dump_ms_per_pass']:.3f} ms/pass ({figures['dumped_passes']} passes,"
              f" {figures['segments_joined']} segments: validate {figures['dump_validate_seconds']:.2f} s, copy {figures['dump_copy_seconds']:.2f} s,"
              f" seal {figures['dump_seal_seconds']:.2f} s, fsync {figures['dump_fsync_seconds']:.2f} s; join {figures['dump_join_seconds']:.2f} s)  buffer wait {figures['longest_buffer_wait_ms']:.0f} ms  load {os.getloadavg()[0]:.2f}", flush=True)
    rec.reset()
    return out


def numpy_baseline(tmp: Path, passes: int) -> dict[str, float]:
    """``numpy.save`` (no fsync) of the rows a dump of ``passes`` passes holds, per pass and per token."""
    counts = np.random.default_rng(0).integers(0, 64, (passes, LAYERS, SLOTS), dtype=np.int32)
    ids = np.random.default_rng(1).integers(0, SLOTS, (passes * TOKENS, LAYERS, TOP_K), dtype=np.int16)  # 288 slots: int16 ids (2.4 GB at 10,000 passes)
    out = {}
    for name, array in (("per_pass", counts), ("per_token", ids)):
        start = time.perf_counter()
        np.save(tmp / f"{name}.npy", array)
        seconds = time.perf_counter() - start
        (tmp / f"{name}.npy").unlink()
        out[f"{name}_ms_per_pass"] = 1e3 * seconds / passes
        out[f"{name}_us_per_token"] = 1e6 * seconds / (passes * TOKENS)
        out[f"{name}_mb"] = array.nbytes / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 and 1,000 passes")
    parser.add_argument("--passes", type=int, nargs="*", help="sizes (default 3000 10000)")
    parser.add_argument("--modes", nargs="*", default=["stat", "per_pass", "per_token"])
    parser.add_argument("--writers", nargs="*", default=["child"], choices=list(WRITERS),
                        help="where a dump's file is written: child (as shipped), in-process (on the dump thread, as before the child)")
    parser.add_argument("--segment-seconds", type=float, default=2.0, help="RecorderConfig.segment_seconds (0: no time rotations, no stat checkpoints)")
    parser.add_argument("--label", default="now", help="results go to benchmarks/results/dump_stall[-LABEL].json ('now': dump_stall.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = args.passes or ([300, 1000] if args.quick else [3000, 10000])
    ids = routes()
    results: dict[str, object] = {"moetrace": str(Path(moetrace.__file__).parent), "load_average_before": os.getloadavg(), "workload": {
        "layers": LAYERS, "slots": SLOTS, "top_k": TOP_K, "tokens_per_pass": TOKENS, "segment_seconds": args.segment_seconds}, "cases": {}}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for passes in sizes:
            for mode in args.modes:
                for writer in args.writers:
                    offload.CHILD_MIN_BYTES = WRITERS[writer]
                    print(f"-- {writer}", flush=True)
                    results["cases"][f"{mode}/{passes}" + ("" if writer == "child" else f"/{writer}")] = case(tmp, mode, passes, ids, args.segment_seconds)  # type: ignore[index]
            results[f"numpy_save/{passes}"] = base = numpy_baseline(tmp, passes)
            print(f"numpy.save {passes} passes: per_pass counts {base['per_pass_ms_per_pass']:.3f} ms/pass, "
                  f"per_token ids {base['per_token_ms_per_pass']:.3f} ms/pass = {base['per_token_us_per_token']:.3f} us/token", flush=True)
    results["load_average_after"] = os.getloadavg()
    print(f"wrote {write_results('dump_stall' if args.label == 'now' else f'dump_stall-{args.label}', results)}")


if __name__ == "__main__":
    main()
