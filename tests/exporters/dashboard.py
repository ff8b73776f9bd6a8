"""Read the PromQL expressions out of ``docs/grafana-dashboard.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC_NAME = re.compile(r"\bmoetrace_[a-z0-9_]+\b")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets and templating queries (``label_values(metric{...}, label)``)."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["query"]["query"])
        assert match, f"templating query {variable['query']['query']!r} is not label_values(selector, label)"
        exprs.append(match.group(1))
    return exprs


def for_prometheus(expr: str) -> str:
    """Substitute Grafana's variables so Prometheus can evaluate the expression."""
    return expr.replace("$__rate_interval", "1m").replace('"$job"', '".*"').replace('"$rank"', '".*"')
