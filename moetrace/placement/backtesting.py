"""Placement that holds on the next window: hold-out scoring and rebalancing backtests.

A placement is planned on past load and deployed for the *next* interval, so
the figure that matters is the balancedness it realises there, not the one it
predicts on the load it was fitted to. This module replays that:

- :func:`~moetrace.analysis.source.load_series` reads a time-ordered trace
  (``per_pass``, ``per_token``, or a ``stat`` trace's window) as a
  :class:`~moetrace.placement.series.PassSeries` of logical loads per bucket
  of passes ``[n, L, E]`` (and physical ``[n, L, P]`` for the deployed placement);
- :func:`holdout` plans on the first part, scores on the rest;
- :func:`backtest` plans on each window of ``W`` passes, deploys, scores on
  the following ``S`` passes, and counts the replicas each rebalance moves and
  the balance it gains over keeping the previous plan.

Planners (:func:`default_planners`), all scored the same way
(:func:`~moetrace.placement.plan.predicted_gpu_load`: an expert's load
splits evenly over its replicas; balancedness = mean / max GPU load):

- ``moetrace``: the default: the candidate chosen by validation on the
  planning data's own past (:class:`~moetrace.placement.select.ValidatedPlanner`);
- ``moetrace-robust``, ``moetrace-fit``, ``greedy``: the candidates
  (:mod:`moetrace.placement.planners`); ``greedy`` is EPLB's method, the baseline;
- ``current``: no rebalancing; the trace's own physical placement (contiguous
  slots per GPU), scored on the physical counts;
- ``oracle``: the plan fitted to the scored window itself (:func:`oracle_plan`),
  the headroom: the share of the greedy-to-oracle gap a planner closes says how
  much of what better planning could gain it gains.

Over 500 lines: the hold-out, the backtest and the held-out estimate share one replay
loop, its planners table and its result types; split apart they would import each other's
private scoring helpers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from .. import balance
from .checks import (
    EVALUATION_WORK,
    PLAN_WORK,
    PlacementConfig,
    PlacementError,
    check_placement_args,
)
from .eplb import eplb_policy
from .plan import (
    PlacementPlan,
    align_to,
    check_current,
    log2phy_from_phy2log,
    moved_per_gpu,
    plan_experts,
    predicted_gpu_load,
)
from .planners import CANDIDATES, Planner, RobustSettings
from .select import BASELINE, Selection, ValidatedPlanner
from .series import PassSeries

__all__ = [
    "ESTIMATE_PARTS",
    "BacktestResult",
    "HoldoutResult",
    "backtest",
    "baseline_plan",
    "bucket_for",
    "default_planners",
    "gap_closed",
    "held_out_estimate",
    "holdout",
    "oracle_plan",
    "plan_placement",
    "plan_with_selection",
]

# ---------------------------------------------------------------------- planners
def default_planners(every: int | None = None, passes_per_bucket: int = 1) -> dict[str, Planner]:
    """The planners a backtest compares, ``moetrace`` (the deployed default) first.

    ``moetrace`` is a fresh :class:`~moetrace.placement.select.ValidatedPlanner`
    whose folds are scored on ``every`` buckets (``None``: fifths of the history; its
    explanation counts ``passes_per_bucket`` passes a bucket);
    the others are the :data:`~moetrace.placement.planners.CANDIDATES` it chooses from.
    """
    return {"moetrace": ValidatedPlanner(every, passes_per_bucket=passes_per_bucket), **{name: CANDIDATES[name] for name in ("moetrace-robust", "moetrace-fit", "greedy")}}


def oracle_plan(load: np.ndarray, config: PlacementConfig) -> np.ndarray:
    """The plan fitted to the very load it is scored on, ``phy2log [L, N]``: the headroom no forecast can beat (within ``config.refine_work``)."""
    return plan_experts(load, config.replicas, config.groups, config.nodes, config.gpus, refine_work=config.refine_work).phy2log


def _check(series: PassSeries, config: PlacementConfig) -> None:
    check_placement_args(series.logical[0], config.replicas, config.groups, config.nodes, config.gpus)


def _current_balance(physical: np.ndarray, gpus: int) -> float | None:
    """Balancedness of the trace's own placement (``P / K`` contiguous slots per GPU), or None if ``K`` does not divide ``P``."""
    if physical.shape[-1] % gpus:
        return None
    return balance.balancedness(balance.rank_load(physical, gpus))


