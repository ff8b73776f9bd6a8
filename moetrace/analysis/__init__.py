"""Offline analysis of moetrace traces.

``moetrace.balance`` holds the one definition of each balance figure. The rest is
imported lazily (``moetrace.analysis.analyze_trace`` etc.) so that importing
the recorder does not pull in rich or matplotlib.
"""

from __future__ import annotations

from ..lazy import lazy_attributes

__all__ = ["AnalysisReport", "analyze_trace", "ep_projection", "plot_report"]

_LAZY = {
    "AnalysisReport": "summary",
    "analyze_trace": "summary",
    "ep_projection": "projection",
    "plot_report": "plots",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
