"""``moetrace demo``: the whole job end to end on the reference runtime.

Serves a batch of mixed-length requests through the reference MoE model on
``--ranks`` expert-parallel gloo ranks with a skewed router, with the recorder
on (``per_token`` mode, which keeps the ``stat`` totals too), phase timing on,
and per-request routed-experts capture on. While it runs, every rank serves a
Prometheus endpoint (per-expert series too, for ``moetrace top``) and a control
endpoint on loopback. Afterwards the per-rank traces are merged into
``<out>/trace.h5`` and analysed, and the demo writes ``report.html``
(``moetrace report``: every figure, offline), ``routes.json`` (every finished
request's routed experts), ``timeline.json`` (Perfetto), ``report.json``,
``placement.json`` and ``heatmap.png``, then prints one screen (80 columns,
about 40 lines: :mod:`.demo_summary`); the full tables are ``moetrace analyze``'s.
``--slow-rank R --slow-ms X`` makes rank R sleep X ms in every layer's expert
compute so that the straggler shows.

Ctrl-C stops serving on every rank at the next step; what was recorded so far
is dumped and merged into a valid trace.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moetrace.analysis.plots import plot_report
from moetrace.dispatch import (
    ep_ideal_bytes,
    ep_padded_bytes,
    exchanged_bytes,
    remote_copies,
    tp_bytes,
)
from moetrace.report.evidence import PlacementView
from moetrace.trace.merge import merge_traces
from moetrace.trace.reader import open_trace
from moetrace.trace.schema import Attr
from moetrace.words import counted

from .demo_summary import DemoSummary, print_summary, say
from .errors import CommandError, guarded
from .timeline import write_timeline

__all__ = ["VOCAB", "DemoSettings", "demo", "planned_tokens", "run_demo"]

#: The demo model's vocabulary.
VOCAB = 512


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """What the demo serves and where it writes."""

    ranks: int = 2
    requests: int = 64
    layers: int = 4
    experts: int = 16
    top_k: int = 2
    skew: float = 1.2
    out: Path = Path("moetrace-demo")
    serve: bool = True
    seed: int = 0
    timing: bool = True
    slow_rank: int | None = None
    slow_ms: float = 0.0


def _planned(settings: DemoSettings, vocab: int) -> list[tuple[int, list[int], int]]:
    """Every request of the demo as ``(index, prompt, new tokens)``: mixed lengths, some prefill-only."""
    rng = np.random.default_rng(settings.seed)
    out = []
    for i in range(settings.requests):
        prompt_len = int(rng.integers(4, 48))
        new_tokens = 0 if i % 9 == 4 else int(rng.integers(2, 12))
        out.append((i, rng.integers(0, vocab, size=prompt_len).tolist(), new_tokens))
    return out


def _requests(settings: DemoSettings, rank: int, vocab: int) -> list[Any]:
    """This rank's share of the demo's requests, with staggered arrivals."""
    from moetrace.reference import Request

    return [Request(rid=f"req-{i}", prompt=prompt, max_new_tokens=new_tokens, arrival_step=i // 4, return_routed_experts=True)
            for i, prompt, new_tokens in _planned(settings, vocab) if i % settings.ranks == rank]


def planned_tokens(settings: DemoSettings) -> int:
    """Tokens the ranks will compute: each prompt once, then one token a pass for every generated token but the last
    (the progress bar's total; the demo's passes carry exactly these)."""
    return sum(len(prompt) + max(new_tokens - 1, 0) for _, prompt, new_tokens in _planned(settings, VOCAB))


def _serve_rank(rank: int, world: int, settings: DemoSettings, counts: Any, events: Any, stop: Any) -> dict[str, Any]:
    """One EP rank: model, recorder, endpoints, serving loop, dump. Runs in a spawned process.

    ``counts``: shared ``[requests served, tokens computed]`` the progress bar shows; ``stop``: a shared
    event the main process sets on Ctrl-C; the rank stops at its next step.
    """
    from moetrace.exporters.prometheus import start_http_server

    import moetrace
    from moetrace.control import serve_control
    from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel, ServingLoop, zipf_bias
    from moetrace.wire import encode_routed_experts

    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=settings.layers + 1,
        num_experts=settings.experts,
        top_k=settings.top_k,
        dense_layers=(0,),  # a dense first layer, as in DeepSeek: MoE layer ids start at 1
        router_bias=tuple(zipf_bias(settings.experts, settings.skew, seed=settings.seed + 1).tolist()),
        seed=settings.seed,
    )
    model = ReferenceMoEModel(config, ep=EPSpec(ep_size=world, ep_rank=rank, mode="exact"))
    if settings.slow_rank == rank:
        model.set_expert_delay(settings.slow_ms / 1e3)
    rank_dir = settings.out / "ranks"
    recorder = moetrace.ExpertDistributionRecorder(
        model.recorder_config(mode="per_token", output_dir=rank_dir, model="reference-demo", max_tokens_per_pass=64, stream_chunk_tokens=4096,
                              timing=settings.timing)
    )
    moetrace.set_recorder(recorder)
    loop = ServingLoop(model, max_running=8, max_tokens_per_pass=64, chunk_size=32, num_kv_slots=2048, max_len=128)
    # From here a Ctrl-C (the whole process group gets SIGINT) stops the loop at its next step, even
    # one that comes while the requests are still being made: the rank still dumps what it recorded.
    # A SIGINT only the main process gets (`kill -INT`) reaches the rank through `stop`. A demo
    # started with SIGINT ignored (a background job of a non-interactive shell) keeps ignoring it.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda *_: loop.stop())
    servers: list[Any] = []
    if settings.serve:
        servers = [start_http_server(0, recorder=recorder, per_expert=True, per_ep_rank=True), serve_control(recorder, per_ep_rank=True)]
        events.put(("urls", rank, servers[0].url, servers[1].url))
    events.put(("ready", rank, "", ""))
    loop.submit(_requests(settings, rank, config.vocab_size))
    recorder.start_record()
    results = []
    try:
        for progress in loop.steps():
            if stop.is_set():
                loop.stop()
            results.extend(progress.new_results)
            with counts.get_lock():
                counts[0] += len(progress.new_results)
                counts[1] += progress.batch_tokens
    finally:
        recorder.stop_record()
        dumped = recorder.dump_record(rank_dir / "trace.h5")
        for server in servers:
            server.close()
    complete = [r for r in results if r.routed_experts is not None and r.finish_reason == "length"]
    example = max(complete, key=lambda r: len(r.output_ids), default=None)
    return {
        "trace": str(dumped),
        "served": len(results),
        "stopped": sum(r.finish_reason == "stopped" for r in results),
        "example": None if example is None else {
            "rid": example.rid,
            "prompt_len": example.prompt_len,
            "output_len": len(example.output_ids),
        },
        "routes": {r.rid: encode_routed_experts(r.routed_experts) for r in complete},
        "model_layers": config.num_layers,
    }


def _bytes_figures(trace_path: Path) -> dict[str, float]:
    """All-to-all bytes over the run: TP, ideal EP, padded EP and what the exact exchange sent."""
    with open_trace(trace_path) as trace:
        attrs = trace.attrs
        hidden, width = int(attrs[Attr.HIDDEN_SIZE]), int(attrs[Attr.DTYPE_BYTES])
        k, ranks = trace.top_k, trace.ep_size
        tokens = int(trace.num_tokens().sum())
        send = trace.send_count()  # [Rf, L, R]
        layers = trace.num_layers
    remote = sum(int(remote_copies(send[r], r).sum()) for r in range(send.shape[0]))  # file row r = EP rank r
    return {
        "tp_all_reduce": float(tp_bytes(tokens, hidden, width) * layers),
        "ep_ideal": float(ep_ideal_bytes(tokens, k, hidden, width) * layers),
        "ep_padded": float(ep_padded_bytes(tokens, k, hidden, width, ranks) * layers),
        "ep_exact_sent": float(exchanged_bytes(remote, hidden, width)),
    }


def _placement_document(view: PlacementView | None) -> dict[str, Any] | None:
    """placement.json: the plan (EPLB phy2log / logcnt) with its in-sample fit and held-out estimate."""
    if view is None:
        return None
    return {
        "num_replicas": view.config.replicas,
        "num_gpus": view.config.gpus,
        "balancedness_before": view.balancedness_before,  # in-sample: the run's own loads
        "balancedness_after": view.balancedness_after,
        "held_out": view.held_out_spread(),
        "phy2log": view.plan.phy2log.tolist(),
        "logcnt": view.plan.logcnt.tolist(),
    }


def run_demo(settings: DemoSettings, console: Console) -> dict[str, Any]:
    """Run the demo; returns a summary (paths and figures). Raises on failure."""
    import torch.multiprocessing as mp

    from moetrace.reference import launch

    started = time.perf_counter()
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "ranks").glob("trace-rank*.h5"):
        stale.unlink()
    ctx = mp.get_context("spawn")
    counts, events, stop = ctx.Array("q", 2), ctx.Queue(), ctx.Event()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["ranks"] = launch(_serve_rank, settings.ranks, settings, counts, events, stop, backend="gloo", timeout=600)
        except BaseException as exc:  # re-raised in the main thread
            outcome["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=target, name="moetrace-demo-launch", daemon=True)
    worker.start()
    say(console, f"serving {counted(settings.requests, 'request')} on {counted(settings.ranks, 'EP rank')} (gloo): a dense layer, then "
                 f"{counted(settings.layers, 'MoE layer')} x {counted(settings.experts, 'expert')}, top-{settings.top_k}, router skew Zipf {settings.skew}")
    interrupted = _watch(settings, console, counts, events, stop, done)
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    ranks = outcome["ranks"]
    return _write_outputs(settings, ranks, interrupted, started, console)


def _watch(settings: DemoSettings, console: Console, counts: Any, events: Any, stop: Any, done: threading.Event) -> bool:
    """The progress bar until every rank is done: the ranks' start-up named as it happens, then tokens computed
    (it moves from the first pass) and requests served. Ctrl-C stops the ranks at their next step; returns
    whether it did."""
    interrupted, ready = False, 0
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=16), TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
               TextColumn("{task.fields[served]}/" + str(settings.requests) + " served"), TimeElapsedColumn())
    console.print(f"starting {counted(settings.ranks, 'rank process')}: torch, gloo, the model, the recorder")
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"starting {counted(settings.ranks, 'rank')}", total=planned_tokens(settings), served=0)
        # Wait on an Event, not Thread.join: a KeyboardInterrupt inside join() can leave
        # the thread reported dead while it still runs (CPython gh-90882).
        while not done.is_set():
            try:
                while True:
                    kind, rank, metrics_url, control_url = events.get_nowait()
                    if kind == "ready":
                        ready += 1
                        bar.update(task, description="serving" if ready == settings.ranks else f"{ready} of {settings.ranks} ranks ready")
                    else:
                        bar.console.print(f"rank {rank}: Prometheus {metrics_url}\n        control {control_url}/status", soft_wrap=True)
            except queue.Empty:
                pass
            try:
                bar.update(task, completed=counts[1], served=counts[0])
                done.wait(timeout=0.2)
            except KeyboardInterrupt:
                if interrupted:
                    raise
                interrupted = True
                stop.set()
                bar.console.print("interrupted: stopping every rank at the next step and keeping what was recorded (Ctrl-C again to abort)")
        bar.update(task, description="served", completed=counts[1], served=counts[0])
    return interrupted


def _save_routes(ranks: list[dict[str, Any]], settings: DemoSettings, path: Path) -> Path | None:
    """routes.json: every finished request's routed experts ``[T, L_model, k]`` (dense layer 0 all -1)."""
    from moetrace.routes import save_routes
    from moetrace.wire import decode_routed_experts

    routes = {rid: decode_routed_experts(payload) for r in ranks for rid, payload in r["routes"].items()}
    if not routes:
        return None
    return save_routes(path, routes, model="reference-demo", num_experts=settings.experts, layer_ids=range(ranks[0]["model_layers"]))