def _balance(load: np.ndarray, phy2log: np.ndarray, gpus: int) -> float:
    return balance.balancedness(predicted_gpu_load(load, phy2log, gpus))


# ---------------------------------------------------------------------- hold-out
@dataclasses.dataclass(frozen=True)
class HoldoutResult:
    """Plan on the first ``plan_passes`` passes, score on the remaining ``scored_passes``.

    Attributes:
        in_sample: planner -> balancedness on the passes it was planned on.
        held_out: planner -> balancedness on the held-out passes.
        held_out_windows: planner -> balancedness of each of up to
            ``num_windows`` consecutive held-out windows (the spread); the
            oracle is fitted to each window on its own.
        plans: planner -> ``phy2log [L, N]``.
        selection: how ``moetrace`` chose its candidate on the planned passes.
    """

    plan_passes: int
    scored_passes: int
    in_sample: dict[str, float | None]
    held_out: dict[str, float | None]
    held_out_windows: dict[str, list[float]]
    plans: dict[str, np.ndarray]
    selection: Selection | None = None

    def gap_closed(self) -> dict[str, float | None]:
        """Planner -> share of the greedy-to-oracle gap it closes on the held-out passes (:func:`gap_closed`)."""
        return {k: gap_closed(v, self.held_out.get("greedy"), self.held_out.get("oracle")) for k, v in self.held_out.items() if k not in ("greedy", "oracle")}

    def to_dict(self) -> dict[str, object]:
        return {
            "plan_passes": self.plan_passes,
            "scored_passes": self.scored_passes,
            "in_sample": self.in_sample,
            "held_out": self.held_out,
            "gap_closed": self.gap_closed(),
            "held_out_windows": self.held_out_windows,
            "held_out_spread": {k: _spread(v) for k, v in self.held_out_windows.items()},
            "selection": None if self.selection is None else self.selection.to_dict(),
        }


def gap_closed(value: float | None, greedy: float | None, oracle: float | None) -> float | None:
    """``(value - greedy) / (oracle - greedy)``: 0 = no better than greedy, 1 = as good as the oracle; None without a gap.

    Negative when ``value`` is below greedy. A gap under 1e-6 balancedness is
    no gap (nothing to close: the load is as predictable as it can be).
    """
    if value is None or greedy is None or oracle is None or oracle - greedy < 1e-6:
        return None
    return (value - greedy) / (oracle - greedy)


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values)
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()), "std": float(a.std())}


def holdout(series: PassSeries, fraction: float, config: PlacementConfig, num_windows: int = 4, work: int | None = EVALUATION_WORK) -> HoldoutResult:
    """Plan every planner on the first ``1 - fraction`` of the passes, score on the rest.

    ``work``: swap evaluations all its plans may spend, split evenly over them
    (:meth:`~moetrace.placement.checks.PlacementConfig.sharing`; ``None``: ``config`` as given).

    Raises:
        PlacementError: ``fraction`` outside ``(0, 1)``, too few passes to split,
        or inconsistent sizes.
    """
    if not 0 < fraction < 1:
        raise PlacementError(f"`fraction` must be a fraction in (0, 1) (the share of passes held out), got {fraction!r}")
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
    planners = default_planners(passes_per_bucket=series.bucket)
    validating = sum(len(p.candidates) * p.rule.max_folds for p in planners.values() if isinstance(p, ValidatedPlanner))
    config = config.sharing(work, len(planners) + 1 + len(windows) + validating)
    for name, planner in planners.items():
        phy2log = planner(history, len(history), config, None)
        plans[name] = phy2log
        in_sample[name] = _balance(history.sum(axis=0), phy2log, config.gpus)
        held_out[name] = _balance(future.sum(axis=0), phy2log, config.gpus)
        spread[name] = [_balance(future[w].sum(axis=0), phy2log, config.gpus) for w in windows]
    plans["oracle"] = oracle_plan(future.sum(axis=0), config)
    in_sample["oracle"] = None  # fitted to the held-out passes: it has no planning part
    held_out["oracle"] = _balance(future.sum(axis=0), plans["oracle"], config.gpus)
    spread["oracle"] = [_balance(future[w].sum(axis=0), oracle_plan(future[w].sum(axis=0), config), config.gpus) for w in windows]
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
        selection=planners["moetrace"].selection,
    )


