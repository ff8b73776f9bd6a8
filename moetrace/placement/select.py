"""Choose the planner by validation on the trace's own past, never trusting a hedge that has not held.

Which planner holds best on the next window depends on the load: on
stationary load the plain fit of the window's total (EPLB's greedy) is hard
to beat, on drifting load a hedged plan wins (issue 25). Instead of one fixed
default, :func:`select_planner` replays the candidates on rolling folds of
the planning data itself (plan on ``window`` buckets, score on the next
``every``; the latest folds that fit) and deploys:

- the candidate whose mean realised balancedness over the folds is highest,
  *if* it beats the baseline (``greedy``) by more than ``z`` standard errors
  of the per-fold differences and loses to it in at most ``max_loss_share``
  of the folds;
- the baseline otherwise, or when fewer than ``min_folds`` folds fit.

:class:`ValidatedPlanner` wraps this as a planner (what ``moetrace
placement`` deploys and backtests as ``moetrace``); :class:`Selection` says
what was chosen and why.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping

import numpy as np

from .. import balance
from ..words import counted
from .checks import PlacementConfig
from .eplb import eplb_policy
from .plan import align_to, predicted_gpu_load, replicas_moved
from .planners import CANDIDATES, Planner

__all__ = ["BASELINE", "PlanCache", "Selection", "SelectionRule", "ValidatedPlanner", "gain_over_baseline", "select_planner", "validation_folds"]

#: The planner every other candidate must beat on the folds before it is deployed.
BASELINE = "greedy"


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """When a candidate displaces the baseline.

    Attributes:
        min_folds: folds needed before anything but the baseline is deployed.
        max_folds: the latest folds used (older load says less about the next window).
        z: the mean per-fold gain over the baseline must exceed ``z`` standard
            errors of the per-fold gains (and be positive).
        max_loss_share: the candidate may be below the baseline in at most this share of folds.
        max_cells: the validation's work budget, in plan cells (candidates x
            folds x layers x slots): folds are replayed newest first and only as
            many as fit, so the validation costs a bounded number of plan cells
            whatever the model's size (fewer folds than ``min_folds`` means the
            baseline is deployed, and the reason says why). Counted in work,
            not seconds, so the choice does not depend on the machine's speed:
            8 folds at OLMoE's size (3 x 64), 3 at DeepSeek-V3's (58 x 288).
    """

    min_folds: int = 3
    max_folds: int = 8
    z: float = 1.0
    max_loss_share: float = 0.25
    max_cells: int = 300_000


@dataclasses.dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select_planner`.

    Attributes:
        chosen: the candidate deployed.
        reason: one sentence: the folds, the figures and the rule that decided.
        window, every: buckets planned on and scored on per fold.
        fold_ends: ``[F]`` bucket index where each fold's scored part starts (oldest first).
        realized: candidate -> ``[F]`` balancedness on each fold's scored part.
        margin: chosen's mean minus the baseline's mean over the folds (0 when the baseline is chosen).
        passes_per_bucket: passes in one bucket of the history (the explanation counts passes).
    """

    chosen: str
    reason: str
    window: int
    every: int
    fold_ends: list[int]
    realized: dict[str, list[float]]
    margin: float
    passes_per_bucket: int = 1

    def to_dict(self) -> dict[str, object]:
        return {
            "chosen": self.chosen,
            "reason": self.reason,
            "window_buckets": self.window,
            "every_buckets": self.every,
            "window_passes": self.window * self.passes_per_bucket,
            "every_passes": self.every * self.passes_per_bucket,
            "folds": len(self.fold_ends),
            "margin_over_baseline": self.margin,
            "validation_mean": {k: float(np.mean(v)) if v else None for k, v in self.realized.items()},
            "validation": self.realized,
        }


def _affordable_folds(rule: SelectionRule, num_candidates: int, num_layers: int, config: PlacementConfig) -> int:
    """Folds the validation's work budget pays for: ``rule.max_cells`` over the plan cells of one fold (candidates x layers x slots)."""
    return rule.max_cells // max(num_candidates * num_layers * config.replicas, 1)