def _write_outputs(settings: DemoSettings, ranks: list[dict[str, Any]], interrupted: bool, started: float, console: Console) -> dict[str, Any]:
    """Merge, analyse, write every file, print the one-screen summary."""
    from moetrace.report import write_report
    from moetrace.report.evidence import gather_evidence

    out = settings.out
    trace = merge_traces([r["trace"] for r in ranks], out / "trace.h5")
    routes_path = _save_routes(ranks, settings, out / "routes.json")
    evidence = gather_evidence([trace], routes_path)
    assert evidence.expert is not None
    report = evidence.expert.report
    document = report.to_dict()
    byte_figures = _bytes_figures(trace)
    placement = _placement_document(evidence.expert.placement)
    public = None if placement is None else {k: v for k, v in placement.items() if k not in ("phy2log", "logcnt")}
    document["demo"] = {"bytes": byte_figures, "placement": public, "interrupted": interrupted}
    files = ["report.html", "trace.h5"]
    timeline, events = None, None
    if report.timing is not None and report.timing.get("passes"):
        timeline = out / "timeline.json"
        events = write_timeline(trace, timeline)
        files.append("timeline.json")
    html = write_report(evidence, out / "report.html")
    (out / "report.json").write_text(json.dumps(document, indent=2))
    files.append("report.json")
    if placement is not None:
        (out / "placement.json").write_text(json.dumps(placement))
        files.append("placement.json")
    if routes_path is not None:
        files.append("routes.json")
    heatmap = plot_report(report, out / "heatmap.png", kind="heatmap")
    files.append("heatmap.png")
    example = next((r["example"] for r in ranks if r["example"] is not None), None)
    if example is not None and evidence.routes is not None:
        example = {**example, "routes": evidence.routes.requests[example["rid"]][1]}
    served = sum(r["served"] for r in ranks)
    print_summary(console, DemoSummary(
        served=served, stopped=sum(r["stopped"] for r in ranks), interrupted=interrupted, seconds=time.perf_counter() - started,
        report=report, bytes=byte_figures, placement=evidence.expert.placement, example=example, out=out, files=files,
        html_bytes=html.stat().st_size, timeline_events=events,
    ))
    return {"trace": trace, "heatmap": heatmap, "report": out / "report.json", "html": html, "timeline": timeline,
            "routes": routes_path, "served": served, "interrupted": interrupted}


