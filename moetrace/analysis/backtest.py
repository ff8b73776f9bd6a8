"""Placement that holds on the next window: hold-out scoring and rebalancing backtests.

A placement is planned on past load and deployed for the *next* interval, so
the figure that matters is the balancedness it realises there, not the one it
predicts on the load it was fitted to. This module replays that:

- :func:`load_series` reads a time-ordered trace (``per_pass``, ``per_token``,
  or a ``stat`` trace's window) as logical loads per bucket of passes
  ``[n, L, E]`` (and physical ``[n, L, P]`` for the deployed placement);
- :func:`holdout` plans on the first part, scores on the rest;
- :func:`backtest` plans on each window of ``W`` passes, deploys, scores on
  the following ``S`` passes, and counts the replicas each rebalance moves.

Planners (:data:`PLANNERS`), all scored the same way
(:func:`~moetrace.analysis.placement.predicted_gpu_load`: an expert's load
splits evenly over its replicas; balancedness = mean / max GPU load):

- ``moetrace``: the robust planner (:func:`robust_rebalance`): loads of the
  window shrunk toward the longer history, packing chosen for the mean peak
  over the window's sub-windows, and a layer keeps its deployed placement
  unless the new one is expected to be clearly better;
- ``moetrace-fit``: the same planner fitted to the window's total only (what
  ``placement`` did before the backtest; it fits the window's noise);
- ``greedy``: EPLB's replicate-then-pack on the window's total
  (:func:`~moetrace.analysis.placement_baseline.greedy_rebalance`);
- ``current``: no rebalancing; the trace's own physical placement (contiguous
  slots per GPU), scored on the physical counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np

from .. import metrics
from ..ids import to_logical
from ..trace.reader import Trace
from ..trace.schema import TraceError
from .placement import (
    PlacementError,
    PlacementPlan,
    check_placement_args,
    predicted_gpu_load,
    rebalance_experts,
)
from .placement_baseline import greedy_rebalance
from .source import iter_pass_blocks, token_pass_block

__all__ = [
    "ESTIMATE_PARTS",
    "PLANNERS",
    "BacktestResult",
    "HoldoutResult",
    "PassSeries",
    "PlacementConfig",
    "RobustSettings",
    "backtest",
    "bucket_for",
    "held_out_estimate",
    "holdout",
    "load_series",
    "plan_placement",
    "replicas_moved",
    "robust_inputs",
    "robust_rebalance",
]

#: Buckets a series keeps at most when no bucket size is imposed (neighbours are merged beyond it).
MAX_BUCKETS = 4096


@dataclasses.dataclass(frozen=True)
class PassSeries:
    """Time-ordered loads, ``n`` buckets of ``bucket`` consecutive passes (the last may hold fewer).

    Attributes:
        bucket: passes per bucket.
        passes: ``[n]`` distinct passes in each bucket.
        first_pass: ``[n]`` pass id opening each bucket.
        logical: ``[n, L, E]`` token copies per logical expert.
        physical: ``[n, L, P]`` token copies per physical slot (the deployed placement).
        physical_to_logical: ``[L, P]`` the trace's map.
    """

    bucket: int
    passes: np.ndarray
    first_pass: np.ndarray
    logical: np.ndarray
    physical: np.ndarray
    physical_to_logical: np.ndarray

    def __len__(self) -> int:
        return len(self.passes)


def _blocks(trace: Trace, layer_index: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(pass_id [m], physical [m, L, P])`` blocks in time order, for any time-ordered trace."""
    if trace.mode == "per_token":
        for chunk in trace.iter_tokens(counted_only=True):
            block = token_pass_block(chunk, layer_index, trace.num_physical_experts)
            yield block.pass_id, block.physical_count
    else:
        for block in iter_pass_blocks(trace, layer_index):
            yield block.pass_id, block.physical_count