def validation_folds(length: int, window: int, every: int, max_folds: int) -> list[int]:
    """Fold starts ``t`` (oldest first): plan on buckets ``[t - window, t)``, score on ``[t, t + every)``, all inside ``length``.

    The latest folds come first to be kept: the last one's scored part ends at ``length``.
    """
    ends = []
    t = length - every
    while t >= window and len(ends) < max_folds:
        ends.append(t)
        t -= every
    return ends[::-1]


class PlanCache:
    """Plans of candidates made without a deployed placement, keyed by (name, window, config, digest of the history they saw).

    Rolling folds overlap from one rebalance to the next, so a backtest plans
    each fold once; share one cache between validated planners with the same candidates.
    """

    def __init__(self) -> None:
        self._plans: dict[tuple[object, ...], np.ndarray] = {}

    def plan(self, name: str, planner: Planner, history: np.ndarray, window: int, config: PlacementConfig) -> np.ndarray:
        key = (name, window, config, history.shape, hashlib.blake2b(np.ascontiguousarray(history).tobytes(), digest_size=16).digest())
        if key not in self._plans:
            self._plans[key] = planner(history, window, config, None)
        return self._plans[key]


def _balance(load: np.ndarray, phy2log: np.ndarray, gpus: int) -> float:
    return balance.balancedness(predicted_gpu_load(load, phy2log, gpus))


