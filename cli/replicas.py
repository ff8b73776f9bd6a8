"""``moetrace replicas``: which replica each request goes to — replay a request trace, compare router policies, explain a decision."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from .errors import CommandError, guarded
from .options import existing_file, output_path

__all__ = ["ReplaySettings", "print_replica_report", "replicas_app"]

replicas_app = typer.Typer(name="replicas", help="Requests → replicas: replay a request trace, compare router policies, explain decisions.", no_args_is_help=True)

TRACE_HELP = "Request trace, JSONL in the Mooncake format (plain or .gz); 'mooncake' = the packaged Mooncake FAST'25 trace."


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _load(trace: str, block_size: int, limit: int | None) -> list:
    from moetrace.replicas.workload import load_trace

    path = None if trace == "mooncake" else existing_file(Path(trace), "request trace")
    return load_trace(path, block_size=block_size, limit=limit)


def _cost(requests: list, replicas: int, cost_model: Path | None, utilization: float | None) -> Any:
    from moetrace.replicas.router import CostModel
    from moetrace.replicas.simulate import REFERENCE_COST, scale_to_utilization

    cost = REFERENCE_COST
    if cost_model is not None:
        try:
            cost = CostModel.from_dict(json.loads(existing_file(cost_model, "cost model").read_text()))
        except json.JSONDecodeError as exc:
            raise CommandError(f"{cost_model}: not JSON ({exc.msg}); write one with `moetrace replicas calibrate --out FILE`") from None
    if utilization is not None:
        cost = scale_to_utilization(requests, replicas, cost, utilization)
    return cost


def _check(replicas: int, policy: str | None = None) -> None:
    from moetrace.replicas.router import POLICY_NAMES

    if replicas <= 0:
        raise CommandError(f"--replicas {replicas}: need at least one replica")
    if policy is not None and policy not in POLICY_NAMES:
        raise CommandError(f"--policy {policy!r}: unknown policy; choose one of {', '.join(POLICY_NAMES)}")


AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


@dataclasses.dataclass(frozen=True)
class ReplaySettings:
    """What ``replicas replay`` and ``replicas compare`` share: the request trace, the replicas, the cost model
    and the router's settings. Each field's typer option is defined once, in :data:`_SHARED_OPTIONS`."""

    trace: str
    replicas: int
    block_size: int
    cache_blocks: int
    cost_model: Path | None
    utilization: float | None
    limit: int | None
    as_json: bool
    cache_threshold: float
    balance_abs: int
    balance_rel: float
    overlap_weight: float
    migrate_threshold: int | None
    seed: int

    def requests(self) -> list:
        """The request trace's requests (``--limit`` first ones)."""
        return _load(self.trace, self.block_size, self.limit)

    def router_config(self) -> Any:
        """The router's :class:`~moetrace.replicas.router.RouterConfig` from the policy options."""
        from moetrace.replicas.router import RouterConfig

        return RouterConfig(cache_threshold=self.cache_threshold, balance_abs_threshold=self.balance_abs,
                            balance_rel_threshold=self.balance_rel, overlap_weight=self.overlap_weight,
                            migrate_threshold=self.migrate_threshold, seed=self.seed)


