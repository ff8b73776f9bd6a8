"""Expert placement: where each (replicated) expert lives, planned on past load and judged on the next window.

The public surface (imported lazily, so that ``import moetrace.placement`` loads nothing heavy):

- :func:`plan_experts` → :class:`PlacementPlan`: moetrace's planner (swap search, move-aware);
- :func:`rebalance_experts`: DeepSeek EPLB's contract, tensors in and
  ``(phy2log, log2phy, logcnt)`` tensors out on the input's device;
- :func:`greedy_rebalance`: the same plan as a ``phy2log`` array, the baseline;
- :class:`PassSeries`, :func:`holdout`, :func:`backtest`, :func:`plan_with_selection`,
  :class:`Selection`: plans judged on the next window of a time-ordered trace;
- :func:`rebalance_value`: whether a rebalance's gain pays for its weight copies;
- :func:`write_sglang_plan`, :func:`read_sglang_plan`: SGLang's ``--init-expert-location`` file.

Modules: ``checks`` (sizes and refusals), ``plan`` (the planner), ``eplb`` (the drop-in and the baseline),
``planners`` (the candidates), ``select`` (validation), ``backtesting``, ``series``,
``cost``, ``sglang_plan``, ``plot`` (matplotlib; not imported here).
"""

from __future__ import annotations

from ..lazy import lazy_attributes

__all__ = [
    "PassSeries",
    "PlacementConfig",
    "PlacementError",
    "PlacementPlan",
    "Selection",
    "backtest",
    "greedy_rebalance",
    "holdout",
    "plan_experts",
    "plan_with_selection",
    "read_sglang_plan",
    "rebalance_experts",
    "rebalance_value",
    "write_sglang_plan",
]

_LAZY = {
    "PassSeries": "series",
    "PlacementConfig": "checks",
    "PlacementError": "checks",
    "PlacementPlan": "plan",
    "plan_experts": "plan",
    "rebalance_experts": "eplb",
    "greedy_rebalance": "eplb",
    "Selection": "select",
    "backtest": "backtesting",
    "holdout": "backtesting",
    "plan_with_selection": "backtesting",
    "rebalance_value": "cost",
    "read_sglang_plan": "sglang_plan",
    "write_sglang_plan": "sglang_plan",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
