"""GPU verification: every CUDA-only claim of the hot-path contract, checked in one command.

Run: ``make gpu-check`` (``python benchmarks/gpu_check.py [--quick] [--sizes dsv3|tiny]``).

Checks, each a row of the printed table (the script exits non-zero if any fails). Every check
has a negative control, a row ``control``: the same check run on a deliberately broken part,
which must fail (its row passes when the check caught the fault). The checks' logic is
device-agnostic and runs on CPU in CI (tests/benchmarks/test_gpu_check.py) with the CPU
stand-ins noted below; the GPU run reports the real thing.

1. ``sync-debug``: every recorder hook and pass end in every mode (and with timing, and the
   capturer) under ``torch.cuda.set_sync_debug_mode("error")`` (CPU:
   ``assert_no_host_sync()``), over enough passes to reach every flush, checkpoint, window wrap
   and segment rotation (thresholds shrunk; the row says how many of each ran). Sync-debug does
   not see ``cudaEventSynchronize`` (torch skips its warning there), so a tripwire on
   ``Event/Stream.synchronize`` and ``torch.cuda.synchronize`` covers that blind spot.
   Controls: a hook with an injected ``.item()``; one with an injected ``event.synchronize()``.
2. ``cuda-graph``: a reference EP layer (padded exchange) with padded rows masked to -1 inside
   the graph (as SGLang does), captured **before** recording starts, then replayed with varying
   real token counts: off, on, off, on; counts, per-pass rows and per-token ids equal the oracle
   in every mode, and replays while stopped leave the device counters at zero (CPU:
   ``moetrace.testing.CpuGraph``). Control: a gate stuck on.
3. ``capturer``: built with ``device="cuda"`` (no index); pinned asynchronous copies;
   per-request routes after 100 interleaved passes equal each request's solo run and the ids
   given. Control: a capturer that copies the wrong rows.
4. ``ep-nccl``: the reference EP layer on NCCL (one rank), exact and padded exchange, equal to
   the dense oracle; the padded forward with its NCCL all-to-all captured in a CUDA graph and
   replayed. Two NCCL ranks need two GPUs (NCCL refuses two ranks on one device); on a
   one-GPU machine that row says so. One-rank all-to-all is a self-copy.
5. ``overhead``: DeepSeek-V3 layer sizes (hidden 7168, 256 experts, top-8): 8192 tokens of
   prefill and 64 tokens of decode on a layer sized for decode (decode also replayed as a CUDA
   graph), plain against each mode, variants interleaved round by round; device time (CUDA
   events around calls queued back to back) and host wall time per call (synchronised before
   and after each call) side by side.

Writes ``benchmarks/results/gpu_check.json`` and the GPU section of ``docs/benchmarks.md``
(also when a check raised: every check runs inside its guard). On a machine without CUDA it
prints ``no CUDA device: GPU checks skipped`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results
from pass_bound import mode_cases

from moetrace import ExpertDistributionRecorder, NoOpRecorder, RecorderConfig
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.recording.window import StatWindow
from moetrace.reference.ep import EPMoELayer
from moetrace.reference.experts import SwiGLUExperts
from moetrace.reference.gate import TopKRouter
from moetrace.reference.launcher import free_port
from moetrace.reference.moe import MoELayer
from moetrace.testing import CpuGraph, HostSyncError, assert_no_host_sync
from moetrace.trace import open_trace

__all__ = [
    "SIZES", "CheckResult", "Sizes", "build_layer", "capturer_check", "event_sync_tripwire", "format_table",
    "graph_check", "host_sync_guard", "main", "parse_args", "sync_check",
]

MODES = ("stat", "per_pass", "per_token")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"
# Thresholds shrunk so that SYNC_PASSES passes reach every flush, checkpoint, window wrap and rotation.
SHRUNK = {"window": 8, "stream_chunk_passes": 4, "stream_chunk_tokens": 96, "segment_seconds": 0.002, "on_overflow": "drop"}
SYNC_PASSES = 60
PASS_BOUND_SECONDS = 60.0  # per case of the pass-bound row (a quarter with --quick)
PASS_GAP_S = 0.001  # host time between the sync check's passes (60 ms in all: about 30 rotations of 2 ms)


@dataclass(frozen=True)
class Sizes:
    """One workload's shape: hidden ``H``, expert FFN ``I``, experts ``E``, top-k, tokens."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    prefill_tokens: int
    decode_tokens: int
    capacity_factor: float = 1.25


SIZES = {
    # DeepSeek-V3: hidden 7168, moe_intermediate_size 2048, 256 routed experts, top-8.
    "dsv3": Sizes(hidden=7168, intermediate=2048, experts=256, top_k=8, prefill_tokens=8192, decode_tokens=64),
    "tiny": Sizes(hidden=64, intermediate=32, experts=16, top_k=4, prefill_tokens=64, decode_tokens=8),
}