def _shared(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


_SHARED_OPTIONS = (
    _shared("trace", Annotated[str, typer.Argument(help=TRACE_HELP)]),
    _shared("replicas", Annotated[int, typer.Option("--replicas", "-n", help="Replicas behind the router.")], 8),
    _shared("block_size", Annotated[int, typer.Option("--block-size", min=1, help="Tokens per hash_ids block (Mooncake: 512).")], 512),
    _shared("cache_blocks", Annotated[int, typer.Option("--cache-blocks", min=0, help="Prefix-cache capacity of each replica in blocks (0: unlimited).")], 20000),
    _shared("cost_model", Annotated[Path | None, typer.Option("--cost-model", help="Cost model JSON (`moetrace replicas calibrate`); default: the reference calibration.")], None),
    _shared("utilization", Annotated[float | None, typer.Option("--utilization", min=0.0, help="Scale the cost model so that full-prefill work / replica time is this (e.g. 0.9).")], None),
    _shared("limit", Annotated[int | None, typer.Option("--limit", min=1, help="Replay only the first N requests.")], None),
    _shared("as_json", AsJson, False),
    _shared("cache_threshold", Annotated[float, typer.Option("--cache-threshold", min=0.0, max=1.0, help="cache_aware: prefix match rate needed to follow the prefix (SGLang default 0.5).")], 0.5),
    _shared("balance_abs", Annotated[int, typer.Option("--balance-abs", min=0, help="cache_aware: imbalance when max - min load exceeds this (SGLang default 32)...")], 32),
    _shared("balance_rel", Annotated[float, typer.Option("--balance-rel", min=0.0, help="...and max load exceeds this times min load (SGLang default 1.0001).")], 1.0001),
    _shared("overlap_weight", Annotated[float, typer.Option("--overlap-weight", min=0.0, help="kv_cost: weight of prefill blocks (Dynamo default 1).")], 1.0),
    _shared("migrate_threshold", Annotated[int | None, typer.Option("--migrate-threshold", min=0, help="session_sticky: move a session when its owner's load exceeds the least loaded by more than this.")], None),
    _shared("seed", Annotated[int, typer.Option("--seed", help="Seed of the random policy.")], 0),
)


def with_replay_settings(command: Callable[..., None]) -> Callable[..., None]:
    """A typer command taking the :data:`_SHARED_OPTIONS` (after its argument ``trace``, before its own options)
    and calling ``command(settings: ReplaySettings, **own options)``."""
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]
    names = [param.name for param in _SHARED_OPTIONS]

    def run(**options: Any) -> None:
        return command(ReplaySettings(**{name: options.pop(name) for name in names}), **options)

    run.__name__, run.__qualname__, run.__doc__ = command.__name__, command.__qualname__, command.__doc__
    run.__signature__ = inspect.Signature([*_SHARED_OPTIONS, *own])  # type: ignore[attr-defined]
    run.__annotations__ = {param.name: param.annotation for param in (*_SHARED_OPTIONS, *own)}
    return run


@replicas_app.command("replay")
@guarded
@with_replay_settings
def replay_trace(
    settings: ReplaySettings,
    policy: Annotated[str, typer.Option("--policy", "-p", help="The router's policy.")] = "cache_aware",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the replica trace (HDF5, /requests group) here.")] = None,
    plot_load: Annotated[Path | None, typer.Option("--plot-load", help="PNG of per-replica load over time.")] = None,
) -> None:
    """Replay a request trace by its timestamps, in simulated time, through one router policy."""
    from moetrace.replicas.analysis import compare_table, summarize
    from moetrace.replicas.analysis import plot_load as draw_load
    from moetrace.replicas.simulate import simulate
    from moetrace.trace.replica_requests import read_requests

    _check(settings.replicas, policy)
    if out is not None:
        output_path(out)
    requests = settings.requests()
    cost = _cost(requests, settings.replicas, settings.cost_model, settings.utilization)
    result = simulate(requests, settings.replicas, policy, block_size=settings.block_size, cost=cost,
                      cache_blocks=settings.cache_blocks or None, out=out, config=settings.router_config())
    table = read_requests(result.path)
    summary = summarize(table)
    if plot_load is not None:
        draw_load(table, output_path(plot_load))
    if out is None:
        result.path.unlink(missing_ok=True)
    if settings.as_json:
        typer.echo(json.dumps(_jsonable({"summary": summary, "cost_model": cost.to_dict(), "trace": str(out) if out else None}), indent=2))
        return
    typer.echo(compare_table([summary]))
    if out is not None:
        typer.echo(f"replica trace: {out}")


