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

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from moetrace.analysis.traffic import plan_inter_node_share
from moetrace.placement.backtesting import backtest, bucket_for, held_out_estimate, holdout
from moetrace.placement.checks import PlacementError
from moetrace.placement.plan import predicted_gpu_load
from moetrace.trace.schema import Attr

from ..errors import CommandError, guarded
from ..options import (
    PHASE_HELP,
    output_path,
    parse_layers,
    pass_phase_option,
    stage_meter,
    stdout_console,
    writing,
)
from .explain import rebalance_values
from .format import FORMATS, write_plan
from .loads import expert_bytes_of, read_current, read_loads, sizes_of
from .outcome import estimate_dict, plan_run, prefer_the_estimates_winner
from .replan import moved_from_current, weigh_replan
from .text import print_text

__all__ = ["placement"]

LAYERS_HELP = "Model layer ids to plan for, e.g. '0,7,12-15' (default: all)."


#: The planners' parameters (named in backticks in their errors) as this command's flags.
_FLAGS = {"fraction": "--holdout", "window": "--window", "every": "--every", "replicas": "--slots"}


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
    slots: Annotated[int | None, typer.Option("--slots", help="Physical expert slots N in total (default: experts rounded up to a multiple of --gpus).")] = None,
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
        _placement(traces, gpus, slots, groups, nodes, holdout_fraction, run_backtest, window, every, current, intermediate_size, link_gbps,
                   pass_ms, plot, as_json, out, fmt, layers, scheduler, phase, update, replan_anyway)


def _placement(traces: list[Path], gpus: int, slots: int | None, groups: int | None, nodes: int | None, holdout_fraction: float | None,
               run_backtest: bool, window: int | None, every: int | None, current: Path | None, intermediate_size: int | None, link_gbps: float,
               pass_ms: float | None, plot: Path | None, as_json: bool, out: Path | None, fmt: str, layers: str | None, scheduler: str | None,
               phase: str | None, update: Callable[[str, int, int], None], replan_anyway: bool = False) -> None:
    """The command's body; ``update(stage, done, total)`` shows progress."""
    phase = _check_options(gpus, run_backtest, window, every, plot, pass_ms, holdout_fraction, fmt, out, phase, len(traces) > 1 or scheduler is not None,
                           current is not None, replan_anyway)
    deployed = None if current is None else read_current(current)
    bucket = (lambda: bucket_for(window, every)) if run_backtest else (lambda: None)
    loads = read_loads(traces, parse_layers(layers), scheduler, bucket, sizes_of(gpus, slots, groups, nodes),
                        required=run_backtest or holdout_fraction is not None, phase=phase)
    expert_bytes = expert_bytes_of(loads.attrs, intermediate_size)
    outcome = plan_run(traces, loads, deployed, expert_bytes, functools.partial(update, "validating the planners (folds)"))
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
        document["held_out_estimate"] = estimate_dict(outcome.estimate)
        prefer_the_estimates_winner(outcome, loads, expert_bytes)
    written = weigh_replan(outcome, loads, expert_bytes, link_gbps, pass_ms, every, replan_anyway)
    if written is not None:  # the replan does not pay: keep the deployed plan
        outcome.written = written
        moved_from_current(document, outcome.deployed, written, loads.config.gpus, expert_bytes)
    plan = outcome.written or outcome.plan
    document.update(phy2log=plan.phy2log.tolist(), log2phy=plan.log2phy.tolist(), logcnt=plan.logcnt.tolist(),
                    gpu_load=predicted_gpu_load(loads.weight, plan.phy2log, loads.config.gpus).tolist(),
                    inter_node_share=plan_inter_node_share(traces, loads.layer_ids, plan.phy2log, loads.config.gpus, loads.config.nodes))
    if outcome.replay is not None and plot is not None:
        from moetrace.placement.plot import plot_backtest

        with writing(plot):
            plot_backtest(outcome.replay, plot, title=str(loads.attrs.get(Attr.MODEL) or Path(traces[0]).name))
    if out is not None:
        with writing(out):
            write_plan(out, fmt, document, loads.weight.shape[1])
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    print_text(stdout_console(), loads, outcome, plot, out)


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