@dataclass
class CheckResult:
    """One row of the report: ``ok`` is None for a measurement (no pass/fail)."""

    check: str
    case: str
    ok: bool | None
    detail: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", choices=sorted(SIZES), default="dsv3", help="overhead workload sizes (default: dsv3)")
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 20, 5 with --quick)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the GPU section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 5 if args.quick else 20
    if args.rounds <= 0:
        parser.error("--rounds must be positive")
    return args


# ----------------------------------------------------------------------------- workloads
def build_layer(sizes: Sizes, device: str, dtype: torch.dtype, max_tokens: int) -> EPMoELayer:
    """A one-rank EP layer (padded exchange: no host syncs, CUDA-graph friendly) of ``sizes``.

    Expert weights are drawn on the device (``init="fast"``): DeepSeek-V3 sizes hold 11 G
    parameters, too many to draw seeded on the host.
    """
    router = TopKRouter(sizes.hidden, sizes.experts, sizes.top_k, seed=1, dtype=dtype, device=device)
    experts = SwiGLUExperts(sizes.hidden, sizes.intermediate, sizes.experts, seed=2, dtype=dtype, device=device, init="fast")
    return EPMoELayer(router, experts, ep_size=1, ep_rank=0, mode="padded", max_tokens=max_tokens, capacity_factor=sizes.capacity_factor)


def resized(layer: EPMoELayer, max_tokens: int) -> EPMoELayer:
    """The same weights in a padded layer whose static buffers are sized for ``max_tokens``."""
    return EPMoELayer(layer.router, layer.experts, ep_size=1, ep_rank=0, mode="padded", max_tokens=max_tokens, capacity_factor=layer.capacity_factor)


def make_recorder(mode: str, sizes: Sizes, device: str, out_dir: Path, tokens: int, timing: bool = False, start: bool = True, **changes: Any) -> ExpertDistributionRecorder:
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=1, num_physical_experts=sizes.experts, top_k=sizes.top_k, mode=mode, device=device,
        output_dir=out_dir, max_tokens_per_pass=tokens, timing=timing, **changes,
    ))
    if start:
        rec.start_record()
    return rec


@contextlib.contextmanager
def recorder(*args: Any, **kwargs: Any) -> Iterator[ExpertDistributionRecorder]:
    """:func:`make_recorder` for the block; stopped and reset after it (no writer thread left behind)."""
    rec = make_recorder(*args, **kwargs)
    try:
        yield rec
    finally:
        if rec.recording:
            rec.stop_record()
        rec.reset()


@contextlib.contextmanager
def sync_errors() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


_MISSING = object()


@contextlib.contextmanager
def event_sync_tripwire() -> Iterator[list[str]]:
    """Host waits that sync-debug does not report raise :class:`HostSyncError` in the block.

    ``cudaEventSynchronize`` (``torch.cuda.Event.synchronize``) is invisible to
    ``set_sync_debug_mode``; ``Stream.synchronize`` and ``torch.cuda.synchronize`` are
    covered too. Python-level: a wait issued from C++ is not seen (moetrace has none).
    Yields the list of the waits refused.
    """
    refused: list[str] = []
    targets = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]
    saved = [(owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)) for owner, name in targets]

    def tripwire(label: str) -> Callable[..., None]:
        def refuse(*args: Any, **kwargs: Any) -> None:
            refused.append(label)
            raise HostSyncError(f"host waits for the device in a hot path: {label} (invisible to sync-debug)")
        return refuse

    for owner, name in targets:
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        setattr(owner, name, tripwire(label))
    try:
        yield refused
    finally:
        for owner, name, original in saved:
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def host_sync_guard(device: torch.device) -> Iterator[None]:
    """Sync-debug "error" on CUDA (``assert_no_host_sync()`` elsewhere) plus :func:`event_sync_tripwire`."""
    with event_sync_tripwire(), (sync_errors() if device.type == "cuda" else assert_no_host_sync()):
        yield