@guarded
def demo(
    ranks: Annotated[int, typer.Option("--ranks", min=1, help="Expert-parallel ranks (processes on gloo).")] = 2,
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests to serve.")] = 64,
    moe_layers: Annotated[int, typer.Option("--moe-layers", min=1, help="MoE layers of the demo model (a count; a dense first layer is added before them).")] = 4,
    experts: Annotated[int, typer.Option("--experts", min=1, help="Experts per MoE layer (a multiple of --ranks).")] = 16,
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Experts per token.")] = 2,
    skew: Annotated[float, typer.Option("--skew", min=0.0, help="Zipf exponent of the router's per-expert bias (0 = no skew).")] = 1.2,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")] = Path("moetrace-demo"),
    serve: Annotated[bool, typer.Option("--serve/--no-serve", help="Serve Prometheus and control endpoints on loopback while running.")] = True,
    timing: Annotated[bool, typer.Option("--timing/--no-timing", help="Time route/dispatch/expert/combine per layer and rank.")] = True,
    slow_rank: Annotated[int | None, typer.Option("--slow-rank", min=0, help="Delay this rank's expert compute (with --slow-ms).")] = None,
    slow_ms: Annotated[float, typer.Option("--slow-ms", min=0.0, help="Milliseconds --slow-rank sleeps in every layer's expert phase.")] = 0.0,
) -> None:
    """Serve requests through the reference runtime with moetrace on, then analyse it: a one-screen summary and report.html."""
    if experts % ranks:
        raise CommandError(f"--experts {experts} must be a multiple of --ranks {ranks}")
    if top_k > experts:
        raise CommandError(f"--top-k {top_k} exceeds --experts {experts}")
    if slow_rank is not None and slow_rank >= ranks:
        raise CommandError(f"--slow-rank {slow_rank} is not a rank of --ranks {ranks} (0..{ranks - 1})")
    if (slow_rank is None) != (slow_ms == 0):
        raise CommandError("--slow-rank and --slow-ms go together: give both (e.g. --slow-rank 1 --slow-ms 20)")
    from moetrace.report import require_plotly

    try:
        require_plotly()  # report.html: checked before anything is served
    except ImportError as exc:
        raise CommandError(str(exc)) from None
    run_demo(DemoSettings(ranks=ranks, requests=requests, layers=moe_layers, experts=experts, top_k=top_k, skew=skew, out=out, serve=serve,
                          timing=timing, slow_rank=slow_rank, slow_ms=slow_ms), Console())
