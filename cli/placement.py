"""``moetrace placement``: plan expert placement, and say how well it will hold on the next window.

Every balancedness figure is labelled as what it is: *in-sample* (planned and
scored on the same passes: a fit, not a forecast) or *held-out* (planned on
earlier passes, scored on later ones). Three modes:

- default: plan on the whole trace; per-layer in-sample table, plus a held-out
  estimate (plan on one fifth of the passes, score on the next fifth; mean and
  range over the four deployments) when the trace is time-ordered;
- ``--holdout F``: plan on the first ``1 - F`` of the passes, score on the rest;
- ``--backtest --window W --every S``: replay a rebalancing schedule, with
  the cost of each rebalance (replicas and bytes moved, the stall) against the
  balance it gains on the next window.

The deployed plan comes from the candidate planner that held best on the
trace's own past (validation on rolling folds, greedy unless another one beat
it clearly); the output says which and why. Every evaluation shows the oracle
(a plan fitted to the scored passes themselves) and the share of the
greedy-to-oracle gap each planner closes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from moetrace import balance
from moetrace.analysis.source import load_series, select_layers
from moetrace.analysis.traffic import plan_inter_node_share
from moetrace.ids import to_logical
from moetrace.placement.backtesting import (
    BacktestResult,
    backtest,
    baseline_plan,
    bucket_for,
    gap_closed,
    held_out_estimate,
    holdout,
    plan_with_selection,
)
from moetrace.placement.checks import PlacementConfig, PlacementError
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import PlacementPlan, predicted_gpu_load
from moetrace.placement.series import PassSeries
from moetrace.trace.pass_phases import pass_phase_physical_count, phase_of
from moetrace.trace.reader import open_trace
from moetrace.trace.schema import Attr, TraceDamageError, TraceError

from .errors import CommandError, guarded
from .options import (
    PHASE_HELP,
    existing_file,
    output_path,
    parse_layers,
    pass_phase_option,
    stage_meter,
    stdout_console,
)
from .placement_format import FORMATS, write_plan
from .placement_replan import moved_from_current, print_replan, weigh_replan
from .placement_report import print_rebalance_value, print_selection, rebalance_values

__all__ = ["placement"]

LAYERS_HELP = "Model layer ids to plan for, e.g. '0,7,12-15' (default: all)."
PLANNER_ORDER = ("current", "greedy", "moetrace-fit", "moetrace-robust", "moetrace", "oracle")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _spread(values: list[float] | np.ndarray) -> str:
    a = np.asarray(values, dtype=np.float64)
    return "-" if a.size == 0 else f"{a.mean():.3f} ({a.min():.3f}-{a.max():.3f})"


def _sizes(num_experts: int, gpus: int, replicas: int | None, groups: int | None, nodes: int | None) -> tuple[PlacementConfig, list[str]]:
    """Fill the defaults: ``--replicas`` E rounded up to a multiple of K, ``--groups`` and ``--nodes`` 1."""
    used = []
    if replicas is None:
        replicas = math.ceil(num_experts / gpus) * gpus
        why = "the expert count" if replicas == num_experts else f"the {num_experts} experts rounded up to a multiple of --gpus"
        used.append(f"--replicas {replicas} ({why})")
    if groups is None:
        groups = 1
        used.append("--groups 1")
    if nodes is None:
        nodes = 1
        used.append("--nodes 1")
    return PlacementConfig(replicas, groups, nodes, gpus), used


def _read_current(path: Path) -> np.ndarray:
    try:
        document = json.loads(existing_file(path, "plan").read_text())
        return np.asarray(document["phy2log"], dtype=np.int64)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CommandError(f"--current {path}: not a placement plan with a phy2log list (write one with `moetrace placement ... --out`): {exc}") from None


def _expert_bytes(attrs: dict[str, Any], intermediate_size: int | None) -> int | None:
    """Bytes of one SwiGLU expert (gate, up, down: ``3·H·I·b``) from the trace's ``H`` and ``b``."""
    if intermediate_size is None:
        return None
    hidden = int(attrs.get(Attr.HIDDEN_SIZE) or 0)
    if hidden <= 0:
        raise CommandError("--intermediate-size needs the trace's hidden size, and this trace does not carry one (record with RecorderConfig(hidden_size=...))")
    return 3 * hidden * intermediate_size * int(attrs.get(Attr.DTYPE_BYTES) or 2)