# ---------------------------------------------------------------------- backtest
@dataclasses.dataclass(frozen=True)
class BacktestResult:
    """A replayed rebalancing schedule: ``R`` rebalances, one row each.

    Attributes:
        window, every: passes planned on and passes each plan is deployed for.
        first_pass: ``[R]`` pass id where each deployment starts.
        realized: planner -> ``[R]`` balancedness on the deployment's passes
            (also ``oracle``: the plan fitted to those passes, and ``current``).
        in_sample: planner -> ``[R]`` balancedness on the window it was planned on.
        moved: planner -> ``[R]`` replicas copied to a GPU at each rebalance
            (the first from the trace's own placement when it has ``N`` slots).
        moved_peak: planner -> ``[R]`` the most replicas any one GPU receives
            (transfers run in parallel over GPUs, so this one sets the stall).
        kept: planner -> ``[R]`` balancedness the planner's previous deployment
            would have realised on the same passes (NaN where none was deployed):
            ``realized - kept`` is the balance the rebalance gained.
        chosen: planner -> ``[R]`` candidate deployed, for planners that choose
            (``moetrace``), with ``reasons`` (the last rebalance's explanation).
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
    moved_peak: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    kept: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    chosen: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, object]]:
        """Per planner: realised and in-sample balancedness, share of the greedy-to-oracle gap closed, moves, gain over keeping."""
        out: dict[str, dict[str, object]] = {}
        greedy, oracle = self.realized.get("greedy"), self.realized.get("oracle")
        for name, realized in self.realized.items():
            moved = self.moved.get(name)
            row: dict[str, object] = {
                "realized_mean": float(realized.mean()),
                "realized_min": float(realized.min()),
                "in_sample_mean": float(self.in_sample[name].mean()) if name in self.in_sample else None,
                "moved_mean": float(moved.mean()) if moved is not None else 0.0,
                "moved_bytes_mean": float(moved.mean()) * self.expert_bytes if moved is not None and self.expert_bytes else None,
            }
            if greedy is not None and name != "greedy":
                row["below_greedy_share"] = float((realized < greedy - 1e-12).mean())
                row["gain_over_greedy"] = float((realized - greedy).mean())
            if greedy is not None and oracle is not None and name not in ("greedy", "oracle"):
                row["gap_closed"] = gap_closed(float(realized.mean()), float(greedy.mean()), float(oracle.mean()))
            kept = self.kept.get(name)
            if kept is not None and np.isfinite(kept).any():
                row["gain_over_kept_mean"] = float(np.nanmean(realized - kept))
            if name in self.chosen:
                names, counts = np.unique(self.chosen[name], return_counts=True)
                row["chosen_share"] = {str(k): float(c) / len(self.chosen[name]) for k, c in zip(names, counts, strict=True)}
            out[name] = row
        return out

    def to_dict(self) -> dict[str, object]:
        def listed(values: dict[str, np.ndarray]) -> dict[str, list[float | None]]:
            return {k: [None if not np.isfinite(x) else float(x) for x in v] for k, v in values.items()}

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
            "moved_peak": {k: v.tolist() for k, v in self.moved_peak.items()},
            "kept": listed(self.kept),
            "chosen": self.chosen,
            "reasons": self.reasons,
        }


def _rebalance_starts(series: PassSeries, window: int, every: int, config: PlacementConfig) -> list[int]:
    """The bucket index of each rebalance; checks ``window`` and ``every`` (positive multiples of the buckets),
    then ``series`` against ``config``, then that one rebalance fits."""
    for name, value in (("window", window), ("every", every)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PlacementError(f"`{name}` must be a positive number of passes, got {value!r}")
        if value % series.bucket:
            raise PlacementError(f"`{name}`={value} is not a multiple of the series' {series.bucket}-pass buckets")
    _check(series, config)
    w, s = window // series.bucket, every // series.bucket
    starts = list(range(w, len(series) - s + 1, s))
    if not starts:
        raise PlacementError(
            f"the trace has {int(series.passes.sum())} passes; a backtest needs at least `window` + `every` = {window + every}; "
            "pass a smaller `window`/`every` or record longer"
        )
    return starts


@dataclasses.dataclass
class _PlannerTrack:
    """One planner's replay: its deployed ``phy2log [L, P]`` and a value per rebalance of each series."""

    deployed: np.ndarray | None
    validated: bool
    realized: list[float] = dataclasses.field(default_factory=list)
    in_sample: list[float] = dataclasses.field(default_factory=list)
    moved: list[int] = dataclasses.field(default_factory=list)
    moved_peak: list[int] = dataclasses.field(default_factory=list)
    kept: list[float] = dataclasses.field(default_factory=list)
    chosen: list[str] = dataclasses.field(default_factory=list)
    reason: str = ""

    def deploy(self, phy2log: np.ndarray, recent: np.ndarray, nxt: np.ndarray, gpus: int) -> None:
        """Score ``phy2log`` on the planning window ``recent [L, E]`` and the next deployment ``nxt [L, E]``, then deploy it."""
        before = self.deployed
        self.realized.append(_balance(nxt, phy2log, gpus))
        self.in_sample.append(_balance(recent, phy2log, gpus))
        per_gpu = np.zeros(gpus, dtype=np.int64) if before is None else moved_per_gpu(before, phy2log, gpus)
        self.moved.append(int(per_gpu.sum()))
        self.moved_peak.append(int(per_gpu.max()))
        self.kept.append(np.nan if before is None else _balance(nxt, before, gpus))
        self.deployed = phy2log


