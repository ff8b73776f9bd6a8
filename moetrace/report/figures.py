"""Plotly figures of the report: one function per figure, arrays in, ``plotly.graph_objects.Figure`` out.

No analysis here: every value comes computed (:mod:`.evidence`, :mod:`moetrace.analysis`).
Sizes are bounded by the callers (:mod:`.sections`), so a figure's data never grows with the
trace length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

__all__ = [
    "bar_groups",
    "expert_heatmap",
    "headline",
    "lines",
    "node_heatmap",
    "pairs_bars",
    "phase_stack",
    "rank_heatmap",
    "routes_grid",
    "transitions_sankey",
]

#: The look of every figure: set once in the page (:mod:`.page`), not copied into each figure.
TEMPLATE = "plotly_white"


def _figure(*traces: object) -> go.Figure:
    """A figure with an empty template (the page applies :data:`TEMPLATE`: cheaper and smaller than one per figure)."""
    return go.Figure(data=list(traces), layout={"template": {}})


def _layout(fig: go.Figure, title: str, height: int = 380, **axes: object) -> go.Figure:
    fig.update_layout(title={"text": title, "x": 0, "font": {"size": 14}}, height=height,
                      margin={"l": 60, "r": 20, "t": 40, "b": 50}, **axes)
    return fig


def headline(items: Sequence[tuple[str, float, str]]) -> go.Figure:
    """Big numbers: ``(label, value, d3 format)`` each, side by side."""
    fig = _figure()
    n = len(items)
    for i, (label, value, fmt) in enumerate(items):
        fig.add_trace(go.Indicator(mode="number", value=float(value), number={"valueformat": fmt, "font": {"size": 34}},
                                   title={"text": label, "font": {"size": 13}}, domain={"x": [i / n, (i + 1) / n - 0.02], "y": [0, 1]}))
    return _layout(fig, "", height=170)


def expert_heatmap(layer_ids: np.ndarray, counts: np.ndarray, group: int = 1) -> go.Figure:
    """Token copies per logical expert ``counts [L, E']`` (``E'`` columns of ``group`` adjacent experts each).

    Hover: expert (or expert range), layer, count and ``x mean`` (count / the layer's mean column).
    """
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean(axis=1, keepdims=True)
    ratio = np.divide(counts, mean, out=np.zeros_like(counts), where=mean > 0)
    columns = np.arange(counts.shape[1]) * group
    labels = [str(c) if group == 1 else f"{c}-{c + group - 1}" for c in columns]
    layers = [f"L{x}" for x in layer_ids]
    fig = _figure(go.Heatmap(
        z=counts, x=labels, y=layers, customdata=ratio, colorscale="Viridis", colorbar={"title": {"text": "tokens"}},
        hovertemplate="expert %{x}<br>layer %{y}<br>count %{z:,.0f}<br>x mean %{customdata:.2f}<extra></extra>",
    ))
    return _layout(fig, "Token copies per expert and layer", height=max(260, 60 + 26 * len(layers)),
                   xaxis={"title": {"text": "logical expert"}, "type": "category"},
                   yaxis={"title": {"text": "MoE layer"}, "autorange": "reversed", "type": "category"})


def rank_heatmap(layer_ids: np.ndarray, load: np.ndarray) -> go.Figure:
    """Token copies per EP rank and layer ``load [L, R]``; hover gives x mean of the layer."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=1, keepdims=True)
    ratio = np.divide(load, mean, out=np.zeros_like(load), where=mean > 0)
    fig = _figure(go.Heatmap(
        z=load, x=[f"rank {r}" for r in range(load.shape[1])], y=[f"L{x}" for x in layer_ids], customdata=ratio,
        colorscale="Blues", colorbar={"title": {"text": "tokens"}},
        text=np.vectorize(lambda v: f"{v:.2f}x")(ratio), texttemplate="%{text}" if load.size <= 400 else None,
        hovertemplate="%{x}<br>layer %{y}<br>count %{z:,.0f}<br>x mean %{customdata:.2f}<extra></extra>",
    ))
    return _layout(fig, "Token copies per EP rank and layer (x layer mean)", height=max(240, 60 + 26 * load.shape[0]),
                   yaxis={"autorange": "reversed", "type": "category"})


def node_heatmap(node_tokens: np.ndarray) -> go.Figure:
    """Token copies from each source node (rows) to each destination node ``[N, N]``; hover gives the share of all copies."""
    counts = np.asarray(node_tokens, dtype=np.float64)
    share = counts / max(float(counts.sum()), 1.0)
    names = [f"node {n}" for n in range(counts.shape[0])]
    fig = _figure(go.Heatmap(
        z=counts, x=names, y=names, customdata=share, colorscale="Viridis", colorbar={"title": {"text": "copies"}},
        hovertemplate="from %{y}<br>to %{x}<br>copies %{z:,.0f}<br>%{customdata:.1%} of all<extra></extra>",
    ))
    return _layout(fig, "Token copies, source node (rows) x destination node (the diagonal stays inside a node)",
                   height=max(300, 80 + 30 * counts.shape[0]), xaxis={"type": "category"},
                   yaxis={"autorange": "reversed", "type": "category"})


def lines(x: np.ndarray, series: dict[str, np.ndarray], title: str, xlabel: str, ylabel: str,
          secondary: dict[str, np.ndarray] | None = None, secondary_label: str = "", shape: str = "linear") -> go.Figure:
    """One line per named series over ``x``; ``secondary`` series on a right-hand axis."""
    fig = _figure()
    for name, y in series.items():
        fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines+markers" if len(x) <= 60 else "lines", line={"shape": shape}))
    axes: dict[str, object] = {"xaxis": {"title": {"text": xlabel}}, "yaxis": {"title": {"text": ylabel}}}
    for name, y in (secondary or {}).items():
        fig.add_trace(go.Scatter(x=x, y=y, name=name, mode="lines+markers" if len(x) <= 60 else "lines", yaxis="y2",
                                 line={"dash": "dot"}))
    if secondary:
        axes["yaxis2"] = {"title": {"text": secondary_label}, "overlaying": "y", "side": "right", "showgrid": False}
    fig.update_layout(legend={"orientation": "h", "y": -0.25})
    return _layout(fig, title, **axes)


def bar_groups(categories: Sequence[str], groups: dict[str, Sequence[float]], title: str, ylabel: str,
               errors: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None, stack: bool = False,
               yrange: tuple[float, float] | None = None) -> go.Figure:
    """Bars per category, one colour per group (side by side, or stacked); ``errors`` = (minus, plus) per group."""
    fig = _figure()
    for name, values in groups.items():
        err = (errors or {}).get(name)
        error_y = None if err is None else {"type": "data", "symmetric": False, "array": list(err[1]), "arrayminus": list(err[0])}
        fig.add_trace(go.Bar(x=list(categories), y=list(values), name=name, error_y=error_y,
                             hovertemplate="%{x}<br>" + name + ": %{y:.4g}<extra></extra>"))
    axes: dict[str, object] = {"yaxis": {"title": {"text": ylabel}, **({"range": list(yrange)} if yrange else {})},
                               "xaxis": {"type": "category"}}
    fig.update_layout(barmode="stack" if stack else "group", legend={"orientation": "h", "y": -0.2})
    return _layout(fig, title, **axes)


def phase_stack(rank_labels: Sequence[int], layer_ids: np.ndarray, phases: Sequence[str], seconds: np.ndarray) -> go.Figure:
    """Phase time stacked per (rank, layer): ``seconds [R, L, F]`` on a two-level category axis."""
    seconds = np.asarray(seconds, dtype=np.float64)
    ranks = [f"rank {r}" for r in rank_labels for _ in layer_ids]
    layers = [f"L{x}" for _ in rank_labels for x in layer_ids]
    fig = _figure()
    for f, name in enumerate(phases):
        fig.add_trace(go.Bar(x=[ranks, layers], y=1e3 * seconds[:, :, f].ravel(), name=name,
                             hovertemplate="%{x}<br>" + name + ": %{y:.2f} ms<extra></extra>"))
    fig.update_layout(barmode="stack", legend={"orientation": "h", "y": -0.3})
    return _layout(fig, "Phase time per rank and layer, summed over passes (ms)", height=420,
                   yaxis={"title": {"text": "ms"}})


def routes_grid(positions: np.ndarray, layer_ids: Sequence[int], ids: np.ndarray, num_experts: int, title: str) -> go.Figure:
    """One request's experts: ``ids [T, L', k]`` as a layers x tokens grid coloured by the first expert."""
    z, text = routes_cells(ids)
    fig = _figure(go.Heatmap(
        z=z, x=positions, y=[f"L{x}" for x in layer_ids], text=text, texttemplate="%{text}" if ids.shape[0] <= 48 else None,
        zmin=0, zmax=max(num_experts - 1, 1), colorscale="Turbo", colorbar={"title": {"text": "expert (slot 0)"}},
        hovertemplate="position %{x}<br>layer %{y}<br>experts %{text}<extra></extra>", xgap=1, ygap=1,
    ))
    return _layout(fig, title, height=max(240, 90 + 34 * len(layer_ids)),
                   xaxis={"title": {"text": "token position"}}, yaxis={"autorange": "reversed", "type": "category"})


def routes_cells(ids: np.ndarray) -> tuple[list[list[float | None]], list[list[str]]]:
    """``ids [T, L, k]`` -> (``z [L][T]`` first expert or ``None`` when not routed, ``text [L][T]`` "a,b")."""
    ids = np.asarray(ids)
    routed = (ids >= 0).all(axis=-1)  # [T, L]
    z = [[float(ids[t, layer, 0]) if routed[t, layer] else None for t in range(ids.shape[0])] for layer in range(ids.shape[1])]
    text = [[",".join(str(int(e)) for e in ids[t, layer]) if routed[t, layer] else "-" for t in range(ids.shape[0])]
            for layer in range(ids.shape[1])]
    return z, text


def pairs_bars(rows: list[dict[str, object]]) -> go.Figure:
    """Top co-activated pairs: ``rows`` of ``{"layer", "a", "b", "count", "lift"}``, a horizontal bar each."""
    labels = [f"L{r['layer']}  {r['a']}+{r['b']}" for r in rows]
    lift = [float(r["lift"]) for r in rows]  # type: ignore[arg-type]
    fig = _figure(go.Bar(
        y=labels, x=[r["count"] for r in rows], orientation="h", customdata=lift,
        marker={"color": lift, "colorscale": "RdBu", "cmid": 1.0, "colorbar": {"title": {"text": "lift"}}},
        hovertemplate="%{y}<br>tokens with both %{x:,}<br>lift %{customdata:.2f} (observed / independent)<extra></extra>",
    ))
    return _layout(fig, "Top co-activated expert pairs per layer (colour: lift)", height=max(260, 60 + 18 * len(rows)),
                   xaxis={"title": {"text": "tokens routed to both"}}, yaxis={"autorange": "reversed", "type": "category"})


def transitions_sankey(rows: list[dict[str, object]]) -> go.Figure:
    """Cross-layer transitions: ``rows`` of ``{"from_layer", "to_layer", "top": [{"a", "b", "share"}]}`` as flows."""
    nodes: dict[tuple[int, int], int] = {}

    def node(layer: int, expert: int) -> int:
        return nodes.setdefault((layer, expert), len(nodes))

    source, target, value, label = [], [], [], []
    for row in rows:
        for t in row["top"]:  # type: ignore[attr-defined]
            source.append(node(int(row["from_layer"]), int(t["a"])))  # type: ignore[call-overload]
            target.append(node(int(row["to_layer"]), int(t["b"])))  # type: ignore[call-overload]
            value.append(float(t["share"]))
            label.append(f"L{row['from_layer']} e{t['a']} -> L{row['to_layer']} e{t['b']}")
    names = [f"L{layer} e{expert}" for (layer, expert) in nodes]
    fig = _figure(go.Sankey(
        arrangement="snap",
        node={"label": names, "pad": 12, "thickness": 14},
        link={"source": source, "target": target, "value": value, "customdata": label,
              "hovertemplate": "%{customdata}<br>share of tokens %{value:.3f}<extra></extra>"},
    ))
    return _layout(fig, "Top cross-layer transitions (same top-k slot; width: share of tokens)", height=420)