def _series(tr: Any, index: np.ndarray, bucket: int | None, required: bool, phase: int | None = None) -> PassSeries | None:
    try:
        return load_series(tr, index, bucket, phase)
    except TraceDamageError:
        raise  # a damaged trace is never answered with the fallback plan
    except TraceError:
        if required:
            raise
        return None


def _many_series(traces: list[Path], layers: list[int] | None, bucket: int | None, scheduler: str | None) -> PassSeries:
    from moetrace.analysis.distributed import dask_client, pass_series

    files = [existing_file(t) for t in traces]
    if scheduler is None:
        return pass_series(files, layers=layers, bucket=bucket)
    with dask_client(scheduler) as client:
        return pass_series(files, layers=layers, bucket=bucket, client=client)


def _in_sample_table(console: Console, layer_ids: list[int], figures: dict[str, np.ndarray | None], plan: PlacementPlan, config: PlacementConfig) -> None:
    c = config
    table = Table(
        title=f"In-sample balancedness per layer: planned and scored on the same passes (a fit, not a forecast)\n"
        f"{c.replicas} slots, {c.groups} groups, {c.nodes} nodes, {c.gpus} GPUs ({'hierarchical' if plan.hierarchical and c.groups > 1 else 'global'})",
        title_justify="left",
    )
    for col in ("layer", "current", "greedy", "moetrace", "max replicas"):
        table.add_column(col, justify="right")
    for i, layer in enumerate(layer_ids):
        table.add_row(str(layer), *(_fmt(None if figures[k] is None else float(balance.layer_balancedness(figures[k])[i])) for k in ("current", "greedy", "moetrace")), str(int(plan.logcnt[i].max())))
    table.add_row("all", *(_fmt(None if figures[k] is None else balance.balancedness(figures[k])) for k in ("current", "greedy", "moetrace")), str(plan.log2phy.shape[2]), style="bold")
    console.print(table)


def _holdout_table(console: Console, result: Any) -> None:
    table = Table(
        title=f"Hold-out: planned on the first {result.plan_passes} passes, scored on the next {result.scored_passes}",
        title_justify="left",
    )
    for col in ("planner", "in-sample (fit)", "held-out", "gap closed", "held-out windows mean (min-max)"):
        table.add_column(col, justify="right" if col != "planner" else "left")
    closed = result.gap_closed()
    for name in PLANNER_ORDER:
        if name in result.held_out:
            table.add_row(name, _fmt(result.in_sample[name]), _fmt(result.held_out[name]), _share(closed.get(name)), _spread(result.held_out_windows[name]))
    console.print(table)
    console.print("gap closed = share of the greedy-to-oracle gap on the held-out passes (oracle = a plan fitted to them; 0% = greedy, 100% = oracle)")


def _backtest_table(console: Console, result: BacktestResult) -> None:
    summary = result.summary()
    table = Table(
        title=f"Backtest: plan on {result.window} passes, deploy for the next {result.every}, {len(result.first_pass)} rebalances "
        "(realised = held-out balancedness of each deployment)",
        title_justify="left",
    )
    cols = ["planner", "realised mean", "realised min", "in-sample mean (fit)", "gap closed", "below greedy", "moved/rebalance"]
    if result.expert_bytes:
        cols.append("bytes/rebalance")
    for col in cols:
        table.add_column(col, justify="right" if col != "planner" else "left")
    for name in PLANNER_ORDER:
        if name not in summary:
            continue
        row = summary[name]
        below = row.get("below_greedy_share")
        unmoved = name in ("current", "oracle")
        cells = [name, _fmt(row["realized_mean"]), _fmt(row["realized_min"]), _fmt(row["in_sample_mean"]), _share(row.get("gap_closed")),
                 _share(below), "-" if unmoved else f"{row['moved_mean']:.1f}"]
        if result.expert_bytes:
            cells.append("-" if unmoved else f"{row['moved_bytes_mean']:,.0f}")
        table.add_row(*cells)
    console.print(table)
    if "moetrace" in result.chosen:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in summary["moetrace"]["chosen_share"].items())
        console.print(f"moetrace deployed, by validation on the past at each rebalance: {shares} of the rebalances")


#: The planners' parameters (named in backticks in their errors) as this command's flags.
_FLAGS = {"fraction": "--holdout", "window": "--window", "every": "--every", "replicas": "--replicas"}


def _library_errors_as_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Re-raise a :class:`PlacementError` with the parameters it names spelled as this command's flags."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except PlacementError as exc:
            raise CommandError(re.sub(r"`(\w+)`", lambda m: _FLAGS.get(m[1], m[1]), str(exc))) from None

    return wrapper


