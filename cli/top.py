"""``moetrace top``: a live terminal view of running ranks, from their metrics endpoints.

Every ``--interval`` seconds it scrapes ``<url>/metrics`` of each ``--url``
(a moetrace control endpoint or Prometheus exporter; a URL ending in
``/metrics`` is used as is) and shows: each endpoint's state and place in the
parallel layout (global rank, TP/EP coordinates, whether its routing replicates
a TP peer's; an endpoint that stops answering is shown as gone, with the
reason), the tokens served over all endpoints (each token once: replica ranks
export 0), balancedness over the EP
ranks and per-rank load bars (loads summed over the endpoints; only from endpoints that export
the ``[layer, ep_rank]`` matrices, ``per_ep_rank=True``, which fleet-sized deployments leave off:
their fleet balance comes from the shipped Prometheus recording rules), the hottest
experts per layer (when an endpoint exports ``per_expert`` series), mean phase
times per rank (over the last interval, from ``moetrace_phase_seconds``; over
the whole recording on the first frame) and the slowest rank by expert time.

``q`` or Ctrl-C quits cleanly. Without a terminal on stdin (or with
``--once``) it prints one frame and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import select
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Annotated

import numpy as np
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from moetrace import PHASES, balance

from .errors import CommandError, guarded

__all__ = ["Endpoint", "render_screen", "scrape", "top"]

BAR_WIDTH = 40


@dataclasses.dataclass
class Endpoint:
    """What one URL answered at the last scrape (``error`` set when it did not)."""

    url: str
    error: str | None = None
    gone: bool = True  # with ``error``: unreachable (True) or answering with an HTTP error (False)
    rank: int | None = None
    info: dict[str, str] = dataclasses.field(default_factory=dict)  # moetrace_info labels: layout, global_rank, tp_rank, replica...
    passes: float = 0.0
    tokens: float = 0.0
    recording: bool = False
    rank_load: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (layer, ep_rank) -> copies
    experts: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (layer, expert) -> copies
    phase_sum: dict[str, float] = dataclasses.field(default_factory=dict)
    phase_count: dict[str, float] = dataclasses.field(default_factory=dict)


def _metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def scrape(url: str, timeout: float = 1.0, token: str | None = None) -> Endpoint:
    """One scrape of ``url`` (bearer ``token`` for a protected control endpoint); never raises for an unreachable or broken endpoint."""
    point = Endpoint(url)
    request = urllib.request.Request(_metrics_url(url), headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
        families = list(text_string_to_metric_families(text))
    except urllib.error.HTTPError as exc:  # it answers, but not with metrics
        hint = "; pass --token" if exc.code == 401 else ""
        point.error, point.gone = f"HTTP {exc.code} {exc.reason}{hint}", False
        return point
    except Exception as exc:  # any other failure (refused, reset mid-response, garbage) shows the endpoint as gone
        reason = getattr(exc, "reason", exc)
        point.error = str(reason) or type(exc).__name__
        return point
    for family in families:
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            if "rank" in labels and point.rank is None:
                point.rank = int(labels["rank"])
            if sample.name == "moetrace_forward_passes_total":
                point.passes = value
            elif sample.name == "moetrace_tokens_total":
                point.tokens = value
            elif sample.name == "moetrace_info":
                point.info = dict(labels)
            elif sample.name == "moetrace_recording":
                point.recording = value == 1
            elif sample.name == "moetrace_rank_routed_tokens_total":
                point.rank_load[(int(labels["layer"]), int(labels["ep_rank"]))] = value
            elif sample.name == "moetrace_expert_routed_tokens_total":
                point.experts[(int(labels["layer"]), int(labels["expert"]))] = value
            elif sample.name == "moetrace_phase_seconds_sum":
                point.phase_sum[labels["phase"]] = value
            elif sample.name == "moetrace_phase_seconds_count":
                point.phase_count[labels["phase"]] = value
    if point.rank is None:
        point.error, point.gone = "no moetrace metrics at this URL (no recorder configured yet?)", False
    return point


def _summed(entries: Iterable[dict[tuple[int, int], float]]) -> dict[tuple[int, int], float]:
    """Key-wise sum of ``{(layer, column): value}`` maps (one per endpoint)."""
    total: dict[tuple[int, int], float] = {}
    for entry in entries:
        for key, value in entry.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _grid(entries: dict[tuple[int, int], float]) -> tuple[list[int], np.ndarray]:
    """``{(layer, column): value}`` -> (sorted layer ids, ``[L, C]`` array)."""
    layers = sorted({layer for layer, _ in entries})
    width = max((c for _, c in entries), default=-1) + 1
    grid = np.zeros((len(layers), width))
    for (layer, column), value in entries.items():
        grid[layers.index(layer), column] += value
    return layers, grid


def _phase_means(now: Endpoint, before: Endpoint | None) -> dict[str, float | None]:
    """Mean seconds per layer-pass of each phase over the last interval (or the whole recording)."""
    out: dict[str, float | None] = {}
    for phase in PHASES:
        total, count = now.phase_sum.get(phase, 0.0), now.phase_count.get(phase, 0.0)
        if before is not None and before.error is None and count > before.phase_count.get(phase, 0.0):
            total -= before.phase_sum.get(phase, 0.0)
            count -= before.phase_count.get(phase, 0.0)
        out[phase] = total / count if count > 0 else None
    return out


def _who(point: Endpoint) -> str:
    """``rank 1 [TP2 (TP attention) tp1, replica]``: the endpoint's global rank and coordinates
    (from ``moetrace_info``), or its EP rank alone for endpoints that export no layout."""
    info = point.info
    if not info.get("layout"):
        return f"rank {point.rank}"
    replica = ", replica" if info.get("replica") == "true" else ""
    return f"rank {info['global_rank']} [{info['layout']} tp{info['tp_rank']} ep{point.rank}{replica}]"


def render_screen(points: list[Endpoint], previous: dict[str, Endpoint], interval: float) -> Group:
    """One screen (80 columns) from this scrape and the previous one."""
    lines: list[Text] = [Text(f"moetrace top: {len(points)} endpoint(s), every {interval:g} s; q or Ctrl-C quits   "
                              f"{time.strftime('%H:%M:%S')}", style="bold")]
    for p in points:
        if p.error is not None:
            lines.append(Text(f"  {p.url}: {'GONE' if p.gone else 'ERROR'} ({p.error})"[:79], style="red"))
        else:
            state = "recording" if p.recording else "stopped"
            lines.append(Text(f"  {_who(p)}: {state}, {p.passes:.0f} passes  {p.url}"[:79]))
    live = [p for p in points if p.error is None]
    if live:
        replicas = sum(p.info.get("replica") == "true" for p in live)
        note = f" ({replicas} replica rank(s) route the same tokens as a peer: counted once)" if replicas else ""
        lines.append(Text(f"tokens served: {sum(p.tokens for p in live):.0f}{note}"[:79], style="bold"))
    loads = _summed(p.rank_load for p in live)
    if loads:
        layers, load = _grid(loads)  # [L, R] summed over the endpoints (every source rank)
        lines.append(Text(f"balancedness over {load.shape[1]} EP ranks: {balance.balancedness(load):.3f}  "
                          f"(1 = even; layers {layers[0]}..{layers[-1]})", style="bold"))
        per_rank = load.sum(axis=0)
        top = per_rank.max() or 1.0
        mean = per_rank.mean() or 1.0
        for r, value in enumerate(per_rank):
            bar = "#" * round(BAR_WIDTH * value / top)
            lines.append(Text(f"  rank {r:>2} {bar:<{BAR_WIDTH}} {value:>10.0f} {value / mean:4.2f}x"))
    experts = _summed(p.experts for p in live)
    if experts:
        layers, counts = _grid(experts)
        lines.append(Text("hottest experts per layer (expert:x mean)", style="bold"))
        for i, layer in enumerate(layers):
            mean = counts[i].mean() or 1.0
            hot = ", ".join(f"{e}:{counts[i, e] / mean:.1f}" for e in np.argsort(-counts[i], kind="stable")[:5])
            lines.append(Text(f"  layer {layer:>3}: {hot}"[:79]))
    elif live:
        lines.append(Text("hottest experts: endpoints export no per-expert series (per_expert=True)", style="dim"))
    timed = [(p, _phase_means(p, previous.get(p.url))) for p in live if p.phase_count]
    if timed:
        lines.append(Text("mean phase time per layer-pass, ms", style="bold"))
        lines.append(Text("  rank " + "".join(f"{phase:>11}" for phase in PHASES)))
        for p, means in sorted(timed, key=lambda item: item[0].rank or 0):
            lines.append(Text(f"  {p.rank:>4} " + "".join("          -" if means[f] is None else f"{means[f] * 1e3:>11.2f}" for f in PHASES)))
        expert = [(means["expert"], p.rank) for p, means in timed if means["expert"] is not None]
        if len(expert) > 1:
            slow, rank = max(expert)
            fast = min(e for e, _ in expert)
            lines.append(Text(f"slowest rank (expert compute): rank {rank}, {slow * 1e3:.2f} ms vs fastest {fast * 1e3:.2f} ms",
                              style="bold yellow"))
    elif live:
        lines.append(Text("phase times: not recorded (RecorderConfig(timing=True))", style="dim"))
    return Group(*lines)


@contextlib.contextmanager
def _keys() -> Iterator[None]:
    """Characters without Enter (cbreak; Ctrl-C still interrupts); the terminal is restored on exit."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_quit(seconds: float) -> bool:
    """Wait up to ``seconds`` for a key; True when it was ``q``."""
    ready, _, _ = select.select([sys.stdin], [], [], seconds)
    return bool(ready) and sys.stdin.read(1).lower() == "q"


@guarded
def top(
    url: Annotated[list[str], typer.Option("--url", help="A rank's control or metrics endpoint (repeat for each rank).")],
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    token: Annotated[str | None, typer.Option("--token", envvar="MOETRACE_CONTROL_TOKEN", help="Bearer token of the control endpoints (or $MOETRACE_CONTROL_TOKEN).")] = None,
) -> None:
    """Live view of running ranks: balance, per-rank load, hottest experts, phase times, slowest rank."""
    if not url:
        raise CommandError("give at least one --url (a rank's control or metrics endpoint)")
    console = Console()
    previous: dict[str, Endpoint] = {}

    def frame() -> Group:
        points = [scrape(u, timeout=min(1.0, interval), token=token) for u in url]
        screen = render_screen(points, previous, interval)
        previous.update({p.url: p for p in points if p.error is None})
        return screen

    if once or not sys.stdin.isatty():
        console.print(frame())
        return
    try:
        with _keys(), Live(frame(), console=console, screen=True, auto_refresh=False) as live:
            while not _wait_for_quit(interval):
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        pass
