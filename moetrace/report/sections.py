"""The report's sections: which exist for the evidence, the one-line reading of each, and its figures.

A section appears only when the inputs hold its data. Every figure's size is bounded
(:data:`MAX_POINTS`, :data:`MAX_HEATMAP_CELLS`, :data:`MAX_REQUESTS`, :data:`MAX_REQUEST_TOKENS`,
``top`` pairs per layer), never proportional to the trace length; a section says when it
summarised (experts grouped, buckets merged, requests or positions left out).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import plotly.graph_objects as go

from .. import balance
from ..replicas.analysis import load_over_time
from ..trace.schema import Attr
from ..words import counted
from . import figures
from .evidence import Evidence, ExpertEvidence, PlacementView, RoutingEvidence, placement_reading

__all__ = [
    "MAX_HEATMAP_CELLS",
    "MAX_POINTS",
    "MAX_REQUESTS",
    "MAX_REQUEST_TOKENS",
    "RouteChoice",
    "Section",
    "build_sections",
]

#: Points per time series at most (neighbouring buckets of passes are merged beyond it).
MAX_POINTS = 400
#: Cells of the expert heatmap at most (adjacent experts are grouped beyond it).
MAX_HEATMAP_CELLS = 65536
#: Requests offered by the routes selector at most (the first, by request id).
MAX_REQUESTS = 200
#: Token positions shown per request at most (the first ones).
MAX_REQUEST_TOKENS = 256
#: Bins of the TTFT histogram and of the replica load timeline.
TTFT_BINS = 40
LOAD_BINS = 200


@dataclasses.dataclass(frozen=True)
class RouteChoice:
    """The request selector's data: one grid per request (``figures.routes_cells``)."""

    figure_id: str
    options: list[dict[str, Any]]  # {"id", "label", "x", "z", "text", "title"}


@dataclasses.dataclass(frozen=True)
class Section:
    """One section: its anchor, heading, one-line reading (words, above the figures) and figures."""

    key: str
    title: str
    reading: str
    figures: list[tuple[str, go.Figure]]
    notes: list[str] = dataclasses.field(default_factory=list)
    choice: RouteChoice | None = None


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


# ----------------------------------------------------------------------------- expert traces
def _headline(ev: ExpertEvidence) -> Section:
    r = ev.report
    d = r.to_dict()
    items = [("expert imbalance (hottest / mean)", r.overall_expert_imbalance, ".2f"),
             (f"share of the hottest {d['overall']['hot_experts']} experts", r.overall_hot_expert_share, ".1%"),
             ("(layer, expert) cells with no token", float(r.dead_experts.sum()), ",.0f")]
    if r.ep_size > 1:
        items.insert(0, (f"rank balancedness over {r.ep_size} EP ranks", r.balancedness, ".3f"))
    a = r.attrs
    what = (f"{a.get(Attr.MODEL) or '-'} on {a.get(Attr.ENGINE) or '-'}, {a.get(Attr.MODE)} trace: {counted(r.num_passes, 'pass')}, "
            f"{counted(r.num_tokens, 'token')}, {counted(len(r.layer_ids), 'MoE layer')} x {counted(r.logical_count.shape[1], 'expert')}, top-{a.get(Attr.TOP_K)}")
    return Section("headline", "Headline", "; ".join(d["headline"]), [("fig-headline", figures.headline(items))], notes=[what, *r.notes])


def _expert_load(ev: ExpertEvidence) -> Section:
    r = ev.report
    counts = r.logical_count
    num_layers, num_experts = counts.shape
    group = max(1, math.ceil(num_layers * num_experts / MAX_HEATMAP_CELLS))
    shown = counts
    notes = []
    if group > 1:
        padded = np.pad(counts, ((0, 0), (0, (-num_experts) % group)))
        shown = padded.reshape(num_layers, -1, group).sum(axis=2)
        notes.append(f"{num_layers} x {num_experts} cells exceed {MAX_HEATMAP_CELLS}: columns group {group} adjacent experts")
    layer, expert = np.unravel_index(int(np.argmax(counts / np.maximum(counts.mean(axis=1, keepdims=True), 1e-12))), counts.shape)
    ratio = counts[layer, expert] / counts[layer].mean() if counts[layer].mean() else 0.0
    reading = (f"hottest: expert {expert} in layer {r.layer_ids[layer]} takes {ratio:.1f}x the layer's mean; "
               f"{counted(int(r.dead_experts.sum()), '(layer, expert) cell')} with no token; routing entropy {r.entropy_ratio.mean():.2f} of uniform")
    return Section("experts", "Expert load per layer", reading, [("fig-experts", figures.expert_heatmap(r.layer_ids, shown, group))], notes)