def backtest(
    series: PassSeries,
    window: int,
    every: int,
    config: PlacementConfig,
    planners: dict[str, Planner] | None = None,
    expert_bytes: int | None = None,
    work: int | None = EVALUATION_WORK,
    progress: Callable[[int, int], None] | None = None,
) -> BacktestResult:
    """Replay: at each rebalance plan on the last ``window`` passes, deploy for the next ``every``.

    ``window`` and ``every`` are in passes and must be multiples of
    ``series.bucket``. The first rebalance happens once ``window`` passes are
    seen; a final deployment shorter than ``every`` is dropped. ``planners``
    defaults to :func:`default_planners` (validated on folds of ``every``);
    the oracle is scored beside them. ``work``: swap evaluations all the
    replay's plans may spend, split evenly over the most it can make (each
    rebalance's planners and oracle, and a validated planner's candidates on
    each fold; ``None``: ``config`` as given). ``progress(rebalances done,
    rebalances)`` is called after each rebalance.

    Raises:
        PlacementError: bad sizes, or a trace too short for one rebalance.
    """
    starts = _rebalance_starts(series, window, every, config)
    w, s = window // series.bucket, every // series.bucket
    planners = default_planners(s, series.bucket) if planners is None else planners
    validating = sum(len(p.candidates) for p in planners.values() if isinstance(p, ValidatedPlanner))  # each fold end is planned once per candidate
    config = config.sharing(work, len(starts) * (len(planners) + 1 + validating))
    deployed_start = series.physical_to_logical if series.physical_to_logical.shape[1] == config.replicas else None
    tracks = {name: _PlannerTrack(deployed_start, isinstance(p, ValidatedPlanner)) for name, p in planners.items()}
    current: list[float] = []
    oracle: list[float] = []
    for t in starts:
        history = series.logical[:t]
        recent, nxt = history[-w:].sum(axis=0), series.logical[t : t + s].sum(axis=0)
        for name, planner in planners.items():
            track = tracks[name]
            track.deploy(planner(history, w, config, track.deployed), recent, nxt, config.gpus)
            if track.validated:
                track.chosen.append(planner.selection.chosen)
                track.reason = planner.selection.reason
        oracle.append(_balance(nxt, oracle_plan(nxt, config), config.gpus))
        figure = _current_balance(series.physical[t : t + s].sum(axis=0), config.gpus)
        if figure is not None:
            current.append(figure)
        if progress is not None:
            progress(len(oracle), len(starts))
    realized = {k: np.asarray(track.realized) for k, track in tracks.items()}
    realized["oracle"] = np.asarray(oracle)
    if len(current) == len(starts):
        realized["current"] = np.asarray(current)
    return BacktestResult(
        window=window, every=every, config=config, first_pass=series.first_pass[starts], realized=realized,
        in_sample={k: np.asarray(track.in_sample) for k, track in tracks.items()},
        moved={k: np.asarray(track.moved) for k, track in tracks.items()}, expert_bytes=expert_bytes,
        moved_peak={k: np.asarray(track.moved_peak) for k, track in tracks.items()},
        kept={k: np.asarray(track.kept, dtype=np.float64) for k, track in tracks.items()},
        chosen={k: track.chosen for k, track in tracks.items() if track.validated},
        reasons={k: track.reason for k, track in tracks.items() if track.validated and track.chosen},
    )


