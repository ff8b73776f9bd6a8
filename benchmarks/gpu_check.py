"""GPU verification: every CUDA-only claim of the hot-path contract, checked in one command.

Run: ``make gpu-check`` (``python benchmarks/gpu_check.py [--quick] [--sizes dsv3|tiny]``).

Checks, each a row of the printed table (the script exits non-zero if any fails):

1. ``sync-debug``: every recorder hook in every mode (and the timing hooks, and the
   capturer's ``capture``) under ``torch.cuda.set_sync_debug_mode("error")``.
2. ``cuda-graph``: a reference MoE layer forward with hooks (EP layer, padded exchange,
   one rank) captured in a CUDA graph while recording, replayed with recording on, off and
   on again: counts exact, the same graph throughout (no re-capture).
3. ``capturer``: pinned asynchronous copies; per-request routes after 100 interleaved passes
   equal each request's solo run.
4. ``ep-nccl``: the reference EP layer on NCCL (one rank), exact and padded exchange, equal to
   the dense oracle; the padded forward with hooks free of syncs.
5. ``overhead``: DeepSeek-V3 layer sizes (hidden 7168, 256 experts, top-8): 8192 tokens of
   prefill and 64 tokens of decode (decode also replayed as a CUDA graph), plain against each
   mode, timed with CUDA events, variants interleaved round by round.

Writes ``benchmarks/results/gpu_check.json`` and the GPU section of ``docs/benchmarks.md``.
On a machine without CUDA it prints ``no CUDA device: GPU checks skipped`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results

from moetrace import ExpertDistributionRecorder, NoOpRecorder, RecorderConfig
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.reference.ep import EPMoELayer
from moetrace.reference.experts import SwiGLUExperts
from moetrace.reference.launcher import free_port
from moetrace.reference.moe import MoELayer
from moetrace.reference.router import TopKRouter

__all__ = ["SIZES", "CheckResult", "Sizes", "build_layer", "format_table", "main", "parse_args"]

MODES = ("stat", "per_pass", "per_token")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"


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


def make_recorder(mode: str, sizes: Sizes, device: str, out_dir: Path, tokens: int, timing: bool = False) -> ExpertDistributionRecorder:
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=1, num_physical_experts=sizes.experts, top_k=sizes.top_k, mode=mode, device=device,
        output_dir=out_dir, max_tokens_per_pass=tokens, timing=timing,
    ))
    rec.start_record()
    return rec


@contextlib.contextmanager
def sync_errors() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _random_ids(tokens: int, sizes: Sizes, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, sizes.experts, generator=g, device=device).topk(sizes.top_k, dim=1).indices
    ids[: max(1, tokens // 8), -1] = -1  # padding, which every engine produces
    return ids


# ----------------------------------------------------------------------------- checks
def check_sync_debug(out_dir: Path) -> list[CheckResult]:
    sizes, device, results = SIZES["tiny"], "cuda", []
    ids = [_random_ids(32, sizes, device, seed) for seed in range(4)]
    send = torch.tensor([ids[0].numel()], device=device)
    dropped = torch.zeros((), dtype=torch.int64, device=device)
    for mode, timing in [(m, False) for m in MODES] + [("stat", True), ("per_token", True)]:
        rec = make_recorder(mode, sizes, device, out_dir, 32, timing=timing)

        def one_pass(rec: ExpertDistributionRecorder = rec) -> None:
            with rec.with_forward_pass(), rec.with_current_layer(0):
                with rec.with_phase("route"):
                    rec.on_select_experts(ids[0])
                with rec.with_phase("dispatch"):
                    rec.on_dispatch(send, send, dropped)

        one_pass()  # the first pass may set things up
        results.append(_guarded("sync-debug", f"{mode}{' + timing' if timing else ''} hooks, 50 passes",
                                lambda one_pass=one_pass: _in_sync_errors(lambda: [one_pass() for _ in range(50)])))
        rec.stop_record()
        rec.reset()
    capturer = RoutedExpertsCapturer(num_layers=2, top_k=sizes.top_k, max_tokens_per_pass=32, num_kv_slots=64, device=device)

    def capture() -> None:
        for p in range(4):
            capturer.capture(0, ids[p])
            capturer.capture(1, ids[(p + 1) % 4])
            capturer.on_forward_end([(p * 32 + i) % 64 for i in range(32)])

    results.append(_guarded("sync-debug", "capturer capture + on_forward_end", lambda: _in_sync_errors(capture)))
    return results


def _in_sync_errors(fn: Callable[[], object]) -> str:
    with sync_errors():
        fn()
    torch.cuda.synchronize()
    return "no synchronising call"


def check_cuda_graph(out_dir: Path) -> list[CheckResult]:
    sizes, device = SIZES["tiny"], "cuda"
    layer = build_layer(sizes, device, torch.float32, max_tokens=sizes.prefill_tokens)
    x = torch.randn(sizes.prefill_tokens, sizes.hidden, device=device)
    rec = make_recorder("stat", sizes, device, out_dir, sizes.prefill_tokens)
    with torch.no_grad():
        expected_ids = layer.router(x)[0]
    per_pass = torch.zeros(sizes.experts, dtype=torch.int64).index_add_(0, expected_ids.reshape(-1).cpu(), torch.ones(expected_ids.numel(), dtype=torch.int64))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad(), rec.disable_this_region():
        layer(x, rec)  # warm-up outside the graph, counted nowhere
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        layer(x, rec)
    graph_id = id(graph)

    def replay(times: int) -> None:
        for _ in range(times):
            with rec.with_forward_pass():
                graph.replay()
        torch.cuda.synchronize()

    def counts() -> np.ndarray:
        return np.asarray(rec.snapshot().physical_count, dtype=np.int64).reshape(-1)[: sizes.experts]

    def run() -> str:
        replay(5)
        on = counts()
        rec.stop_record()
        replay(3)  # recording off: the captured ops add zeros
        off = counts()
        rec.start_record()
        replay(2)
        again = counts()
        want = per_pass.numpy()
        problems = []
        if not np.array_equal(on, 5 * want):
            problems.append(f"after 5 replays counts {on.sum()} != {5 * want.sum()}")
        if not np.array_equal(off, on):
            problems.append("replays with recording off changed the counts")
        if not np.array_equal(again, 2 * want):  # start_record begins a fresh recording
            problems.append(f"recording on again: {again.sum()} != {2 * want.sum()}")
        if id(graph) != graph_id:
            problems.append("graph was re-captured")
        if problems:
            raise AssertionError("; ".join(problems))
        return f"5 on + 3 off + 2 on replays of one graph; {int(want.sum())} copies/pass exact"

    return [_guarded("cuda-graph", "EP padded layer, stat mode, on/off/on", run)]


def check_capturer() -> list[CheckResult]:
    """100 passes of 8 interleaved requests vs each request run alone."""
    device, num_layers, top_k, experts, reqs, per_pass = "cuda", 3, 4, 64, 8, 4
    passes = 100
    seq_len = passes * per_pass  # tokens per request: one chunk of per_pass tokens each pass

    def routes(req: int, pos: torch.Tensor, layer: int) -> torch.Tensor:
        base = (req * 7919 + pos[:, None] * 31 + layer * 101 + torch.arange(top_k, device=device)[None] * 17) % experts
        return base.to(torch.int64)

    def run(requests: list[int], slots_of: dict[int, list[int]]) -> dict[int, np.ndarray]:
        cap = RoutedExpertsCapturer(num_layers, top_k, max_tokens_per_pass=reqs * per_pass, num_kv_slots=reqs * seq_len, device=device)
        req_to_token = np.zeros((reqs, seq_len), dtype=np.int64)
        for r in requests:
            req_to_token[r] = slots_of[r]
        for step in range(seq_len // per_pass):
            pos = torch.arange(step * per_pass, (step + 1) * per_pass, device=device)
            for layer in range(num_layers):
                cap.capture(layer, torch.cat([routes(r, pos, layer) for r in requests]))
            cap.on_forward_end([slots_of[r][int(p)] for r in requests for p in range(step * per_pass, (step + 1) * per_pass)])
        return {r: cap.get_routed_experts(req_to_token, r, seq_len) for r in requests}

    def check() -> str:
        rng = np.random.default_rng(0)
        slots = rng.permutation(reqs * seq_len).reshape(reqs, seq_len)
        slots_of = {r: slots[r].tolist() for r in range(reqs)}
        together = run(list(range(reqs)), slots_of)
        for r in range(reqs):
            alone = run([r], slots_of)[r]
            if not np.array_equal(together[r], alone):
                raise AssertionError(f"request {r}: batched routes differ from its solo run")
            truth = torch.stack([routes(r, torch.arange(seq_len, device=device), layer) for layer in range(num_layers)], 1).cpu().numpy()
            if not np.array_equal(alone, truth):
                raise AssertionError(f"request {r}: captured routes differ from the ids given")
        return f"{reqs} requests x {seq_len} tokens over {passes} passes, pinned async copies exact"

    return [_guarded("capturer", f"{reqs} interleaved requests vs solo", check)]


def check_ep_nccl(out_dir: Path) -> list[CheckResult]:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        sizes, device, results = SIZES["tiny"], "cuda", []
        router = TopKRouter(sizes.hidden, sizes.experts, sizes.top_k, seed=3, device=device)
        experts = SwiGLUExperts(sizes.hidden, sizes.intermediate, sizes.experts, seed=4, device=device)
        dense = MoELayer(router, experts)
        x = torch.randn(48, sizes.hidden, device=device)
        with torch.no_grad():
            want = dense(x, NoOpRecorder())
        for mode in ("exact", "padded"):
            layer = EPMoELayer(router, experts, ep_size=1, ep_rank=0, mode=mode, max_tokens=64)

            def compare(layer: EPMoELayer = layer) -> str:
                with torch.no_grad():
                    got = layer(x, NoOpRecorder())
                err = float((got - want).abs().max())
                if err > 1e-4:
                    raise AssertionError(f"max |EP - dense| = {err:.3g}")
                return f"max |EP - dense| = {err:.2e}"

            results.append(_guarded("ep-nccl", f"{mode} exchange == dense oracle", compare))
        padded = EPMoELayer(router, experts, ep_size=1, ep_rank=0, mode="padded", max_tokens=64)
        rec = make_recorder("per_pass", sizes, device, out_dir, 64, timing=False)

        def padded_no_sync() -> str:
            with torch.no_grad(), rec.with_forward_pass():
                padded(x, rec)  # warm-up
            with torch.no_grad(), sync_errors():
                for _ in range(10):
                    with rec.with_forward_pass():
                        padded(x, rec)
            torch.cuda.synchronize()
            return "10 passes with hooks, no synchronising call"

        results.append(_guarded("ep-nccl", "padded forward with hooks, sync-free", padded_no_sync))
        return results
    finally:
        dist.destroy_process_group()


def check_overhead(sizes: Sizes, rounds: int, out_dir: Path) -> tuple[list[CheckResult], dict[str, Any]]:
    dtype = torch.bfloat16
    layer = build_layer(sizes, "cuda", dtype, max_tokens=sizes.prefill_tokens)
    variants: dict[str, Any] = {"plain": NoOpRecorder()}
    for mode in MODES:
        variants[mode] = make_recorder(mode, sizes, "cuda", out_dir, sizes.prefill_tokens)
    variants["stat + timing"] = make_recorder("stat", sizes, "cuda", out_dir, sizes.prefill_tokens, timing=True)
    figures: dict[str, Any] = {}
    rows = []
    for workload, tokens, graphed in (("prefill", sizes.prefill_tokens, False), ("decode", sizes.decode_tokens, False), ("decode graph", sizes.decode_tokens, True)):
        x = torch.randn(tokens, sizes.hidden, device="cuda", dtype=dtype)
        calls = {name: _timed_call(layer, x, rec, graphed) for name, rec in variants.items() if not (graphed and name == "stat + timing")}
        ms = _event_timed(calls, rounds)
        base = ms["plain"]
        figures[workload] = {name: {"ms": t, "ratio": t / base} for name, t in ms.items()}
        rows += [CheckResult("overhead", f"{workload} ({tokens} tok): {name} / plain", None, f"{t / base:.3f} ({t:.3f} ms)") for name, t in ms.items() if name != "plain"]
    for rec in variants.values():
        if isinstance(rec, ExpertDistributionRecorder):
            rec.stop_record()
            rec.reset()
    return rows, {"sizes": asdict(sizes), "rounds": rounds, "dtype": str(dtype), "figures": figures}


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
    """Median milliseconds per call of each variant, CUDA events, rotated order each round."""
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: GPU checks skipped")
        return 0
    device = torch.cuda.get_device_name(0)
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results += check_sync_debug(out)
        results += check_cuda_graph(out)
        results += check_capturer()
        results += check_ep_nccl(out)
        try:
            rows, overhead = check_overhead(SIZES[args.sizes], args.rounds, out)
        except Exception as exc:
            traceback.print_exc()
            rows, overhead = [CheckResult("overhead", f"{args.sizes} sizes", False, f"{type(exc).__name__}: {exc}"[:200])], {}
        results += rows
    table = format_table(results)
    print(f"moetrace GPU check on {device}, torch {torch.__version__}")
    print(table)
    command = "python benchmarks/gpu_check.py" + (f" {' '.join(argv)}" if argv else " " + " ".join(sys.argv[1:])).rstrip()
    path = write_results("gpu_check", {"device": device, "command": command, "results": [asdict(r) for r in results], "overhead": overhead})
    print(f"wrote {path}")
    if not args.no_docs:
        write_docs_section(table, device, command.strip())
    return 1 if any(r.ok is False for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