def _merge_buckets(first_pass: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Sum neighbouring buckets so that at most :data:`MAX_POINTS` remain: ``(first_pass [n'], counts [n', ...], merged)``."""
    merged = max(1, math.ceil(len(first_pass) / MAX_POINTS))
    starts = np.arange(0, len(first_pass), merged)
    return first_pass[starts], np.add.reduceat(counts, starts, axis=0), merged


def _rank_load(ev: ExpertEvidence) -> Section | None:
    r = ev.report
    drift = r.drift
    if r.ep_size <= 1 and drift is None:
        return None
    figs: list[tuple[str, go.Figure]] = []
    parts: list[str] = []
    notes: list[str] = []
    if r.ep_size > 1:
        load = r.rank_load  # [L, R]
        total = load.sum(axis=0)
        hot = int(np.argmax(total))
        parts.append(f"rank {hot} carries {total[hot] / total.mean():.2f}x the mean rank load; balancedness {r.balancedness:.3f}")
        figs.append(("fig-rank-layer", figures.rank_heatmap(r.layer_ids, load)))
        if ev.series is not None:
            first, physical, merged = _merge_buckets(ev.series.first_pass, ev.series.physical)
            per_bucket = np.stack([balance.rank_load(p, r.ep_size) for p in physical])  # [n, L, R]
            share = per_bucket.sum(axis=1)
            share = share / np.maximum(share.sum(axis=1, keepdims=True), 1)
            over_time = np.asarray([balance.balancedness(b) for b in per_bucket])
            size = ev.series.bucket * merged
            figs.append(("fig-rank-time", figures.lines(
                first, {f"rank {i}": share[:, i] for i in range(r.ep_size)}, f"Share of token copies per rank over time ({size} pass{'es' if size > 1 else ''} per point)",
                "first pass of the bucket", "share of copies", secondary={"balancedness": over_time}, secondary_label="balancedness")))
            parts.append(f"over time balancedness {over_time.min():.3f}-{over_time.max():.3f}")
    if drift is not None and len(drift) > 1:
        x = drift.first_pass
        js = np.where(np.isnan(drift.js_mean), None, drift.js_mean)
        jsmax = np.where(np.isnan(drift.js_max), None, drift.js_max)
        figs.append(("fig-drift", figures.lines(x, {"JS mean over layers": js, "JS max layer": jsmax},
                                                f"Drift: JS divergence from the previous window ({counted(drift.passes_per_window, 'pass')} a window)",
                                                "first pass of the window", "JS divergence (bits)")))
        worst = int(np.nanargmax(drift.js_max)) if np.isfinite(drift.js_max).any() else None
        parts.append("drift JS mean " + _f(float(np.nanmean(drift.js_mean[1:])), ".4f")
                     + ("" if worst is None else f", max {drift.js_max[worst]:.4f} (layer {drift.js_max_layer[worst]}, from pass {drift.first_pass[worst]})"))
    elif drift is not None:
        notes.append("one drift window: no drift to show (record more passes or pass a smaller window)")
    if not figs:
        return None
    title = "Rank load per layer and over time, with drift" if r.ep_size > 1 else "Drift over time"
    return Section("ranks", title, "; ".join(parts), figs, notes)


def _timing(ev: ExpertEvidence) -> Section | None:
    t = ev.report.timing
    if t is None or "phase_seconds_by_layer" not in t:
        return None
    seconds = np.asarray(t["phase_seconds_by_layer"], dtype=np.float64)  # [R, L, F]
    labels = t["rank_labels"]
    figs = [("fig-phases", figures.phase_stack(labels, ev.report.layer_ids, t["phases"], seconds))]
    if t.get("step_seconds") is None:
        reading = ("phase totals only: " + ("no expert phase was timed, so stragglers are not judged" if not t.get("expert_timed", True)
                                            else "no pass was timed on every rank"))
        return Section("timing", "Phase time per rank and layer", reading, figs)
    shares = t["slowest_rank_share"]
    slowest = int(np.argmax(shares))
    wait = t["wait_share"]
    reading = (f"rank {labels[slowest]} is the slowest (expert compute) in {100 * shares[slowest]:.0f}% of {counted(t['passes'], 'pass')}; "
               f"waiting for the slowest costs {t['wait_seconds']:.3f} s" + ("" if wait is None else f" = {100 * wait:.1f}% of step time")
               + f"; step mean {1e3 * t['step_seconds']['mean']:.1f} ms")
    figs.append(("fig-rank-time-split", figures.bar_groups(
        [f"rank {r}" for r in labels],
        {"expert compute": t["expert_seconds_by_rank"], "expert idle (waiting)": t["expert_wait_seconds_by_rank"],
         "exchange excess": t["exchange_excess_seconds_by_rank"]},
        "Per rank: expert compute, idle time waiting for the slowest, exchange time above the fastest rank", "seconds")))
    return Section("timing", "Phase time per rank and layer", reading, figs)


def _placement(ev: ExpertEvidence) -> Section | None:
    rows = [row.to_dict() for row in ev.report.ep_projection]
    view = ev.placement
    if not rows and view is None:
        return None
    figs: list[tuple[str, go.Figure]] = []
    parts: list[str] = []
    if rows:
        extra = rows[0]["redundant_slots"] // rows[0]["ranks"]
        figs.append(("fig-projection", figures.bar_groups(
            [f"R={row['ranks']}" for row in rows],
            {"contiguous": [row["contiguous_balancedness"] for row in rows], "planned": [row["planned_balancedness"] for row in rows],
             f"planned +{extra}/rank": [row["planned_redundant_balancedness"] for row in rows]},
            "EP projection (in-sample): rank balancedness this load would give on R ranks", "balancedness", yrange=(0, 1.05))))
        here = [row for row in rows if row["ranks"] == ev.report.ep_size]
        best = here[0] if here else rows[len(rows) // 2]
        parts.append(f"projection: on R={best['ranks']} contiguous {best['contiguous_balancedness']:.3f}, planned "
                     f"{best['planned_redundant_balancedness']:.3f} with +{extra}/rank (in-sample)")
    if view is not None:
        figs.extend(_placement_figures(view))
        parts.insert(0, placement_reading(view))
    return Section("placement", "EP projection and placement plan", "; ".join(parts), figs)


def _placement_figures(view: PlacementView) -> list[tuple[str, go.Figure]]:
    gpus = [f"GPU {g}" for g in range(view.config.gpus)]
    figs = [("fig-placement", figures.bar_groups(
        gpus, {"current placement": view.current_load.sum(axis=0), "planned": view.planned_load.sum(axis=0)},
        "In-sample: token copies per GPU, current vs planned (planned and scored on this run: a fit, not a forecast)",
        "token copies (all layers)"))]
    spread = view.held_out_spread()
    if spread is not None:
        names = [k for k in ("current", "greedy", "moetrace-fit", "moetrace") if k in spread]
        mean = [spread[k]["mean"] for k in names]
        errors = {"held-out balancedness": ([spread[k]["mean"] - spread[k]["min"] for k in names],
                                            [spread[k]["max"] - spread[k]["mean"] for k in names])}
        held = view.held_out
        assert held is not None
        figs.append(("fig-held-out", figures.bar_groups(
            names, {"held-out balancedness": mean},
            f"Held-out: planned on {counted(held.window, 'pass')}, scored on the next {held.every} (mean, min-max over {len(held.first_pass)})",
            "balancedness", errors=errors, yrange=(0, 1.05))))
    return figs


def _traffic(ev: ExpertEvidence) -> Section | None:
    """Who sends to whom: the node x node heatmap, nodes per token (token rows) and the hottest inter-node links."""
    if ev.traffic is None:
        return None
    d = ev.traffic.to_dict()
    if not d["copies"]:
        return None
    figs = [("fig-traffic-nodes", figures.node_heatmap(np.asarray(d["node_tokens"])))]
    share = d["inter_node_share"]
    parts = [f"{share:.1%} of {d['copies']:,.0f} token copies cross nodes ({d['nodes']} nodes of {d['gpus_per_node']} GPUs)"]
    links = d["hottest_node_links"]
    if links:
        inter = np.asarray(d["node_tokens"], dtype=np.float64)
        mean = (inter.sum() - np.trace(inter)) / max(d["nodes"] * (d["nodes"] - 1), 1)
        top = links[0]
        parts.append(f"hottest link node {top['source']} -> {top['destination']} carries {top['tokens']:,.0f} ({top['tokens'] / mean:.2f}x the mean inter-node link)")
        figs.append(("fig-traffic-links", figures.bar_groups(
            [f"{x['source']} -> {x['destination']}" for x in links], {"token copies": [x["tokens"] for x in links]},
            f"Hottest inter-node links (source node -> destination node), of {d['nodes'] * (d['nodes'] - 1)}", "token copies")))
    histogram = d["nodes_per_token"]
    if histogram is not None and sum(histogram):
        mean_nodes = sum(i * c for i, c in enumerate(histogram)) / sum(histogram)
        remote = d["remote_nodes_per_token"]
        parts.append(f"a token reaches {mean_nodes:.2f} nodes on average, {sum(i * c for i, c in enumerate(remote)) / sum(remote):.2f} remote "
                     "(one RDMA copy each under DeepEP's node de-duplication)")
        figs.append(("fig-traffic-nodes-per-token", figures.bar_groups(
            [str(i) for i in range(len(histogram))], {"all nodes": histogram, "remote nodes": remote},
            "Nodes per token: distinct nodes a token's top-k reaches (tokens x layers)", "tokens x layers")))
    notes = [] if d["complete"] else [f"only EP ranks {d['sources']} of {d['ranks']} were read: the others' tokens are missing"]
    return Section("traffic", "Who sends to whom", "; ".join(parts), figs, notes)


def _coactivation(ev: ExpertEvidence) -> Section | None:
    d = ev.report.to_dict()
    co, transitions = d["coactivation"], d["transitions"]
    if co is None:
        return None
    pairs = [{"layer": layer["layer"], **p} for layer in co["per_layer"] for p in layer["top_pairs"]]
    figs: list[tuple[str, go.Figure]] = []
    parts = []
    if pairs:
        top = max(pairs, key=lambda p: p["count"])
        strong = max(pairs, key=lambda p: -1 if math.isnan(p["lift"]) else p["lift"])
        parts.append(f"most frequent pair {top['a']}+{top['b']} in layer {top['layer']} ({counted(top['count'], 'token')}, lift {top['lift']:.2f}); "
                     f"strongest lift {strong['lift']:.2f} ({strong['a']}+{strong['b']}, layer {strong['layer']})")
        figs.append(("fig-pairs", figures.pairs_bars(pairs)))
    if transitions:
        best = max(transitions, key=lambda t: t["normalized_mutual_information"])
        parts.append(f"layer-to-layer dependence NMI {min(t['normalized_mutual_information'] for t in transitions):.3f}-"
                     f"{best['normalized_mutual_information']:.3f} (highest {best['from_layer']}->{best['to_layer']})")
        if any(t["top"] for t in transitions):
            figs.append(("fig-transitions", figures.transitions_sankey(transitions)))
    if not figs:
        return None
    return Section("coactivation", "Co-activation and cross-layer transitions", "; ".join(parts), figs)


# ----------------------------------------------------------------------------- routes file
def _routes(ev: Evidence) -> Section | None:
    routes = ev.routes
    if routes is None or not routes.requests:
        return None
    ids = sorted(routes.requests)
    shown = ids[:MAX_REQUESTS]
    stacked = [routes.requests[rid][1] for rid in shown]
    routed_layers = np.flatnonzero(np.any([(a >= 0).all(axis=-1).any(axis=0) for a in stacked], axis=0))
    layer_ids = [routes.layer_ids[i] if routes.layer_ids else int(i) for i in routed_layers]
    num_experts = routes.num_experts or int(max(int(a.max(initial=0)) for a in stacked) + 1)
    options = []
    for rid in shown:
        start, arr = routes.requests[rid]
        cut = arr[:MAX_REQUEST_TOKENS][:, routed_layers]
        z, text = figures.routes_cells(cut)
        more = f", first {MAX_REQUEST_TOKENS} of {arr.shape[0]} positions" if arr.shape[0] > MAX_REQUEST_TOKENS else ""
        options.append({"id": rid, "label": f"{rid} ({counted(arr.shape[0], 'token')})", "x": list(range(start, start + cut.shape[0])), "z": z,
                        "text": text, "title": f"Request {rid}: experts per token and layer ({counted(arr.shape[0], 'token')}{more})"})
    first = options[0]
    arr0 = routes.requests[shown[0]][1][:MAX_REQUEST_TOKENS][:, routed_layers]
    fig = figures.routes_grid(np.asarray(first["x"]), layer_ids, arr0, num_experts, first["title"])
    source = "the trace's own token rows" if ev.routes_path is None else str(ev.routes_path)
    notes = [f"{counted(len(ids), 'request')} from {source}" + (f"; the selector offers the first {MAX_REQUESTS} by id" if len(ids) > MAX_REQUESTS else "")]
    top_k = arr0.shape[-1]
    reading = (f"{counted(len(ids), 'request')} with routed experts ({routes.id_space} ids, top-{top_k}, {counted(len(layer_ids), 'MoE layer')}); "
               "choose one: cells give each token's experts per layer, coloured by its first expert")
    return Section("routes", "Per-request routes", reading, [("fig-routes", fig)], notes, RouteChoice("fig-routes", options))


# ----------------------------------------------------------------------------- replica traces
def _routing(runs: list[RoutingEvidence]) -> Section | None:
    if not runs:
        return None
    figs: list[tuple[str, go.Figure]] = []
    parts = []
    for i, run in enumerate(runs):
        s, table = run.summary, run.table
        name = f"{s['policy']} ({run.path.name})"
        parts.append(f"{name}: hit rate {100 * s['hit_rate']:.1f}%, TTFT p50 {_f(s['ttft_p50'], '.3g')} s p99 {_f(s['ttft_p99'], '.3g')} s, "
                     f"busiest replica {_f(s['load_max_mean'], '.2f')}x the mean")
        if not (table.requests["replica"] >= 0).any():
            continue
        times, load = load_over_time(table, bins=LOAD_BINS)
        figs.append((f"fig-replica-load-{i}", figures.lines(
            times - times[0], {f"replica {r}": load[r] for r in range(load.shape[0])},
            f"{name}: requests in each replica over time", f"time ({s['clock']} s)", "requests routed, not finished", shape="hv")))
        q = table.requests
        done = q["finished"] == 1
        ttft = q["ttft"][done & np.isfinite(q["ttft"])]
        if len(ttft):
            counts, edges = np.histogram(ttft, bins=TTFT_BINS)
            figs.append((f"fig-ttft-{i}", figures.bar_groups(
                [f"{1e3 * lo:.3g}-{1e3 * hi:.3g}" for lo, hi in itertools.pairwise(edges)], {"requests": counts},
                f"{name}: TTFT distribution of {len(ttft):,} finished requests (ms)", "requests")))
        replica = q["replica"]
        reused = np.bincount(replica[done & (replica >= 0)], weights=q["cached_tokens"][done & (replica >= 0)], minlength=table.num_replicas)
        prompt = np.bincount(replica[done & (replica >= 0)], weights=q["input_tokens"][done & (replica >= 0)], minlength=table.num_replicas)
        figs.append((f"fig-hits-{i}", figures.bar_groups(
            [f"replica {r}" for r in range(table.num_replicas)], {"served from prefix cache": reused, "computed": prompt - reused},
            f"{name}: prompt tokens per replica, from the cache vs computed (hit rate {100 * s['hit_rate']:.1f}%)", "prompt tokens", stack=True)))
    return Section("replicas", "Request→replica decisions", "; ".join(parts), figs)


def build_sections(ev: Evidence) -> list[Section]:
    """The sections the evidence supports, in reading order."""
    out: list[Section | None] = []
    if ev.expert is not None:
        e = ev.expert
        out += [_headline(e), _expert_load(e), _rank_load(e), _traffic(e), _timing(e), _placement(e)]
    out.append(_routes(ev))
    out.append(_routing(ev.routing))
    if ev.expert is not None:
        out.append(_coactivation(ev.expert))
    return [s for s in out if s is not None]