@guarded
@_library_errors_as_flags
def placement(
    traces: Annotated[list[Path], typer.Argument(help="A moetrace HDF5 trace whose logical counts are the loads, or the per-rank files / segments of one run.")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs K.")],
    replicas: Annotated[int | None, typer.Option("--replicas", help="Physical expert slots N in total (default: experts rounded up to a multiple of --gpus).")] = None,
    groups: Annotated[int | None, typer.Option("--groups", help="Expert groups G, a divisor of the expert count (default 1).")] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Server nodes M, a divisor of --gpus (default 1).")] = None,
    holdout_fraction: Annotated[float | None, typer.Option("--holdout", help="Plan on the first part of the passes, score on the last FRACTION (e.g. 0.25).")] = None,
    run_backtest: Annotated[bool, typer.Option("--backtest", help="Replay a rebalancing schedule: plan on --window passes, deploy for --every.")] = False,
    window: Annotated[int | None, typer.Option("--window", min=1, help="Passes each backtest plan is made on.")] = None,
    every: Annotated[int | None, typer.Option("--every", min=1, help="Passes each backtest plan is deployed for; with --current, the passes a replan is weighed over.")] = None,
    current: Annotated[Path | None, typer.Option("--current", help="The deployed plan (JSON from --out): moves away from it must pay off.")] = None,
    replan_anyway: Annotated[bool, typer.Option("--replan-anyway", help="With --current: write the new plan even when its weight copies cost more than it saves.")] = False,
    intermediate_size: Annotated[int | None, typer.Option("--intermediate-size", min=1, help="Expert FFN width I: bytes moved = 3·H·I·b per replica (H, b from the trace).")] = None,
    link_gbps: Annotated[float, typer.Option("--link-gbps", min=0.001, help="With --backtest or --current: GB/s a GPU receives expert weights at (sets the rebalance stall).")] = 25.0,
    pass_ms: Annotated[float | None, typer.Option("--pass-ms", min=0.0, help="With --backtest or --current: MoE time per pass now (ms); says whether rebalancing (replanning) pays.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="With --backtest: PNG of realised balancedness over time per planner.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON document (plan and figures) instead of tables.")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the plan (phy2log, log2phy, logcnt, figures) as JSON.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="What --out holds: 'moetrace' (the whole document) or 'sglang' (SGLang's --init-expert-location JSON).")] = "moetrace",
    layers: Annotated[str | None, typer.Option("--layers", help=LAYERS_HELP)] = None,
    scheduler: Annotated[str | None, typer.Option("--scheduler", help="Read several traces' passes on Dask (moetrace[dask]): 'local[:N]' or 'tcp://HOST:PORT'.")] = None,
    phase: Annotated[str | None, typer.Option("--phase", help=PHASE_HELP)] = None,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
) -> None:
    """Plan expert placement with replication; in-sample and held-out balancedness for current / greedy / moetrace."""
    with stage_meter(progress) as update:
        _placement(traces, gpus, replicas, groups, nodes, holdout_fraction, run_backtest, window, every, current, intermediate_size, link_gbps,
                   pass_ms, plot, as_json, out, fmt, layers, scheduler, phase, update, replan_anyway)


def _placement(traces: list[Path], gpus: int, replicas: int | None, groups: int | None, nodes: int | None, holdout_fraction: float | None,
               run_backtest: bool, window: int | None, every: int | None, current: Path | None, intermediate_size: int | None, link_gbps: float,
               pass_ms: float | None, plot: Path | None, as_json: bool, out: Path | None, fmt: str, layers: str | None, scheduler: str | None,
               phase: str | None, update: Callable[[str, int, int], None], replan_anyway: bool = False) -> None:
    """The command's body; ``update(stage, done, total)`` shows progress."""
    phase = _check_options(gpus, run_backtest, window, every, plot, pass_ms, holdout_fraction, fmt, out, phase, len(traces) > 1 or scheduler is not None,
                           current is not None, replan_anyway)
    deployed = None if current is None else _read_current(current)
    bucket = (lambda: bucket_for(window, every)) if run_backtest else (lambda: None)
    loads = _read_loads(traces, parse_layers(layers), scheduler, bucket, _sizes_of(gpus, replicas, groups, nodes),
                        required=run_backtest or holdout_fraction is not None, phase=phase)
    expert_bytes = _expert_bytes(loads.attrs, intermediate_size)
    outcome = _plan(traces, loads, deployed, expert_bytes, functools.partial(update, "validating the planners (folds)"))
    document = outcome.document
    document["pass_phase"] = phase
    if holdout_fraction is not None:
        assert loads.series is not None
        outcome.held = holdout(loads.series, holdout_fraction, loads.config)
        document["holdout"] = outcome.held.to_dict()
    elif run_backtest:
        assert loads.series is not None and window is not None and every is not None
        outcome.replay = backtest(loads.series, window, every, loads.config, expert_bytes=expert_bytes, progress=functools.partial(update, "backtest (rebalances)"))
        document["backtest"] = outcome.replay.to_dict()
        outcome.values = rebalance_values(outcome.replay, expert_bytes, link_gbps, pass_ms)
        document["backtest"]["rebalance_value"] = outcome.values
    else:
        outcome.estimate = held_out_estimate(loads.series, loads.config, progress=functools.partial(update, "held-out estimate (rebalances)"))
        document["held_out_estimate"] = _estimate_dict(outcome.estimate)
        _prefer_the_estimates_winner(outcome, loads, expert_bytes)
    written = weigh_replan(outcome, loads, expert_bytes, link_gbps, pass_ms, every, replan_anyway)
    if written is not None:  # the replan does not pay: keep the deployed plan
        outcome.written = written
        moved_from_current(document, outcome.deployed, written, loads.config.gpus, expert_bytes)
    plan = outcome.written or outcome.plan
    document.update(phy2log=plan.phy2log.tolist(), log2phy=plan.log2phy.tolist(), logcnt=plan.logcnt.tolist(),
                    gpu_load=predicted_gpu_load(loads.weight, plan.phy2log, loads.config.gpus).tolist(), inter_node_share=plan_inter_node_share(traces, loads.layer_ids, plan.phy2log, loads.config.gpus, loads.config.nodes))
    if outcome.replay is not None and plot is not None:
        from moetrace.placement.plot import plot_backtest

        plot_backtest(outcome.replay, plot, title=str(loads.attrs.get(Attr.MODEL) or Path(traces[0]).name))
    if out is not None:
        write_plan(out, fmt, document, loads.weight.shape[1])
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    _print_text(stdout_console(), loads, outcome, plot, out)


def _check_options(gpus: int, run_backtest: bool, window: int | None, every: int | None, plot: Path | None, pass_ms: float | None,
                   holdout_fraction: float | None, fmt: str, out: Path | None, phase: str | None = None, many: bool = False,
                   current: bool = False, replan_anyway: bool = False) -> str | None:
    """Refuse inconsistent options before anything is read (each error names the flags); returns the checked ``--phase``."""
    if gpus <= 0:
        raise CommandError(f"--gpus must be a positive integer, got {gpus}")
    if run_backtest and (window is None or every is None):
        raise CommandError("--backtest needs --window W and --every S (passes planned on, passes deployed for)")
    if (window is not None or plot is not None) and not run_backtest:
        raise CommandError("--window and --plot belong to --backtest; add --backtest")
    if (every is not None or pass_ms is not None) and not (run_backtest or current):
        raise CommandError("--every and --pass-ms belong to --backtest or --current; add --backtest or --current PLAN")
    if replan_anyway and not current:
        raise CommandError("--replan-anyway overrides the weighing of a replan against --current; add --current PLAN")
    if run_backtest and holdout_fraction is not None:
        raise CommandError("--holdout and --backtest are two evaluations; pass one of them")
    if fmt not in FORMATS:
        raise CommandError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    for path in (out, plot):
        if path is not None:
            output_path(path)
    if phase is not None and many:
        raise CommandError("--phase plans on one trace (merge per-rank files first: moetrace merge)")
    return pass_phase_option(phase)


def _sizes_of(gpus: int, replicas: int | None, groups: int | None, nodes: int | None) -> Callable[[int], tuple[PlacementConfig, list[str]]]:
    """The sizes for ``E`` experts, once the trace says ``E`` (:func:`_sizes`)."""
    return lambda num_experts: _sizes(num_experts, gpus, replicas, groups, nodes)


@dataclasses.dataclass
class _Loads:
    """What the trace(s) give the planner: loads over the selected layers and, when time-ordered, their series."""

    layer_ids: list[int]
    num_model_layers: int  # the trace's highest layer id + 1 (SGLang's map has a row for each)
    weight: np.ndarray  # [L, E] logical loads
    physical: np.ndarray  # [L, P] the run's own physical counts
    attrs: dict[str, Any]
    config: PlacementConfig
    defaults: list[str]
    series: PassSeries | None


def _read_loads(traces: list[Path], layers: list[int] | None, scheduler: str | None, bucket_of: Callable[[], int | None],
                sizes: Callable[[int], tuple[PlacementConfig, list[str]]], required: bool, phase: str | None = None) -> _Loads:
    """Read the loads (after the sizes are checked against the trace's expert count, then the backtest bucket);
    ``phase``: the passes of one pass phase only (a prefill-only or decode-only plan)."""
    trace, many = traces[0], len(traces) > 1 or scheduler is not None
    with open_trace(existing_file(trace)) as tr:
        index = select_layers(tr, layers)
        layer_ids = [int(x) for x in tr.layers[index]]
        num_model_layers = int(np.max(tr.layers)) + 1
        code = None if phase is None else phase_of(tr, phase)
        if code is None:
            weight, physical = tr.logical_count()[index].astype(np.float64), tr.physical_count()[index]
        else:
            by_phase = pass_phase_physical_count(tr)[code]
            weight, physical = to_logical(by_phase, tr.physical_to_logical)[index].astype(np.float64), by_phase[index]
        attrs = tr.attrs
        config, defaults = sizes(weight.shape[1])
        bucket = bucket_of()
        series = None if many else _series(tr, index, bucket, required=required, phase=code)
    if many:  # one run's per-rank files / segments: their passes in time order (moetrace.analysis.distributed)
        series = _many_series(traces, layers, bucket, scheduler)
    if series is not None:  # plan and score on the time-ordered passes (a stat trace's window may be shorter than its totals)
        weight, physical = series.logical.sum(axis=0), series.physical.sum(axis=0)
    return _Loads(layer_ids, num_model_layers, weight, physical, attrs, config, defaults, series)


@dataclasses.dataclass
class _Outcome:
    """The plan, its in-sample loads, the document, and the evaluation that was asked for."""

    plan: PlacementPlan
    selection: Any
    loads: dict[str, np.ndarray | None]
    in_sample: dict[str, float | None]
    document: dict[str, Any]
    deployed: np.ndarray | None
    estimate: Any = None
    held: Any = None
    replay: Any = None
    values: Any = None
    written: PlacementPlan | None = None  # the deployed plan, kept when the replan does not pay


def _plan(traces: list[Path], loads: _Loads, deployed: np.ndarray | None, expert_bytes: int | None, progress: Callable[[int, int], None]) -> _Outcome:
    """Plan (the validated planner), greedy beside it, the run's own placement, and the document's head."""
    config, weight, series = loads.config, loads.weight, loads.series
    gpus = config.gpus
    plan, selection = plan_with_selection(weight, series, config, deployed, progress=progress)
    greedy = greedy_rebalance(weight, config.replicas, config.groups, config.nodes, config.gpus)
    gpu_loads = {
        "current": balance.rank_load(loads.physical, gpus) if loads.physical.shape[1] % gpus == 0 else None,
        "greedy": predicted_gpu_load(weight, greedy, gpus),
        "moetrace": predicted_gpu_load(weight, plan.phy2log, gpus),
    }
    in_sample = {k: None if v is None else balance.balancedness(v) for k, v in gpu_loads.items()}
    trace = traces[0]
    document: dict[str, Any] = {
        "schema": "moetrace.placement",
        "schema_version": 3,
        "trace": str(trace) if len(traces) == 1 else [str(t) for t in traces],
        "run_id": loads.attrs.get(Attr.RUN_ID),
        "layers": loads.layer_ids,
        "num_model_layers": loads.num_model_layers,
        "num_replicas": config.replicas,
        "num_groups": config.groups,
        "num_nodes": config.nodes,
        "num_gpus": config.gpus,
        "defaults_used": loads.defaults,
        "hierarchical": plan.hierarchical,
        "planner": selection.chosen,
        "selection": selection.to_dict(),
        "in_sample": {"passes": int(series.passes.sum()) if series is not None else None, "balancedness": in_sample,
                      "layer_balancedness": {k: None if v is None else balance.layer_balancedness(v).tolist() for k, v in gpu_loads.items()}},
    }
    moved_from_current(document, deployed, plan, gpus, expert_bytes)
    return _Outcome(plan, selection, gpu_loads, in_sample, document, deployed)


def _prefer_the_estimates_winner(outcome: _Outcome, loads: _Loads, expert_bytes: int | None) -> None:
    """Deploy EPLB's plan instead when the held-out estimate on this trace has it ahead of moetrace's default.

    The validation chose on folds of the past; the estimate replays the same
    choice on the trace's later parts. When EPLB's plan realised more there on
    average, this user's data says it wins, so it is what gets deployed (and
    the document says why).
    """
    estimate = outcome.estimate
    if estimate is None:
        return
    ours, eplb = float(estimate.realized["moetrace"].mean()), float(estimate.realized["greedy"].mean())
    outcome.document["preferred_by_estimate"] = "moetrace" if ours >= eplb else "greedy"
    if ours >= eplb:
        return
    outcome.plan = baseline_plan(loads.weight, loads.config, outcome.deployed)
    outcome.loads["moetrace"] = predicted_gpu_load(loads.weight, outcome.plan.phy2log, loads.config.gpus)
    outcome.in_sample["moetrace"] = balance.balancedness(outcome.loads["moetrace"])
    document = outcome.document
    document["planner"] = "greedy"
    document["preferred_reason"] = (f"the held-out estimate on this trace has EPLB's plan ahead of the validated choice "
                                    f"({eplb:.4f} vs {ours:.4f} mean next-window balancedness), so EPLB's plan is deployed")
    document["in_sample"]["balancedness"]["moetrace"] = outcome.in_sample["moetrace"]
    document["in_sample"]["layer_balancedness"]["moetrace"] = balance.layer_balancedness(outcome.loads["moetrace"]).tolist()
    moved_from_current(document, outcome.deployed, outcome.plan, loads.config.gpus, expert_bytes)


def _estimate_dict(estimate: Any) -> dict[str, Any] | None:
    """The held-out estimate's JSON (``None`` without enough time-ordered passes)."""
    if estimate is None:
        return None
    return {
        "plan_passes": estimate.window, "scored_passes": estimate.every, "windows": len(estimate.first_pass),
        "realized": {k: v.tolist() for k, v in estimate.realized.items()},
        "summary": {k: {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())} for k, v in estimate.realized.items()},
        "gap_closed": {k: v.get("gap_closed") for k, v in estimate.summary().items() if "gap_closed" in v},
    }


def _print_text(console: Console, loads: _Loads, outcome: _Outcome, plot: Path | None, out: Path | None) -> None:
    """The tables and lines of ``moetrace placement`` without ``--json``."""
    document, estimate = outcome.document, outcome.estimate
    if loads.defaults:
        console.print(f"defaults used: {', '.join(loads.defaults)}")
    _in_sample_table(console, loads.layer_ids, outcome.loads, outcome.plan, loads.config)
    figures = "  ".join(f"{k} {_fmt(outcome.in_sample[k])}" for k in ("current", "greedy", "moetrace"))
    console.print(f"in-sample (planned and scored on the same passes; a fit, not a forecast): {figures}" + ("; inter-node share of token copies: " + ", ".join(f"{k} {_share(v)}" for k, v in document["inter_node_share"].items() if k != "note") if document.get("inter_node_share") else ""))
    print_selection(console, outcome.selection)
    if "preferred_reason" in document:
        console.print(f"deployed instead: [bold]greedy[/bold] ({document['preferred_reason']})")
    if outcome.held is not None:
        _holdout_table(console, outcome.held)
    elif outcome.replay is not None:
        _backtest_table(console, outcome.replay)
        print_rebalance_value(console, outcome.values)
        if plot is not None:
            console.print(f"wrote {plot}")
    elif estimate is not None:
        spread = "  ".join(f"{k} {_spread(estimate.realized[k])}" for k in ("current", "greedy", "moetrace", "oracle") if k in estimate.realized)
        realized = estimate.realized
        closed = gap_closed(float(realized["moetrace"].mean()), float(realized["greedy"].mean()), float(realized["oracle"].mean()))
        console.print(
            f"held-out estimate (planned on {estimate.window} passes, scored on the next {estimate.every}; mean (min-max) over "
            f"{len(estimate.first_pass)} windows): {spread}; moetrace closes {_share(closed)} of the greedy-to-oracle gap"
        )
    else:
        console.print("held-out estimate: n/a (needs a per_pass or per_token trace with enough passes); the figures above are a fit, not a forecast")
    if outcome.deployed is not None and document.get("replicas_moved_from_current") is not None:
        moved = document["replicas_moved_from_current"]
        extra = f" ({document['bytes_moved_from_current']:,} bytes)" if "bytes_moved_from_current" in document else ""
        console.print(f"replicas moved from --current: {moved}{extra}")
    print_replan(console, document.get("recommendation"))
    if out is not None:
        console.print(f"wrote {out}")