def load_series(trace: Trace, layer_index: np.ndarray, bucket: int | None = None) -> PassSeries:
    """Read a trace's passes in time order as buckets of ``bucket`` passes.

    Rows with the same pass id (a pass split over chunks, or one row per rank
    in a merged trace) are one pass. With ``bucket=None`` the bucket size
    starts at 1 and doubles whenever more than :data:`MAX_BUCKETS` buckets
    would be kept, so memory stays bounded for any trace length.

    Raises:
        TraceError: the trace holds no time-ordered passes (a ``stat`` trace
        without a window) or fewer than two.
    """
    size = 1 if bucket is None else int(bucket)
    if size <= 0:
        raise ValueError(f"bucket must be positive, got {bucket!r}")
    num_layers, num_physical = len(layer_index), trace.num_physical_experts
    done_counts: list[np.ndarray] = []
    done_passes: list[int] = []
    done_first: list[int] = []
    current = np.zeros((num_layers, num_physical), dtype=np.int64)
    in_bucket = 0
    first = last = None
    for pass_id, counts in _blocks(trace, layer_index):
        for pid, row in zip(pass_id.tolist(), counts, strict=True):
            if pid != last:
                if in_bucket == size:
                    done_counts.append(current)
                    done_passes.append(in_bucket)
                    done_first.append(first)
                    current, in_bucket = np.zeros_like(current), 0
                    if bucket is None and len(done_counts) >= 2 * MAX_BUCKETS:
                        done_counts = [a + b for a, b in zip(done_counts[::2], done_counts[1::2], strict=True)]
                        done_passes = [a + b for a, b in zip(done_passes[::2], done_passes[1::2], strict=True)]
                        done_first = done_first[::2]
                        size *= 2
                if in_bucket == 0:
                    first = pid
                in_bucket += 1
                last = pid
            current += row
    if in_bucket:
        done_counts.append(current)
        done_passes.append(in_bucket)
        done_first.append(first)
    total = sum(done_passes)
    if total < 2:
        what = "a stat trace without a /window" if trace.mode == "stat" and total == 0 else f"{total} pass(es)"
        raise TraceError(
            f"{trace.path}: hold-out and backtest need time-ordered passes, and this trace holds {what}; "
            "record with mode='per_pass' or 'per_token' (or a stat window) over more passes"
        )
    physical = np.stack(done_counts)
    mapping = trace.physical_to_logical[layer_index]
    return PassSeries(
        bucket=size,
        passes=np.asarray(done_passes, dtype=np.int64),
        first_pass=np.asarray(done_first, dtype=np.int64),
        logical=to_logical(physical, mapping).astype(np.float64),
        physical=physical,
        physical_to_logical=mapping,
    )