#: :func:`held_out_estimate` plans on one of this many consecutive parts of a trace and scores on the next.
ESTIMATE_PARTS = 5


def plan_with_selection(
    weight: np.ndarray,
    series: PassSeries | None,
    config: PlacementConfig,
    current: np.ndarray | None = None,
    work: int | None = PLAN_WORK,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[PlacementPlan, Selection]:
    """moetrace's plan to deploy now, and why: the candidate that held best on the trace's own past.

    With a time-ordered ``series`` the candidates are validated on its fifths
    (plan on one, score on the next; :class:`~moetrace.placement.select.ValidatedPlanner`)
    and the chosen one plans on the whole series. Without one nothing can be
    validated, so the baseline (greedy on ``weight [L, E]``) is deployed. The
    plan's ``gpu_load`` is under the planned-on total; renumbered to keep
    replicas where ``current`` has them. ``work``: swap evaluations the
    validation's plans and the deployed one may spend (half each,
    :class:`~moetrace.placement.select.ValidatedPlanner`; ``None``: ``config``
    as given); ``progress(folds done, folds)`` after each validation fold.
    """
    if series is not None and len(series) >= 2:
        planner = ValidatedPlanner(passes_per_bucket=series.bucket, progress=progress, work=work)
        phy2log = planner(series.logical, len(series), config, current)
        selection = planner.selection
        assert selection is not None
        weight = series.logical.sum(axis=0)
    else:
        selection = Selection(
            BASELINE, f"no time-ordered passes to validate on (a stat trace without a window, or fewer than 2 passes); {BASELINE}, the baseline, is deployed",
            0, 0, [], {}, 0.0,
        )
        return baseline_plan(weight, config, current), selection
    return _as_plan(weight, phy2log, config), selection


def _as_plan(weight: np.ndarray, phy2log: np.ndarray, config: PlacementConfig) -> PlacementPlan:
    log2phy, logcnt = log2phy_from_phy2log(phy2log, weight.shape[1])
    hierarchical = eplb_policy(weight.shape[1], config.groups, config.nodes)[1] == config.nodes
    return PlacementPlan(phy2log, log2phy, logcnt, predicted_gpu_load(weight, phy2log, config.gpus), hierarchical)


def baseline_plan(weight: np.ndarray, config: PlacementConfig, current: np.ndarray | None = None) -> PlacementPlan:
    """EPLB's plan (:data:`~moetrace.placement.select.BASELINE`) for loads ``weight [L, E]``, its slots kept where ``current`` has them."""
    weight = check_placement_args(weight, config.replicas, config.groups, config.nodes, config.gpus)
    phy2log = CANDIDATES[BASELINE](weight[None], 1, config, None)
    if current is not None:
        deployed = check_current(current, weight.shape[0], weight.shape[1], config.replicas)
        phy2log = align_to(deployed, phy2log, eplb_policy(weight.shape[1], config.groups, config.nodes)[1], config.gpus)
    return _as_plan(weight, phy2log, config)


def plan_placement(
    weight: np.ndarray, series: PassSeries | None, config: PlacementConfig, current: np.ndarray | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PlacementPlan:
    """moetrace's plan to deploy now (:func:`plan_with_selection` without the explanation)."""
    return plan_with_selection(weight, series, config, current, progress=progress)[0]


def held_out_estimate(
    series: PassSeries | None, config: PlacementConfig, parts: int = ESTIMATE_PARTS, work: int | None = EVALUATION_WORK,
    progress: Callable[[int, int], None] | None = None,
) -> BacktestResult | None:
    """Held-out estimate of every planner: plan on one of ``parts`` consecutive parts, score on the next.

    ``None`` when there is no series or it has fewer than ``parts`` buckets.
    ``work`` and ``progress`` go to :func:`backtest`.
    """
    if series is None or len(series) < parts:
        return None
    part = (len(series) // parts) * series.bucket
    return backtest(series, part, part, config, work=work, progress=progress)


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
