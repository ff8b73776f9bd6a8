"""What a report shows, read from its inputs through the analysis APIs (no figure code here).

Inputs are sorted by what they hold:

- expert traces (any mode; one file, a merged file, or the per-rank files /
  segments of one run): :func:`~moetrace.analysis.summary.analyze_trace` or
  :func:`~moetrace.analysis.distributed.analyze_traces`, the time-ordered
  loads (:func:`~moetrace.placement.backtesting.load_series` /
  :func:`~moetrace.analysis.distributed.pass_series`) and, with EP ranks, a
  placement plan with its in-sample fit and held-out estimate;
- replica traces (a ``/requests`` group): :func:`~moetrace.trace.replica_requests.read_requests`
  and :func:`~moetrace.replicas.analysis.summarize`;
- a routes file (``--routes``): per-request routed experts
  (:func:`~moetrace.routes.load_routes`).

Every read failure is the error ``moetrace analyze`` gives for the same file.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import balance
from ..analysis.source import load_series
from ..analysis.summary import AnalysisReport, analyze_trace
from ..analysis.traffic import Traffic, trace_traffic
from ..placement.backtesting import BacktestResult, held_out_estimate, plan_placement
from ..placement.checks import PlacementConfig
from ..placement.plan import PlacementPlan, predicted_gpu_load
from ..placement.series import PassSeries
from ..replicas.analysis import summarize
from ..routes import RouteSet, load_routes, trace_route_set
from ..trace.pass_phases import phase_of
from ..trace.reader import open_trace
from ..trace.replica_requests import RequestTable, is_replica_trace, read_requests
from ..trace.schema import TraceDamageError, TraceError
from ..trace.token_routes import has_request_rows
from ..words import counted

__all__ = ["Evidence", "ExpertEvidence", "PlacementView", "RoutingEvidence", "gather_evidence", "placement_reading", "placement_view"]


@dataclasses.dataclass(frozen=True)
class PlacementView:
    """A placement for the trace's EP ranks with one redundant slot per GPU, and how it scores.

    Attributes:
        config: the sizes planned for (``N`` slots on ``G`` GPUs).
        plan: moetrace's plan (the planner validated on the time-ordered loads when there are any, else greedy).
        hottest: the ``G`` experts with the most load (the likely replicas).
        current_load: ``[L, G]`` the run's loads on its own placement (in-sample).
        planned_load: ``[L, G]`` the same loads on the plan (in-sample: planned and scored on this run).
        balancedness_before, balancedness_after: ``balance.balancedness`` of those two.
        held_out: plan on one part of the passes, score on the next (``None``: too few passes).
    """

    config: PlacementConfig
    plan: PlacementPlan
    hottest: list[int]
    current_load: np.ndarray
    planned_load: np.ndarray
    balancedness_before: float
    balancedness_after: float
    held_out: BacktestResult | None

    def held_out_spread(self) -> dict[str, dict[str, float]] | None:
        """Planner -> mean / min / max realised balancedness over the held-out deployments."""
        if self.held_out is None:
            return None
        return {k: {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())} for k, v in self.held_out.realized.items()}


def placement_view(weight: np.ndarray, physical: np.ndarray, series: PassSeries | None, gpus: int,
                   progress: Callable[[str, int, int], None] | None = None) -> PlacementView:
    """Plan ``weight [L, E]`` onto ``gpus`` GPUs with one redundant slot each; score it in-sample and held out.

    ``physical [L, P]`` are the run's counts on its own (contiguous) placement;
    ``progress(stage, done, total)`` follows the validation's folds and the estimate's rebalances.
    """
    num_experts = weight.shape[1]
    config = PlacementConfig(math.ceil(num_experts / gpus) * gpus + gpus, 1, 1, gpus)
    staged = (lambda stage: None) if progress is None else (lambda stage: functools.partial(progress, stage))
    plan = plan_placement(weight, series, config, progress=staged("placement: validating the planners (folds)"))
    current = balance.rank_load(physical, gpus)
    planned = predicted_gpu_load(weight, plan.phy2log, gpus)
    return PlacementView(
        config=config,
        plan=plan,
        hottest=sorted(int(e) for e in np.argsort(-weight.sum(axis=0), kind="stable")[:gpus]),
        current_load=current,
        planned_load=planned,
        balancedness_before=balance.balancedness(current),
        balancedness_after=balance.balancedness(planned),
        held_out=held_out_estimate(series, config, progress=staged("placement: held-out estimate (rebalances)")),
    )


@dataclasses.dataclass(frozen=True)
class ExpertEvidence:
    """One run's expert traces analysed.

    Attributes:
        paths: the input files.
        report: the analysis (what ``moetrace analyze`` prints).
        series: time-ordered loads in buckets of passes (``None``: fewer than two passes, or none).
        placement: a plan for the trace's EP ranks (``None`` with one rank).
        traffic: who sends to whom (:func:`~moetrace.analysis.traffic.trace_traffic`; ``None`` without
            ``gpus_per_node``, with one EP rank, or when the traces cannot give it: ``traffic_note`` says why).
    """

    paths: list[Path]
    report: AnalysisReport
    series: PassSeries | None
    placement: PlacementView | None
    traffic: Traffic | None = None
    traffic_note: str | None = None


@dataclasses.dataclass(frozen=True)
class RoutingEvidence:
    """One replica trace: its request table and ``summarize``'s figures."""

    path: Path
    table: RequestTable
    summary: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Everything a report can show; a part is ``None`` / empty when no input holds it."""

    expert: ExpertEvidence | None
    routing: list[RoutingEvidence]
    routes: RouteSet | None
    routes_path: Path | None

    @property
    def inputs(self) -> list[Path]:
        """Every input file, expert traces first."""
        files = list(self.expert.paths) if self.expert else []
        files += [r.path for r in self.routing]
        return files + ([self.routes_path] if self.routes_path else [])


def _series(paths: list[Path], phase: str | None = None) -> PassSeries | None:
    try:
        if len(paths) == 1:
            with open_trace(paths[0]) as trace:
                return load_series(trace, np.arange(trace.num_layers), phase=None if phase is None else phase_of(trace, phase))
        from ..analysis.distributed import pass_series

        return pass_series(paths)
    except TraceDamageError:
        raise  # a damaged trace is never answered without its time axis
    except TraceError:  # fewer than two passes, or a stat trace without a window: no time axis
        return None


def _traffic(paths: list[Path], report: AnalysisReport, gpus_per_node: int | None, phase: str | None) -> tuple[Traffic | None, str | None]:
    """The run's traffic over ``gpus_per_node``-GPU nodes, or ``None`` and the reason."""
    if gpus_per_node is None or report.ep_size <= 1:
        return None, None
    try:
        return trace_traffic(paths, gpus_per_node, phase=phase), None
    except TraceDamageError:
        raise
    except TraceError as exc:
        return None, f"who sends to whom: not shown ({exc})"