@replicas_app.command("compare")
@guarded
@with_replay_settings
def compare(
    settings: ReplaySettings,
    policies: Annotated[str | None, typer.Option("--policies", help="Comma-separated policies (default: all).")] = None,
    plot_ttft: Annotated[Path | None, typer.Option("--plot-ttft", help="PNG of the TTFT CDF per policy.")] = None,
) -> None:
    """Replay a request trace through every router policy; one row per policy (cache, then latency evidence)."""
    from moetrace.replicas.analysis import compare_table, plot_ttft_cdf, summarize
    from moetrace.replicas.router import POLICY_NAMES
    from moetrace.replicas.simulate import simulate
    from moetrace.replicas.workload import reusable_blocks
    from moetrace.trace.replica_requests import read_requests

    replicas = settings.replicas
    names = [p.strip() for p in policies.split(",")] if policies else list(POLICY_NAMES)
    for name in names:
        _check(replicas, name)
    _check(replicas)
    if plot_ttft is not None:
        output_path(plot_ttft)
    requests = settings.requests()
    cost = _cost(requests, replicas, settings.cost_model, settings.utilization)
    rows, tables = [], {}
    with tempfile.TemporaryDirectory(prefix="moetrace-compare-") as tmp:
        for name in names:
            result = simulate(requests, replicas, name, block_size=settings.block_size, cost=cost, cache_blocks=settings.cache_blocks or None,
                              out=Path(tmp) / f"{name}.h5", config=settings.router_config())
            table = read_requests(result.path)
            rows.append(summarize(table))
            tables[name] = table
    if plot_ttft is not None:
        plot_ttft_cdf(tables, plot_ttft)
    reusable, total = reusable_blocks(requests)
    if settings.as_json:
        typer.echo(json.dumps(_jsonable({"policies": rows, "upper_bound_block_hit_rate": reusable / total, "cost_model": cost.to_dict(),
                                         "requests": len(requests), "replicas": replicas}), indent=2))
        return
    typer.echo(f"{len(requests)} requests, {replicas} replicas, cache {settings.cache_blocks or 'unlimited'} blocks/replica")
    typer.echo(f"unlimited-cache bound: {100 * reusable / total:.1f}% of blocks reusable")
    typer.echo(compare_table(rows))


@replicas_app.command("why")
@guarded
def explain(
    trace: Annotated[Path, typer.Argument(help="A replica trace (HDF5 with /requests).")],
    request_id: Annotated[str, typer.Argument(help="The request's id.")],
    as_json: AsJson = False,
) -> None:
    """Why did this request go to that replica: every candidate's signals and the rule that decided."""
    from moetrace.replicas.analysis import why, why_text
    from moetrace.trace.replica_requests import read_requests

    table = read_requests(existing_file(trace))
    try:
        answer = why(table, request_id)
    except KeyError as exc:
        raise CommandError(str(exc.args[0])) from None
    typer.echo(json.dumps(_jsonable(answer), indent=2) if as_json else why_text(answer))


@replicas_app.command("calibrate")
@guarded
def calibrate(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the cost model JSON here.")] = None,
) -> None:
    """Fit the replay cost model on a live reference replica (prefill per token, decode per step)."""
    from moetrace.drivers.live import calibrate_cost_model

    cost = calibrate_cost_model()
    text = json.dumps(cost.to_dict(), indent=2)
    if out is not None:
        output_path(out).write_text(text + "\n")
    typer.echo(text)


def print_replica_report(path: Path, as_json: bool) -> None:
    """``moetrace analyze`` on a replica trace: the same evidence as ``replicas compare``."""
    from moetrace.replicas.analysis import compare_table, summarize
    from moetrace.trace.replica_requests import read_requests

    summary = summarize(read_requests(path))
    if as_json:
        typer.echo(json.dumps(_jsonable(summary), indent=2))
        return
    typer.echo(f"{path}: replica trace, {summary['requests']} requests ({summary['finished']} finished), {summary['replicas']} replicas, clock {summary['clock']}")
    typer.echo(compare_table([summary]))
    typer.echo("decisions by reason: " + ", ".join(f"{k} {v}" for k, v in summary["reasons"].items()))
    typer.echo("requests per replica: " + " ".join(str(n) for n in summary["requests_per_replica"]))