# ---------------------------------------------------------------------- planners
@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Sizes of a placement: ``N`` slots, ``G`` groups, ``M`` nodes, ``K`` GPUs."""

    replicas: int
    groups: int
    nodes: int
    gpus: int


@dataclasses.dataclass(frozen=True)
class RobustSettings:
    """Knobs of :func:`robust_rebalance`, each kept because the backtest showed it helps.

    Attributes:
        subwindows: the planning window is cut into this many consecutive
            sub-windows; the packing minimises their mean peak GPU load.
        shrink: weight of the longer history in the load estimate (0 = the
            window alone); the history is everything before the window.
        keep_tolerance: a layer keeps its deployed placement unless the new
            plan lowers the expected peak by more than this fraction.
    """

    subwindows: int = 10
    shrink: float = 0.25
    keep_tolerance: float = 0.02


def robust_inputs(history: np.ndarray, window: int, settings: RobustSettings) -> tuple[np.ndarray, np.ndarray]:
    """``(estimate [L, E], scenarios [S, L, E])`` from ``history [t, L, E]`` (buckets, oldest first).

    The estimate is the last ``window`` buckets' total, shrunk toward the
    per-bucket mean of all of ``history`` (scaled to the window's length).
    Scenarios are the window's ``subwindows`` consecutive parts, each scaled to
    the window's length and shrunk the same way.
    """
    recent = history[-window:]
    scale = len(recent)
    longer = history.mean(axis=0) * scale
    alpha = settings.shrink if len(history) > len(recent) else 0.0
    estimate = (1 - alpha) * recent.sum(axis=0) + alpha * longer
    parts = [p for p in np.array_split(recent, min(settings.subwindows, len(recent))) if len(p)]
    scenarios = np.stack([(1 - alpha) * p.sum(axis=0) * (scale / len(p)) + alpha * longer for p in parts])
    return estimate, scenarios


def robust_rebalance(
    history: np.ndarray, window: int, config: PlacementConfig, settings: RobustSettings = RobustSettings(), current: np.ndarray | None = None
) -> PlacementPlan:
    """moetrace's planner for the next window, from ``history [t, L, E]`` (its ``gpu_load`` is under the shrunk estimate)."""
    estimate, scenarios = robust_inputs(history, window, settings)
    return rebalance_experts(
        estimate, config.replicas, config.groups, config.nodes, config.gpus,
        scenarios=scenarios, current=current, keep_tolerance=settings.keep_tolerance,
    )


#: ``planner(history [t, L, E], window buckets, config, deployed phy2log or None) -> phy2log [L, N]``.
Planner = Callable[[np.ndarray, int, PlacementConfig, "np.ndarray | None"], np.ndarray]

PLANNERS: dict[str, Planner] = {
    "moetrace": lambda h, w, c, cur: robust_rebalance(h, w, c, RobustSettings(), cur).phy2log,
    "moetrace-fit": lambda h, w, c, cur: rebalance_experts(h[-w:].sum(axis=0), c.replicas, c.groups, c.nodes, c.gpus).phy2log,
    "greedy": lambda h, w, c, cur: greedy_rebalance(h[-w:].sum(axis=0), c.replicas, c.groups, c.nodes, c.gpus),
}


def replicas_moved(before: np.ndarray, after: np.ndarray, num_gpus: int) -> int:
    """Expert replicas a GPU must receive to go from ``before`` to ``after`` (both ``phy2log [L, N]``).

    Per layer and GPU, the multiset of experts it holds after minus the one it
    held before; slots reordered within a GPU move nothing.
    """
    num_layers, num_slots = after.shape
    num_experts = int(max(before.max(), after.max())) + 1
    key_before = (np.arange(num_layers)[:, None] * num_gpus + np.arange(num_slots)[None, :] // (num_slots // num_gpus)) * num_experts + before
    key_after = (np.arange(num_layers)[:, None] * num_gpus + np.arange(num_slots)[None, :] // (num_slots // num_gpus)) * num_experts + after
    size = num_layers * num_gpus * num_experts
    held_before = np.bincount(key_before.ravel(), minlength=size)
    held_after = np.bincount(key_after.ravel(), minlength=size)
    return int(np.maximum(held_after - held_before, 0).sum())


def _check(series: PassSeries, config: PlacementConfig) -> None:
    check_placement_args(series.logical[0], config.replicas, config.groups, config.nodes, config.gpus)


def _current_balance(physical: np.ndarray, gpus: int) -> float | None:
    """Balancedness of the trace's own placement (``P / K`` contiguous slots per GPU), or None if ``K`` does not divide ``P``."""
    if physical.shape[-1] % gpus:
        return None
    return metrics.balancedness(metrics.rank_load(physical, gpus))


def _balance(load: np.ndarray, phy2log: np.ndarray, gpus: int) -> float:
    return metrics.balancedness(predicted_gpu_load(load, phy2log, gpus))


# ---------------------------------------------------------------------- hold-out
@dataclasses.dataclass(frozen=True)
class HoldoutResult:
    """Plan on the first ``plan_passes`` passes, score on the remaining ``scored_passes``.

    Attributes:
        in_sample: planner -> balancedness on the passes it was planned on.
        held_out: planner -> balancedness on the held-out passes.
        held_out_windows: planner -> balancedness of each of up to
            ``num_windows`` consecutive held-out windows (the spread).
        plans: planner -> ``phy2log [L, N]``.
    """

    plan_passes: int
    scored_passes: int
    in_sample: dict[str, float | None]
    held_out: dict[str, float | None]
    held_out_windows: dict[str, list[float]]
    plans: dict[str, np.ndarray]

    def to_dict(self) -> dict[str, object]:
        return {
            "plan_passes": self.plan_passes,
            "scored_passes": self.scored_passes,
            "in_sample": self.in_sample,
            "held_out": self.held_out,
            "held_out_windows": self.held_out_windows,
            "held_out_spread": {k: _spread(v) for k, v in self.held_out_windows.items()},
        }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values)
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()), "std": float(a.std())}