def _random_ids(tokens: int, sizes: Sizes, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, sizes.experts, generator=g, device=device).topk(sizes.top_k, dim=1).indices
    ids[: max(1, tokens // 8), -1] = -1  # padding, which every engine produces
    return ids


Sabotage = Callable[[torch.Tensor], None]


def inject_item(ids: torch.Tensor) -> None:
    """Control: a hook that reads a value on the host."""
    int(ids.sum().item())


class _HostEvent(torch.cuda.Event):
    """CPU stand-in for a CUDA event (the dummy class cannot be built without CUDA): its
    ``synchronize`` is whatever ``torch.cuda.Event.synchronize`` is at the time."""

    def __new__(cls) -> _HostEvent:
        return object.__new__(cls)

    def __init__(self) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None


def inject_event_synchronize(ids: torch.Tensor) -> None:
    """Control: a hook that waits on a CUDA event (sync-debug's blind spot)."""
    event = torch.cuda.Event() if ids.is_cuda else _HostEvent()
    event.record()
    event.synchronize()


# ----------------------------------------------------------------------------- sync-debug
def _count_calls(owner: Any, name: str, counts: dict[str, int], label: str) -> None:
    """Shadow ``owner.name`` (an instance method) by a wrapper that counts calls into ``counts[label]``."""
    method = getattr(owner, name)
    counts.setdefault(label, 0)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[label] += 1
        return method(*args, **kwargs)

    setattr(owner, name, counted)


def sync_check(device: torch.device, out_dir: Path, mode: str, timing: bool = False, sabotage: Sabotage | None = None) -> str:
    """``SYNC_PASSES`` passes of every hook under :func:`host_sync_guard`; fails unless every
    flush / checkpoint / rotation path of ``mode`` ran at least once inside the guard."""
    sizes, tokens = SIZES["tiny"], 32
    ids = [_random_ids(tokens, sizes, str(device), seed) for seed in range(4)]
    send = torch.tensor([ids[0].numel()], device=device)
    dropped = torch.zeros((), dtype=torch.int64, device=device)
    with recorder(mode, sizes, str(device), out_dir, tokens, timing=timing, **SHRUNK) as rec:
        reached: dict[str, int] = {}
        _count_calls(rec._files.session, "rotate", reached, "rotations")
        if mode == "stat":
            _count_calls(rec._files.session, "_checkpoint", reached, "checkpoints")
        else:
            _count_calls(rec._sink, "flush", reached, "flushes")
        if timing and mode != "stat":
            _count_calls(rec._timing._rows, "ordered", reached, "timing flushes")  # each hand-off of /timing rows reads them

        def one_pass(i: int, warm_up: bool = False) -> None:
            with rec.with_forward_pass(), rec.with_current_layer(0):
                with rec.with_phase("route"):
                    rec.on_select_experts(ids[i % 4])
                    if sabotage is not None and not warm_up:
                        sabotage(ids[i % 4])
                with rec.with_phase("dispatch"):
                    rec.on_dispatch(send, send, dropped)

        with rec.disable_this_region():
            one_pass(0, warm_up=True)  # lazy CUDA init, counted nowhere
        with host_sync_guard(device):
            for i in range(SYNC_PASSES):
                one_pass(i)
                time.sleep(PASS_GAP_S)  # a host sleep, not a sync: rotations fall due
        if device.type == "cuda":
            torch.cuda.synchronize()
        if mode == "stat" and rec._sink.pushed <= len(rec._sink.pass_id):
            raise AssertionError("the stat window never wrapped")
        missing = [name for name, n in reached.items() if n == 0]
        if missing:
            raise AssertionError(f"{SYNC_PASSES} passes never reached: {', '.join(missing)}")
        return f"{SYNC_PASSES} passes: " + ", ".join(f"{n} {name}" for name, n in reached.items())


def capturer_sync_check(device: torch.device, sabotage: Sabotage | None = None) -> str:
    sizes = SIZES["tiny"]
    ids = [_random_ids(32, sizes, str(device), seed) for seed in range(4)]
    capturer = RoutedExpertsCapturer(num_layers=2, top_k=sizes.top_k, max_tokens_per_pass=32, num_kv_slots=64, device=device.type)
    with host_sync_guard(device):
        for p in range(SYNC_PASSES):
            capturer.capture(0, ids[p % 4])
            if sabotage is not None:
                sabotage(ids[p % 4])
            capturer.capture(1, ids[(p + 1) % 4])
            capturer.on_forward_end([(p * 32 + i) % 64 for i in range(32)])
    return f"{SYNC_PASSES} passes, staging ring reused {SYNC_PASSES - 2}x"


class _HeldDumpLock:
    """The recorder's lock, through which the dump's thread (``gpu-check-dump``) waits, before
    taking it again, once ``copied`` holds its first window batch: the copy is held outside the lock."""

    def __init__(self, lock: Any, copied: list[object], held: threading.Event, release: threading.Event) -> None:
        self._lock, self._copied, self._held, self._release = lock, copied, held, release

    def __enter__(self) -> None:
        if threading.current_thread().name == "gpu-check-dump" and len(self._copied) == 1 and not self._release.is_set():
            self._held.set()
            if not self._release.wait(60):
                raise TimeoutError("the window copy was never released")
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _BlindCuts(list):  # type: ignore[type-arg]
    """Control: a window whose pass ends see no dump's copy in progress (they overwrite uncopied slots)."""

    def __iter__(self) -> Iterator[Any]:
        return iter(())


def window_cut_check(device: torch.device, out_dir: Path, blind_pass_ends: bool = False) -> str:
    """A ``stat`` dump while recording copies the window on write: its copy is held after the first
    slot (outside the recorder lock) while ``window - 2`` passes overwrite the ring under
    :func:`host_sync_guard` (each pass end first copies its slot, ``non_blocking`` into pinned
    memory on CUDA); the dumped window must equal the routing of the passes at the cut, slot by
    slot. ``blind_pass_ends``: the control, pass ends that do not copy."""
    import moetrace.recording.dump_cuts as dumper_module

    sizes, tokens, window = SIZES["tiny"], 32, SHRUNK["window"]
    before = 2 * window + 4
    ids = [_random_ids(tokens, sizes, str(device), seed) for seed in range(before + window)]
    copied: list[object] = []
    held, release = threading.Event(), threading.Event()
    batch_bytes = dumper_module.WINDOW_BATCH_BYTES
    with recorder("stat", sizes, str(device), out_dir, tokens, **SHRUNK) as rec:
        def one_pass(i: int) -> None:
            with rec.with_forward_pass(), rec.with_current_layer(0):
                rec.on_select_experts(ids[i])

        for i in range(before):
            one_pass(i)
        win = rec._sink
        assert isinstance(win, StatWindow)
        if blind_pass_ends:
            win._cuts = _BlindCuts(win._cuts)
        copy_cut, dumper, done = win.copy_cut, rec._dumper, {}
        lock = dumper._lock  # type: ignore[attr-defined]

        def counted(cut: Any, slots: np.ndarray) -> None:
            copy_cut(cut, slots)
            copied.append(slots)

        win.copy_cut = counted  # type: ignore[method-assign]
        dumper._lock = _HeldDumpLock(lock, copied, held, release)  # type: ignore[attr-defined]
        dumper_module.WINDOW_BATCH_BYTES = 1  # one slot per batch
        dump = threading.Thread(target=lambda: done.setdefault("path", rec.dump_record(out_dir / "window-cut.h5")), name="gpu-check-dump")
        try:
            dump.start()
            if not held.wait(60):
                raise TimeoutError("the dump never began copying the window")
            with host_sync_guard(device):
                for i in range(before, before + window - 2):
                    one_pass(i)
        finally:
            release.set()
            dump.join(60)
            dumper_module.WINDOW_BATCH_BYTES = batch_bytes
            dumper._lock = lock  # type: ignore[attr-defined]
        with open_trace(done["path"]) as trace:
            got = trace.window()
        cut = range(before - window, before)
        if not np.array_equal(got.pass_id[0], np.arange(before - window, before)):
            raise AssertionError(f"window pass ids {got.pass_id[0].tolist()} != {list(cut)}")
        for row, pass_id in enumerate(cut):
            flat = ids[pass_id].cpu().numpy().reshape(-1)
            if not np.array_equal(got.physical_count[0, row, 0], np.bincount(flat[flat >= 0], minlength=sizes.experts)):
                raise AssertionError(f"window row {row} (pass {pass_id}) is not that pass's routing: overwritten before it was copied")
    return f"{window}-slot window, {window - 2} passes overwrote it during the copy: equal to the cut, sync-free"


def check_sync_debug(device: torch.device, out_dir: Path) -> list[CheckResult]:
    results = []
    for mode, timing in [(m, False) for m in MODES] + [("stat", True), ("per_token", True)]:
        results.append(_guarded("sync-debug", f"{mode}{' + timing' if timing else ''} hooks", lambda mode=mode, timing=timing: sync_check(device, out_dir, mode, timing)))
    results.append(_guarded("sync-debug", "capturer capture + on_forward_end", lambda: capturer_sync_check(device)))
    results.append(_guarded("sync-debug", "stat dump's window copy on write", lambda: window_cut_check(device, out_dir)))
    results.append(_control("sync-debug", "stat pass ends blind to the dump's copy", lambda: window_cut_check(device, out_dir, blind_pass_ends=True)))
    results.append(_control("sync-debug", "stat hook + injected .item()", lambda: sync_check(device, out_dir, "stat", sabotage=inject_item)))
    results.append(_control("sync-debug", "per_token + injected event.synchronize", lambda: sync_check(device, out_dir, "per_token", sabotage=inject_event_synchronize)))
    results.append(_control("sync-debug", "capturer + injected event.synchronize", lambda: capturer_sync_check(device, sabotage=inject_event_synchronize)))
    return results


# ----------------------------------------------------------------------------- CUDA graphs
class _CudaGraph:
    """``torch.cuda.CUDAGraph`` behind :class:`~moetrace.testing.CpuGraph`'s interface."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        with torch.cuda.graph(self.graph):
            yield

    def replay(self) -> None:
        self.graph.replay()


def new_graph(device: torch.device) -> _CudaGraph | CpuGraph:
    return _CudaGraph() if device.type == "cuda" else CpuGraph()


class PaddedRows:
    """A recorder front that sets the ids of rows ``>= real[0]`` to -1 on the device before
    counting, as SGLang masks a CUDA graph's padded rows (``num_token_non_padded``)."""

    def __init__(self, rec: ExpertDistributionRecorder, real: torch.Tensor, rows: int) -> None:
        self.rec, self.real = rec, real
        self.row = torch.arange(rows, device=real.device)[:, None]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rec, name)

    def on_select_experts(self, topk_ids: torch.Tensor, layer: int | None = None) -> None:
        self.rec.on_select_experts(torch.where(self.row < self.real, topk_ids, -1), layer)


def graph_check(device: torch.device, out_dir: Path, mode: str, break_gate: bool = False, sizes: Sizes = SIZES["tiny"]) -> str:
    """Capture with recording off, replay off / on / off / on with varying real token counts:
    exact against the router's ids with padded rows -1, and nothing counted while stopped."""
    rows, dtype = sizes.decode_tokens, torch.float32
    layer = build_layer(sizes, str(device), dtype, max_tokens=rows)
    x = torch.zeros(rows, sizes.hidden, device=device, dtype=dtype)
    real = torch.full((1,), rows, dtype=torch.int64, device=device)
    with recorder(mode, sizes, str(device), out_dir, rows, start=False, stream_chunk_tokens=4 * rows, stream_chunk_passes=3) as rec:
        if break_gate:
            rec._counter.set_gate = lambda on: rec._counter.ones.fill_(1)  # control: a gate stuck on
            rec._counter.set_gate(False)
        front = PaddedRows(rec, real, rows)
        graph = new_graph(device)
        with torch.no_grad():
            if device.type == "cuda":  # warm-up on a side stream, as torch.cuda.graph requires
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), rec.disable_this_region():
                    layer(x, front)
                torch.cuda.current_stream().wait_stream(side)
            with graph.capture():  # at "start-up": nothing is recording
                layer(x, front)
        rng = np.random.default_rng(0)
        recorded: list[np.ndarray] = []

        def replay(times: int, keep: bool) -> None:
            for _ in range(times):
                n = int(rng.integers(0, rows + 1))
                x.copy_(torch.randn(rows, sizes.hidden, device=device, dtype=dtype))
                real.fill_(n)
                with torch.no_grad():
                    ids = layer.router(x)[0]
                with rec.with_forward_pass():
                    graph.replay()
                if keep:
                    recorded.append(ids[:n].cpu().numpy())

        replay(3, keep=False)
        rec.start_record()
        replay(6, keep=False)
        rec.stop_record()
        replay(4, keep=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        leaked = int(rec._counter.current.abs().sum())
        if leaked:
            raise AssertionError(f"replays while stopped left {leaked} counts in the device counters (the gate let them through)")
        rec.start_record()
        replay(7, keep=True)
        _compare_dump(rec.dump_record(out_dir / f"graph-{mode}.h5"), mode, recorded, sizes.experts)
        tokens = [len(ids) for ids in recorded]
        return f"captured before recording; 3 off, 6 on, 4 off, 7 on; tokens {tokens} exact"


def _compare_dump(path: Path, mode: str, passes: list[np.ndarray], experts: int) -> None:
    """The trace at ``path`` against the real ids of each pass ``[n, k]`` (one layer)."""
    def counts(ids: np.ndarray) -> np.ndarray:
        flat = ids.reshape(-1)
        return np.bincount(flat[flat >= 0], minlength=experts)

    tokens = np.array([len(ids) for ids in passes])
    with open_trace(path) as trace:
        problems = []
        if not np.array_equal(trace.physical_count().reshape(-1), sum(counts(ids) for ids in passes)):
            problems.append("totals differ from the oracle")
        if int(trace.num_tokens().sum()) != tokens.sum():
            problems.append(f"num_tokens {int(trace.num_tokens().sum())} != {tokens.sum()}")
        if mode == "stat":
            window = trace.window()
            if not np.array_equal(window.num_tokens[0], tokens):
                problems.append(f"window tokens {window.num_tokens[0].tolist()} != {tokens.tolist()}")
        elif mode == "per_pass":
            chunks = list(trace.iter_passes())
            got = np.concatenate([c.physical_count for c in chunks]).reshape(len(passes), -1)
            if not np.array_equal(got, np.stack([counts(ids) for ids in passes])):
                problems.append("per-pass rows differ from the oracle")
            if not np.array_equal(np.concatenate([c.num_tokens for c in chunks]), tokens):
                problems.append("per-pass num_tokens differ")
        else:
            got = np.concatenate([c.topk_ids for c in trace.iter_tokens()])[:, 0]
            if not np.array_equal(got, np.concatenate(passes)):
                problems.append(f"per-token ids differ ({len(got)} rows, {tokens.sum()} real tokens)")
        if problems:
            raise AssertionError("; ".join(problems))


def check_cuda_graph(device: torch.device, out_dir: Path) -> list[CheckResult]:
    results = [_guarded("cuda-graph", f"EP padded, {mode}, off/on/off/on", lambda mode=mode: graph_check(device, out_dir, mode)) for mode in MODES]
    results.append(_control("cuda-graph", "stat with a gate stuck on", lambda: graph_check(device, out_dir, "stat", break_gate=True)))
    return results


# ----------------------------------------------------------------------------- capturer
def capturer_check(device: torch.device, wrong_rows: bool = False) -> str:
    """100 passes of 8 interleaved requests vs each request run alone and vs the ids given."""
    num_layers, top_k, experts, reqs, per_pass = 3, 4, 64, 8, 4
    passes = 100
    seq_len = passes * per_pass  # tokens per request: one chunk of per_pass tokens each pass

    def routes(req: int, pos: torch.Tensor, layer: int) -> torch.Tensor:
        base = (req * 7919 + pos[:, None] * 31 + layer * 101 + torch.arange(top_k, device=device)[None] * 17) % experts
        return base.to(torch.int64)

    def run(requests: list[int], slots: torch.Tensor) -> dict[int, np.ndarray]:
        # "cuda" without an index, as users write it: the capturer resolves it to the tensors' device.
        cap = RoutedExpertsCapturer(num_layers, top_k, max_tokens_per_pass=reqs * per_pass, num_kv_slots=reqs * seq_len, device=device.type)
        if wrong_rows:  # control: every pass's rows land one token off
            original = cap.capture
            cap.capture = lambda layer, ids: original(layer, ids.roll(1, 0))  # type: ignore[method-assign]
        for step in range(passes):
            pos = torch.arange(step * per_pass, (step + 1) * per_pass, device=device)
            for layer in range(num_layers):
                cap.capture(layer, torch.cat([routes(r, pos, layer) for r in requests]))
            cap.on_forward_end(torch.cat([slots[r, step * per_pass : (step + 1) * per_pass] for r in requests]))
        return {r: cap.get_routed_experts(slots, r, seq_len) for r in requests}

    rng = np.random.default_rng(0)
    slots = torch.as_tensor(rng.permutation(reqs * seq_len).reshape(reqs, seq_len))  # req_to_token: a tensor, as the capturer requires
    together = run(list(range(reqs)), slots)
    for r in range(reqs):
        alone = run([r], slots)[r]
        if not np.array_equal(together[r], alone):
            raise AssertionError(f"request {r}: batched routes differ from its solo run")
        truth = torch.stack([routes(r, torch.arange(seq_len, device=device), layer) for layer in range(num_layers)], 1).cpu().numpy()
        if not np.array_equal(alone, truth):
            raise AssertionError(f"request {r}: captured routes differ from the ids given")
    return f"{reqs} requests x {seq_len} tokens over {passes} passes, exact"


def check_capturer(device: torch.device) -> list[CheckResult]:
    return [
        _guarded("capturer", "8 interleaved requests vs solo", lambda: capturer_check(device)),
        _control("capturer", "a capturer copying the wrong rows", lambda: capturer_check(device, wrong_rows=True)),
    ]


# ----------------------------------------------------------------------------- NCCL
def check_ep_nccl(out_dir: Path) -> list[CheckResult]:
    import torch.distributed as dist

    results: list[CheckResult] = []

    def init() -> str:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        return "one rank"

    results.append(_guarded("ep-nccl", "init_process_group(nccl)", init))
    if results[-1].ok is not True:
        return results
    try:
        sizes, device = SIZES["tiny"], "cuda"
        router = TopKRouter(sizes.hidden, sizes.experts, sizes.top_k, seed=3, device=device)
        experts = SwiGLUExperts(sizes.hidden, sizes.intermediate, sizes.experts, seed=4, device=device)
        dense = MoELayer(router, experts)
        x = torch.randn(48, sizes.hidden, device=device)
        with torch.no_grad():
            want = dense(x, NoOpRecorder())

        def compare(got: torch.Tensor) -> str:
            err = float((got - want).abs().max())
            if err > 1e-4:
                raise AssertionError(f"max |EP - dense| = {err:.3g}")
            return f"max |EP - dense| = {err:.2e}"

        for mode in ("exact", "padded"):
            layer = EPMoELayer(router, experts, ep_size=1, ep_rank=0, mode=mode, max_tokens=64)

            def eager(layer: EPMoELayer = layer) -> str:
                with torch.no_grad():
                    return compare(layer(x, NoOpRecorder()))

            results.append(_guarded("ep-nccl", f"{mode} exchange == dense oracle", eager))

        def padded_in_graph() -> str:
            layer = EPMoELayer(router, experts, ep_size=1, ep_rank=0, mode="padded", max_tokens=64)
            with recorder("per_pass", sizes, device, out_dir, 64, start=False) as rec:
                graph = _CudaGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.no_grad(), torch.cuda.stream(side):
                    layer(x, rec)
                torch.cuda.current_stream().wait_stream(side)
                with torch.no_grad(), graph.capture():
                    out = layer(x, rec)
                rec.start_record()
                with sync_errors():
                    for _ in range(10):
                        with rec.with_forward_pass():
                            graph.replay()
                rec.stop_record()  # settles the last snapshot copy
                counted = int(rec.snapshot().physical_count.sum())
                if counted != 10 * x.shape[0] * sizes.top_k:
                    raise AssertionError(f"10 graph replays counted {counted} copies, want {10 * x.shape[0] * sizes.top_k}")
                return "NCCL all-to-all in a CUDA graph, 10 replays: " + compare(out)

        results.append(_guarded("ep-nccl", "padded, all-to-all in a CUDA graph", padded_in_graph))
        if torch.cuda.device_count() < 2:
            results.append(CheckResult("ep-nccl", "2 ranks in a CUDA graph", None, "not run: NCCL needs one GPU per rank, this machine has 1"))
        else:
            results.append(CheckResult("ep-nccl", "2 ranks in a CUDA graph", None, "not implemented in this script (needs a 2-process launch)"))
        return results
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- overhead
def check_overhead(sizes: Sizes, rounds: int, out_dir: Path) -> tuple[list[CheckResult], dict[str, Any]]:
    dtype = torch.bfloat16
    prefill = build_layer(sizes, "cuda", dtype, max_tokens=sizes.prefill_tokens)
    decode = resized(prefill, sizes.decode_tokens)  # padded buffers and bmm sized for decode, not prefill
    figures: dict[str, Any] = {}
    rows = []
    with contextlib.ExitStack() as stack:
        variants: dict[str, Any] = {"plain": NoOpRecorder()}
        for mode in MODES:
            variants[mode] = stack.enter_context(recorder(mode, sizes, "cuda", out_dir, sizes.prefill_tokens))
        variants["stat + timing"] = stack.enter_context(recorder("stat", sizes, "cuda", out_dir, sizes.prefill_tokens, timing=True))
        for workload, layer, tokens, graphed in (
            ("prefill", prefill, sizes.prefill_tokens, False),
            ("decode", decode, sizes.decode_tokens, False),
            ("decode graph", decode, sizes.decode_tokens, True),
        ):
            x = torch.randn(tokens, sizes.hidden, device="cuda", dtype=dtype)
            calls = {name: _timed_call(layer, x, rec, graphed) for name, rec in variants.items() if not (graphed and name == "stat + timing")}
            device_ms, host_ms = _event_timed(calls, rounds), _wall_timed(calls, rounds)
            figures[workload] = {
                name: {"device_ms": device_ms[name], "device_ratio": device_ms[name] / device_ms["plain"], "host_ms": host_ms[name], "host_ratio": host_ms[name] / host_ms["plain"]}
                for name in calls
            }
            rows += [
                CheckResult("overhead", f"{workload} ({tokens} tok): {name}/plain", None,
                            f"dev {f['device_ratio']:.3f} wall {f['host_ratio']:.3f} ({f['device_ms']:.3f}/{f['host_ms']:.3f} ms)")
                for name, f in figures[workload].items() if name != "plain"
            ]
    return rows, {"sizes": asdict(sizes), "rounds": rounds, "dtype": str(dtype), "figures": figures}


def check_pass_bound(device: torch.device, out_dir: Path, seconds: float) -> list[CheckResult]:
    """Row 6: recording off and on (``segment_seconds`` 2) for ``seconds`` each, per mode, on ``device``."""
    rows = []
    for mode in MODES:
        cases = mode_cases(out_dir, mode, seconds, [2.0], device=str(device))
        off, on = cases["off"], cases["on_segment_seconds_2"]
        rows.append(CheckResult("pass-bound", f"{mode}: off / on (segment_seconds 2), {on['passes']} passes", None,
                                f"median {off['median_ms']:.2f}/{on['median_ms']:.2f} p99 {off['p99_ms']:.2f}/{on['p99_ms']:.2f} "
                                f"max {off['max_ms']:.1f}/{on['max_ms']:.1f} ms; {on['over_median_5ms']} over median+5 ms"))
    return rows


def _timed_call(layer: EPMoELayer, x: torch.Tensor, rec: Any, graphed: bool) -> Callable[[], None]:
    recording = isinstance(rec, ExpertDistributionRecorder)
    if not graphed:
        def eager() -> None:
            with torch.no_grad(), (rec.with_forward_pass() if recording else contextlib.nullcontext()):
                layer(x, rec)
        return eager
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad(), (rec.disable_this_region() if recording else contextlib.nullcontext()):
        layer(x, rec)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        layer(x, rec)

    def replay() -> None:
        with rec.with_forward_pass() if recording else contextlib.nullcontext():
            graph.replay()
    return replay


def _event_timed(calls: dict[str, Callable[[], None]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median device milliseconds per call of each variant: CUDA events around calls queued back
    to back (the GPU stays busy, so the host's cost is hidden here), rotated order each round."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        events = []
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[name]()
            end.record()
            events.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in events:
            samples[name].append(start.elapsed_time(end))
    return {name: statistics.median(s) for name, s in samples.items()}


def _wall_timed(calls: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median host wall milliseconds per call, synchronised before and after each call (the
    hooks' host cost, which decode pays, shows here), rotated order each round."""
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            calls[name]()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def _control(check: str, case: str, fn: Callable[[], str]) -> CheckResult:
    """A negative control: ``fn`` runs ``check`` on a broken part and must fail."""
    try:
        detail = fn()
    except Exception as exc:
        return CheckResult("control", f"{check}: {case}", True, f"caught: {type(exc).__name__}: {exc}"[:200])
    return CheckResult("control", f"{check}: {case}", False, f"NOT caught (the check passed: {detail})"[:200])


def _guarded(check: str, case: str, fn: Callable[[], str]) -> CheckResult:
    try:
        return CheckResult(check, case, True, fn())
    except Exception as exc:  # a failed check is a row of the report, not a crash of the script
        traceback.print_exc()
        return CheckResult(check, case, False, f"{type(exc).__name__}: {exc}"[:200])


# ----------------------------------------------------------------------------- report
def format_table(results: list[CheckResult], width: int = 80) -> str:
    """The report as text lines that fit ``width`` columns (the detail column is cut)."""
    head = f"{'check':<11}{'case':<40}{'result':<7}detail"
    lines = [head, "-" * min(width, len(head) + 20)]
    for r in results:
        status = "-" if r.ok is None else ("PASS" if r.ok else "FAIL")
        line = f"{r.check:<11}{r.case[:39]:<40}{status:<7}{r.detail}"
        lines.append(line if len(line) <= width else line[: width - 1] + "…")
    return "\n".join(lines)


def write_docs_section(table: str, device: str, command: str) -> None:
    """Replace the text between the GPU markers of docs/benchmarks.md."""
    text = DOCS.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOCS} lacks the {START} / {END} markers")
    body = f"{START}\nMeasured on {device} with `{command}`:\n\n```\n{table}\n```\n{END}"
    DOCS.write_text(text[: text.index(START)] + body + text[text.index(END) + len(END):])


def run_checks(args: argparse.Namespace, out: Path) -> tuple[list[CheckResult], dict[str, Any]]:
    """Every check (each inside its guard: a check that raises is a FAIL row, the rest still run)."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    results: list[CheckResult] = []
    results += check_sync_debug(cuda, out)
    results += check_cuda_graph(cuda, out)
    results += check_capturer(cuda)
    results += check_ep_nccl(out)
    overhead: dict[str, Any] = {}

    def timed() -> str:
        rows, figures = check_overhead(SIZES[args.sizes], args.rounds, out)
        results.extend(rows)
        overhead.update(figures)
        return f"{args.rounds} interleaved rounds"

    results.append(_guarded("overhead", f"{args.sizes} sizes", timed))

    def bound() -> str:
        results.extend(check_pass_bound(cuda, out, PASS_BOUND_SECONDS / (4 if args.rounds < 20 else 1)))
        return "DeepSeek-V3 decode hooks"

    results.append(_guarded("pass-bound", "recording off vs on", bound))
    return results, overhead


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: GPU checks skipped")
        return 0
    device = torch.cuda.get_device_name(0)
    results: list[CheckResult] = []
    overhead: dict[str, Any] = {}
    command = "python benchmarks/gpu_check.py" + (f" {' '.join(argv)}" if argv else " " + " ".join(sys.argv[1:])).rstrip()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            found, overhead = run_checks(args, Path(tmp))
            results += found
    except BaseException as exc:  # even then: the table and the JSON are written
        traceback.print_exc()
        results.append(CheckResult("gpu-check", "the script itself", False, f"{type(exc).__name__}: {exc}"[:200]))
    finally:
        table = format_table(results)
        print(f"moetrace GPU check on {device}, torch {torch.__version__}")
        print(table)
        path = write_results("gpu_check", {"device": device, "command": command.strip(), "results": [asdict(r) for r in results], "overhead": overhead})
        print(f"wrote {path}")
        if not args.no_docs:
            write_docs_section(table, device, command.strip())
    return 1 if any(r.ok is False for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
