"""``moetrace analyze ROUTES --by request|label[:NAME]``: who drives the hot experts, as text (80 columns)."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from moetrace.analysis.attribution import Attribution, attribute
from moetrace.routes import RoutesError, load_routes, trace_route_set
from moetrace.trace.schema import TraceError
from moetrace.words import counted

from .errors import CommandError

__all__ = ["parse_by", "print_attribution", "run_attribution"]


def parse_by(text: str) -> tuple[str, str | None]:
    """``"request"`` -> ``("request", None)``; ``"label"`` / ``"label:tenant"`` -> ``("label", "tenant")``."""
    by, _, key = text.partition(":")
    if by not in ("request", "label") or (by == "request" and key):
        raise CommandError(f"--by {text!r}: use 'request', 'label' or 'label:NAME' (a label such as tenant)")
    return by, key or None


def run_attribution(path: Path, by_text: str, ep_size: int, top: int) -> Attribution:
    """Load the routes file and attribute (errors as :class:`CommandError`)."""
    by, key = parse_by(by_text)
    try:
        if path.suffix in (".h5", ".hdf5"):  # a per_token trace whose rows carry their requests
            routes = trace_route_set([path])
        else:
            routes = load_routes(path)
        return attribute(routes, by=by, key=key, ep_size=ep_size, top=top)
    except TraceError as exc:
        raise CommandError(f"{exc}; --by needs per-request routes: a per_token trace whose rows carry their requests, or a routes file "
                           "(moetrace routes, moetrace.routes.save_routes, the capturer, SGLang's or vLLM's routed_experts)") from None
    except RoutesError as exc:
        raise CommandError(str(exc)) from None


def print_attribution(result: Attribution, console: Console) -> None:
    """Per group and per layer's hot experts: shares of the excess load."""
    doc = result.to_dict()
    what = "request" if doc["by"] == "request" else f"label {doc['key']!r}"
    console.print(f"[bold]attribution by {what}[/bold]: {counted(doc['requests'], 'request')}, {counted(doc['tokens'], 'token')}")
    console.print("excess: copies above an even share of the layer; its shares sum to 1")
    groups = Table(title="Who takes the hot experts' excess", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("who", "requests", "tokens %", "excess %", "lift", "JS", "p"):
        groups.add_column(col, justify="left" if col == "who" else "right")
    for g in doc["groups"]:
        groups.add_row(g["who"][:24], str(g["requests"]), f"{100 * g['token_share']:.1f}", f"{100 * g['hot_excess_share']:.1f}",
                       "-" if g["lift"] is None else f"{g['lift']:.2f}", f"{g['divergence']:.3f}",
                       "-" if g["p_value"] is None else f"{g['p_value']:.3f}")
    console.print(groups)
    layers = Table(title="Hot experts: who takes their excess", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("layer", "expert", "x mean", "contributors"):
        layers.add_column(col, justify="left" if col == "contributors" else "right")
    num_experts = result.group_counts.shape[2]
    for row in doc["layers"]:
        for h in row["hot_experts"]:
            mean = (h["count"] - h["excess"]) or 1.0
            who = ", ".join(f"{c['who'][:12]} {100 * c['share_of_excess']:.0f}%" for c in h["contributors"][:3])
            layers.add_row(str(row["layer"]), str(h["expert"]), f"{h['count'] / mean:.1f}", who)
    console.print(layers)
    console.print(f"hot experts: the hottest {result.hot.shape[1]} of {num_experts} per layer")
    if doc["by"] == "label":
        if doc["culprits"]:
            for c in doc["culprits"]:
                console.print(f"culprit: {c} (more excess than random groups of its size; p < {doc['alpha']})")
        else:
            console.print("no culprit: no label takes more excess than random groups of its size")