def _expert(paths: list[Path], top: int, phase: str | None = None, progress: Callable[[str, int, int], None] | None = None,
            gpus_per_node: int | None = None) -> ExpertEvidence:
    if phase is not None and len(paths) != 1:
        raise ValueError(f"a report of pass phase {phase!r} reads one trace (merge per-rank files first: moetrace merge), got {len(paths)}")
    if len(paths) == 1:
        report = analyze_trace(paths[0], top=top, phase=phase)
    else:
        from ..analysis.distributed import analyze_traces

        report = analyze_traces(paths, top=top)
    series = _series(paths, phase)
    placement = None
    if report.ep_size > 1 and report.logical_count.any():
        placement = placement_view(report.logical_count.astype(np.float64), report.physical_count, series, report.ep_size, progress)
    traffic, note = _traffic(paths, report, gpus_per_node, phase)
    return ExpertEvidence(paths=paths, report=report, series=series, placement=placement, traffic=traffic, traffic_note=note)


def gather_evidence(paths: Sequence[Path], routes: Path | None = None, top: int = 5, phase: str | None = None,
                    progress: Callable[[str, int, int], None] | None = None, gpus_per_node: int | None = None) -> Evidence:
    """Read and analyse the inputs of a report.

    Args:
        paths: expert traces of one run and / or replica traces (files that exist).
        routes: a routes file (``moetrace.routes.save_routes``, an API response body, ``.npy``).
        top: pairs and transitions per layer.
        phase: the expert evidence of one pass phase only (``prefill``, ``decode``, ...; one expert trace).
        progress: ``progress(stage, done, total)`` while the placement is planned and estimated (:func:`placement_view`).
        gpus_per_node: EP ranks per node: adds who sends to whom (the traffic section); ``None``: not.

    Raises:
        TraceError: an input is not a readable trace (the error ``moetrace analyze`` gives).
        RoutesError: the routes file cannot be read.
        ValueError: nothing to report on.
    """
    if not paths and routes is None:
        raise ValueError("nothing to report on: give one or more traces (and / or --routes FILE)")
    files = [Path(p) for p in paths]
    routing_files = [p for p in files if is_replica_trace(p)]
    expert_files = [p for p in files if p not in routing_files]
    routing = []
    for path in routing_files:
        table = read_requests(path)
        routing.append(RoutingEvidence(path, table, summarize(table)))
    return Evidence(
        expert=_expert(expert_files, top, phase, progress, gpus_per_node) if expert_files else None,
        routing=routing,
        routes=load_routes(routes).logical() if routes is not None else _trace_routes(expert_files),
        routes_path=routes,
    )


def _trace_routes(paths: Sequence[Path]) -> RouteSet | None:
    """Per-request routes from the expert traces themselves, when their token rows carry requests (``None`` otherwise)."""
    if not paths:
        return None
    with open_trace(paths[0]) as first:
        if not has_request_rows(first):
            return None
    return trace_route_set(paths).logical()


def placement_reading(view: PlacementView) -> str:
    """One line: the in-sample fit and the held-out estimate of a placement, each labelled."""
    c = view.config
    text = (f"plan {c.replicas} slots on {c.gpus} GPUs (replicating {view.hottest}): in-sample (planned and scored on this run) "
            f"{view.balancedness_before:.3f} -> {view.balancedness_after:.3f}")
    spread = view.held_out_spread()
    if spread is None:
        return text + "; held-out: n/a (too few passes)"
    held = view.held_out
    assert held is not None
    return text + (f"; held-out (planned on {counted(held.window, 'pass')}, scored on the next {held.every}) "
                   + ", ".join(f"{k} {spread[k]['mean']:.3f}" for k in ("current", "greedy", "moetrace") if k in spread))