def select_planner(
    history: np.ndarray,
    window: int,
    every: int,
    config: PlacementConfig,
    candidates: Mapping[str, Planner] | None = None,
    rule: SelectionRule = SelectionRule(),
    cache: PlanCache | None = None,
    passes_per_bucket: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> Selection:
    """Backtest ``candidates`` on rolling folds of ``history [t, L, E]`` and pick one (see the module docstring).

    Candidates are planned without a deployed placement (their forecast is
    what is compared). ``candidates`` must hold :data:`BASELINE`.
    ``passes_per_bucket`` only words the explanation in passes;
    ``progress(folds done, folds)`` is called after each fold.

    Raises:
        ValueError: no baseline among the candidates, or non-positive ``window``/``every``.
    """
    candidates = CANDIDATES if candidates is None else candidates
    if BASELINE not in candidates:
        raise ValueError(f"candidates must include the baseline {BASELINE!r}, got {sorted(candidates)}")
    if window <= 0 or every <= 0:
        raise ValueError(f"window and every must be positive bucket counts, got {window} and {every}")
    cache = PlanCache() if cache is None else cache
    planned = validation_folds(len(history), window, every, rule.max_folds)
    replayed = planned[::-1][: _affordable_folds(rule, len(candidates), history.shape[1], config)]  # newest first: what the budget leaves out is the oldest load
    scored: dict[int, dict[str, float]] = {}
    for done, t in enumerate(replayed):
        nxt = history[t : t + every].sum(axis=0)
        scored[t] = {name: _balance(nxt, cache.plan(name, planner, history[:t], window, config), config.gpus) for name, planner in candidates.items()}
        if progress is not None:
            progress(done + 1, len(replayed))
    ends = sorted(scored)
    realized: dict[str, list[float]] = {name: [scored[t][name] for t in ends] for name in candidates}
    spent = f" (the validation budget of {rule.max_cells:,} plan cells covers {len(ends)} of {len(planned)})" if len(ends) < len(planned) else ""

    def done(chosen: str, reason: str, margin: float = 0.0) -> Selection:
        return Selection(chosen, reason, window, every, ends, realized, margin, passes_per_bucket)

    if len(ends) < rule.min_folds:
        return done(BASELINE, f"{counted(len(ends), 'validation fold')} fit in the planning data{spent} (plan on {counted(window * passes_per_bucket, 'pass')}, "
                    f"score on the next {every * passes_per_bucket:,}); {rule.min_folds} are needed to trust anything but the baseline, so {BASELINE} is deployed")
    base = np.asarray(realized[BASELINE])
    verdicts = []
    best, best_mean = BASELINE, float(base.mean())
    for name in candidates:
        if name == BASELINE:
            continue
        mean, error, losses = gain_over_baseline(realized[name], base)
        ok = mean > 0 and mean > rule.z * error and losses <= rule.max_loss_share
        verdicts.append(f"{name} {mean:+.4f} ± {error:.4f}, below in {losses:.0%}{'' if ok else ' (not kept)'}")
        if ok and base.mean() + mean > best_mean:
            best, best_mean = name, float(base.mean()) + mean
    folds = f"{counted(len(ends), 'fold')} of the planning data{spent} (plan on {counted(window * passes_per_bucket, 'pass')}, score on the next {every * passes_per_bucket:,})"
    vs = f"mean gain over {BASELINE} (± standard error): " + "; ".join(verdicts)
    if best == BASELINE:
        return done(BASELINE, f"no candidate beat {BASELINE} by more than {rule.z:g} x its standard error with at most {rule.max_loss_share:.0%} of folds below it on {folds}; {vs}")
    margin = best_mean - float(base.mean())
    return done(best, f"{best} held best on {folds}: {best_mean:.4f} vs {BASELINE} {base.mean():.4f} ({margin:+.4f}); {vs}", margin)


def gain_over_baseline(realized: list[float], baseline: np.ndarray) -> tuple[float, float, float]:
    """A candidate's balancedness on the folds ``[F]`` against the baseline's ``[F]``: the mean gain, its
    standard error, and the share of folds where it is below the baseline."""
    gain = np.asarray(realized) - baseline
    return float(gain.mean()), float(gain.std(ddof=1) / np.sqrt(len(gain))) if len(gain) > 1 else 0.0, float((gain < -1e-12).mean())


class ValidatedPlanner:
    """A planner that deploys the candidate :func:`select_planner` picks on the history it is given.

    ``every`` is the scored length of each fold in buckets (the deployment
    interval); ``None`` validates on fifths of the history (plan on one, score
    on the next). The chosen plan is renumbered to keep replicas where the
    deployed placement has them (:func:`~moetrace.placement.plan.align_to`;
    loads unchanged). :attr:`selection` holds the last decision; ``progress``
    goes to :func:`select_planner`. ``work``: swap evaluations the validation's
    plans (half, split evenly over them) and the deployed plan (half) may spend
    (:meth:`~moetrace.placement.checks.PlacementConfig.sharing`); ``None``: each
    plans under the config it is given.
    """

    def __init__(
        self,
        every: int | None = None,
        candidates: Mapping[str, Planner] | None = None,
        rule: SelectionRule = SelectionRule(),
        cache: PlanCache | None = None,
        passes_per_bucket: int = 1,
        progress: Callable[[int, int], None] | None = None,
        work: int | None = None,
    ) -> None:
        self.passes_per_bucket = passes_per_bucket
        self.progress = progress
        self.every = every
        self.candidates = dict(CANDIDATES if candidates is None else candidates)
        self.rule = rule
        self.work = work
        self.selection: Selection | None = None
        self._cache = PlanCache() if cache is None else cache

    def __call__(self, history: np.ndarray, window: int, config: PlacementConfig, current: np.ndarray | None) -> np.ndarray:
        fold, every = (max(len(history) // 5, 1),) * 2 if self.every is None else (window, self.every)
        validating, deploying = self._configs(len(history), fold, every, history.shape[1], config)
        self.selection = select_planner(history, fold, every, validating, self.candidates, self.rule, self._cache, self.passes_per_bucket, self.progress)
        phy2log = self.candidates[self.selection.chosen](history, window, deploying, current)
        if current is not None and current.shape == phy2log.shape:
            aligned = align_to(current, phy2log, eplb_policy(history.shape[2], config.groups, config.nodes)[1], config.gpus)
            if replicas_moved(current, aligned, config.gpus) < replicas_moved(current, phy2log, config.gpus):
                phy2log = aligned
        return phy2log

    def _configs(self, length: int, window: int, every: int, num_layers: int, config: PlacementConfig) -> tuple[PlacementConfig, PlacementConfig]:
        """``(validation's config, deployed plan's config)``: with ``work``, half of it split over the folds' plans, half to the deployed plan."""
        if self.work is None:
            return config, config
        folds = min(len(validation_folds(length, window, every, self.rule.max_folds)), _affordable_folds(self.rule, len(self.candidates), num_layers, config))
        plans = folds * sum(name != BASELINE for name in self.candidates)
        return config.sharing(self.work // 2, plans), config.sharing(self.work - self.work // 2, 1)
