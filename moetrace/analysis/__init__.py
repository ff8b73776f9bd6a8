"""Offline analysis of moetrace traces.

``moetrace.balance`` holds the one definition of each balance figure. The rest is
imported lazily (``moetrace.analysis.analyze_trace`` etc.) so that importing
the recorder does not pull in rich or matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AnalysisReport", "analyze_trace", "ep_projection", "plot_report"]

_LAZY = {
    "AnalysisReport": "summary",
    "analyze_trace": "summary",
    "ep_projection": "projection",
    "plot_report": "plots",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