def holdout(series: PassSeries, fraction: float, config: PlacementConfig, num_windows: int = 4) -> HoldoutResult:
    """Plan every planner on the first ``1 - fraction`` of the passes, score on the rest.

    Raises:
        PlacementError: ``fraction`` outside ``(0, 1)``, too few passes to split,
        or inconsistent sizes.
    """
    if not 0 < fraction < 1:
        raise PlacementError(f"--holdout must be a fraction in (0, 1) (the share of passes held out), got {fraction!r}")
    _check(series, config)
    cut = round(len(series) * (1 - fraction))
    if cut < 1 or cut >= len(series):
        raise PlacementError(
            f"holding out {fraction:.0%} of {int(series.passes.sum())} passes leaves an empty part; pass a fraction that keeps passes on both sides"
        )
    history, future = series.logical[:cut], series.logical[cut:]
    windows = [w for w in np.array_split(np.arange(len(future)), min(num_windows, len(future))) if len(w)]
    in_sample: dict[str, float | None] = {}
    held_out: dict[str, float | None] = {}
    spread: dict[str, list[float]] = {}
    plans: dict[str, np.ndarray] = {}
    for name, planner in PLANNERS.items():
        phy2log = planner(history, len(history), config, None)
        plans[name] = phy2log
        in_sample[name] = _balance(history.sum(axis=0), phy2log, config.gpus)
        held_out[name] = _balance(future.sum(axis=0), phy2log, config.gpus)
        spread[name] = [_balance(future[w].sum(axis=0), phy2log, config.gpus) for w in windows]
    in_sample["current"] = _current_balance(series.physical[:cut].sum(axis=0), config.gpus)
    held_out["current"] = _current_balance(series.physical[cut:].sum(axis=0), config.gpus)
    current_windows = [_current_balance(series.physical[cut:][w].sum(axis=0), config.gpus) for w in windows]
    spread["current"] = [x for x in current_windows if x is not None]
    return HoldoutResult(
        plan_passes=int(series.passes[:cut].sum()),
        scored_passes=int(series.passes[cut:].sum()),
        in_sample=in_sample,
        held_out=held_out,
        held_out_windows=spread,
        plans=plans,
    )


# ---------------------------------------------------------------------- backtest
@dataclasses.dataclass(frozen=True)
class BacktestResult:
    """A replayed rebalancing schedule: ``R`` rebalances, one row each.

    Attributes:
        window, every: passes planned on and passes each plan is deployed for.
        first_pass: ``[R]`` pass id where each deployment starts.
        realized: planner -> ``[R]`` balancedness on the deployment's passes.
        in_sample: planner -> ``[R]`` balancedness on the window it was planned on.
        moved: planner -> ``[R]`` replicas copied to a GPU at each rebalance
            (the first from the trace's own placement when it has ``N`` slots).
        expert_bytes: bytes of one expert's weights, when known.
    """

    window: int
    every: int
    config: PlacementConfig
    first_pass: np.ndarray
    realized: dict[str, np.ndarray]
    in_sample: dict[str, np.ndarray]
    moved: dict[str, np.ndarray]
    expert_bytes: int | None = None

    def summary(self) -> dict[str, dict[str, float | None]]:
        """Per planner: mean/min realised and in-sample balancedness, moves per rebalance, wins vs greedy."""
        out: dict[str, dict[str, float | None]] = {}
        greedy = self.realized.get("greedy")
        for name, realized in self.realized.items():
            moved = self.moved.get(name)
            row: dict[str, float | None] = {
                "realized_mean": float(realized.mean()),
                "realized_min": float(realized.min()),
                "in_sample_mean": float(self.in_sample[name].mean()) if name in self.in_sample else None,
                "moved_mean": float(moved.mean()) if moved is not None else 0.0,
                "moved_bytes_mean": float(moved.mean()) * self.expert_bytes if moved is not None and self.expert_bytes else None,
            }
            if greedy is not None and name != "greedy":
                row["below_greedy_share"] = float((realized < greedy - 1e-12).mean())
                row["gain_over_greedy"] = float((realized - greedy).mean())
            out[name] = row
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "window": self.window,
            "every": self.every,
            "config": dataclasses.asdict(self.config),
            "expert_bytes": self.expert_bytes,
            "rebalances": len(self.first_pass),
            "summary": self.summary(),
            "first_pass": self.first_pass.tolist(),
            "realized": {k: v.tolist() for k, v in self.realized.items()},
            "in_sample": {k: v.tolist() for k, v in self.in_sample.items()},
            "moved": {k: v.tolist() for k, v in self.moved.items()},
        }


def backtest(
    series: PassSeries,
    window: int,
    every: int,
    config: PlacementConfig,
    planners: dict[str, Planner] | None = None,
    expert_bytes: int | None = None,
) -> BacktestResult:
    """Replay: at each rebalance plan on the last ``window`` passes, deploy for the next ``every``.

    ``window`` and ``every`` are in passes and must be multiples of
    ``series.bucket``. The first rebalance happens once ``window`` passes are
    seen; a final deployment shorter than ``every`` is dropped.

    Raises:
        PlacementError: bad sizes, or a trace too short for one rebalance.
    """
    for name, value in (("window", window), ("every", every)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlacementError(f"--{name} must be a positive number of passes, got {value!r}")
        if value % series.bucket:
            raise PlacementError(f"--{name}={value} is not a multiple of the series' {series.bucket}-pass buckets")
    _check(series, config)
    w, s = window // series.bucket, every // series.bucket
    starts = list(range(w, len(series) - s + 1, s))
    if not starts:
        raise PlacementError(
            f"the trace has {int(series.passes.sum())} passes; a backtest needs at least --window + --every = {window + every}; "
            "pass a smaller --window/--every or record longer"
        )
    planners = PLANNERS if planners is None else planners
    deployed_start = series.physical_to_logical if series.physical_to_logical.shape[1] == config.replicas else None
    realized = {name: [] for name in planners}
    in_sample = {name: [] for name in planners}
    moved = {name: [] for name in planners}
    deployed = {name: deployed_start for name in planners}
    current: list[float] = []
    for t in starts:
        history = series.logical[:t]
        recent = history[-w:].sum(axis=0)
        nxt = series.logical[t : t + s].sum(axis=0)
        for name, planner in planners.items():
            phy2log = planner(history, w, config, deployed[name])
            realized[name].append(_balance(nxt, phy2log, config.gpus))
            in_sample[name].append(_balance(recent, phy2log, config.gpus))
            moved[name].append(0 if deployed[name] is None else replicas_moved(deployed[name], phy2log, config.gpus))
            deployed[name] = phy2log
        figure = _current_balance(series.physical[t : t + s].sum(axis=0), config.gpus)
        if figure is not None:
            current.append(figure)
    out_realized = {k: np.asarray(v) for k, v in realized.items()}
    if len(current) == len(starts):
        out_realized["current"] = np.asarray(current)
    return BacktestResult(
        window=window,
        every=every,
        config=config,
        first_pass=series.first_pass[starts],
        realized=out_realized,
        in_sample={k: np.asarray(v) for k, v in in_sample.items()},
        moved={k: np.asarray(v) for k, v in moved.items()},
        expert_bytes=expert_bytes,
    )


#: :func:`held_out_estimate` plans on one of this many consecutive parts of a trace and scores on the next.
ESTIMATE_PARTS = 5


def plan_placement(weight: np.ndarray, series: PassSeries | None, config: PlacementConfig, current: np.ndarray | None = None) -> PlacementPlan:
    """moetrace's plan to deploy now: robust on the time-ordered ``series`` when there is one, else fitted to ``weight [L, E]``.

    The returned ``gpu_load`` is under the planner's own load estimate; score a
    plan with :func:`~moetrace.analysis.placement.predicted_gpu_load`.
    """
    if series is None or len(series) < 2:
        return rebalance_experts(weight, config.replicas, config.groups, config.nodes, config.gpus, current=current)
    return robust_rebalance(series.logical, len(series), config, RobustSettings(), current)


def held_out_estimate(series: PassSeries | None, config: PlacementConfig, parts: int = ESTIMATE_PARTS) -> BacktestResult | None:
    """Held-out estimate of every planner: plan on one of ``parts`` consecutive parts, score on the next.

    ``None`` when there is no series or it has fewer than ``parts`` buckets.
    """
    if series is None or len(series) < parts:
        return None
    part = (len(series) // parts) * series.bucket
    return backtest(series, part, part, config)


def bucket_for(window: int, every: int, parts: int = RobustSettings().subwindows) -> int:
    """The bucket size that serves a backtest of ``window`` and ``every`` passes.

    The largest divisor of both that still cuts a window into at least ``parts``
    buckets (the robust planner's sub-windows), or 1.
    """
    common = math.gcd(window, every)
    for size in sorted((d for d in range(1, common + 1) if common % d == 0), reverse=True):
        if window // size >= parts:
            return size
    return 1
