"""Placement backtest over labelled load regimes: is the default never worse than greedy, and what could better planning gain?

Data: the real OLMoE-1B-7B skew of 6 text domains (reference routers biased
with the packaged counts), scheduled over time by six labelled regimes
(:mod:`moetrace.reference.regimes`: stationary, slow-drift, drift, switches,
bursts, domain-order). The routes are recorded by the real recorder as
``per_token`` traces (H = 2048 recorded; bytes per expert use I = 1024, bf16)
and read back with ``load_series``.

For each regime, seed and placement configuration, ``backtest`` replays a
rebalancing schedule: plan on the last ``W`` passes, deploy for the next ``S``,
score the realised balancedness there. Planners:

- ``moetrace``: the default: the candidate chosen by validation on the
  planning data's own past (``ValidatedPlanner``; greedy unless another held
  better) among greedy, moetrace-fit, moetrace-robust and the hedges
  moetrace-subwindows (no shrinkage) and moetrace-spread (variance-aware replication);
- with ``--hedges``: ``moetrace-3``, the same selection without the two
  hedges, and ``moetrace+ewma``, with the dropped hedge (an exponentially
  weighted forecast) added;
- the candidates ``greedy`` (EPLB's method), ``moetrace-fit``, ``moetrace-robust`` alone;
- ``oracle``: the plan fitted to the scored window itself (the headroom).

Also per regime: a hold-out split (plan on the first 75%, score on the rest),
and the cost of rebalancing against its benefit for intervals ``S`` of 25, 50,
100, 200 passes (default planner and greedy, 64 slots on 8 GPUs; seeds of ``--cost-seeds``).

Run: ``.venv/bin/python benchmarks/placement_backtest.py [--quick]``.
Writes ``benchmarks/results/placement_backtest.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.analysis.source import load_series, select_layers
from moetrace.placement import backtesting as bt
from moetrace.placement.checks import PlacementConfig
from moetrace.placement.cost import rebalance_value
from moetrace.placement.planners import CANDIDATES, HEDGES, Planner
from moetrace.placement.select import PlanCache, ValidatedPlanner
from moetrace.reference.domain_drift import DriftSpec
from moetrace.reference.regimes import REGIMES, regime_routes
from moetrace.trace import open_trace

HIDDEN, INTERMEDIATE, DTYPE_BYTES = 2048, 1024, 2
EXPERT_BYTES = 3 * HIDDEN * INTERMEDIATE * DTYPE_BYTES
CONFIGS = [PlacementConfig(64, 1, 1, 8), PlacementConfig(80, 8, 2, 8)]
INTERVALS = (25, 50, 100, 200)
LINK_BYTES_PER_S = 25e9
DEFAULT = "moetrace"
THREE = ("greedy", "moetrace-fit", "moetrace-robust")  # the candidates before the hedges were added


def planners(every: int, cache: PlanCache, hedges: bool) -> dict[str, Planner]:
    return {
        DEFAULT: ValidatedPlanner(every, cache=cache),
        **({"moetrace-3": ValidatedPlanner(every, candidates={k: CANDIDATES[k] for k in THREE}, cache=cache),
            "moetrace+ewma": ValidatedPlanner(every, candidates={**CANDIDATES, **HEDGES}, cache=cache)} if hedges else {}),
        **{k: CANDIDATES[k] for k in THREE},
    }


def record_trace(path: Path, regime: str, spec: DriftSpec) -> Path:
    passes, _ = regime_routes(regime, spec)
    cfg = RecorderConfig(
        num_layers=3, num_physical_experts=64, top_k=8, ep_size=8, mode="per_token", output_dir=path.parent, layer_ids=(0, 7, 15),
        max_tokens_per_pass=spec.tokens_per_pass, stream_chunk_tokens=65536, hidden_size=HIDDEN, dtype_bytes=DTYPE_BYTES,
        model=f"OLMoE-1B-7B domains, regime {regime}",
    )
    rec = ExpertDistributionRecorder(cfg)
    rec.start_record()
    for ids in passes:
        with rec.with_forward_pass():
            for layer in range(3):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.as_tensor(ids[:, layer]))
    rec.stop_record()
    return rec.dump_record(path)


def regime_summary(cases: list[dict[str, object]], names: list[str]) -> dict[str, dict[str, object]]:
    """Per planner over ``cases``: realised mean/min, below-greedy shares (rebalances, backtests), gap closed, moves."""
    realized = {n: np.concatenate([np.asarray(c["realized"][n]) for c in cases]) for n in names}
    greedy, oracle = realized["greedy"], realized["oracle"]
    per_case = {n: np.array([np.mean(c["realized"][n]) for c in cases]) for n in names}
    out: dict[str, dict[str, object]] = {}
    for n in names:
        row: dict[str, object] = {"realized_mean": float(realized[n].mean()), "realized_min": float(realized[n].min())}
        if n not in ("greedy", "oracle"):
            row.update(
                below_greedy_rebalances=float((realized[n] < greedy - 1e-12).mean()),
                below_greedy_backtests=float((per_case[n] < per_case["greedy"] - 1e-12).mean()),
                gain_over_greedy=float((realized[n] - greedy).mean()),
                gap_closed=bt.gap_closed(float(realized[n].mean()), float(greedy.mean()), float(oracle.mean())),
            )
        if n != "oracle":
            row["moved_per_rebalance"] = float(np.mean(np.concatenate([np.asarray(c["moved"][n])[1:] for c in cases])))
        out[n] = row
    chosen = np.concatenate([np.asarray(c["chosen"][DEFAULT]) for c in cases])
    out[DEFAULT]["chosen_share"] = {str(k): float(v) / len(chosen) for k, v in zip(*np.unique(chosen, return_counts=True), strict=True)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed instead of three, no interval sweep beyond S")
    parser.add_argument("--passes", type=int, default=800)
    parser.add_argument("--tokens-per-pass", type=int, default=64)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated subset of the regimes")
    parser.add_argument("--hedges", action="store_true", help="also run the default without the hedges and with the dropped one")
    parser.add_argument("--cost-seeds", default="0", help="comma-separated seeds of the interval sweep")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    regimes = args.regimes.split(",")
    intervals = (args.every,) if args.quick else INTERVALS
    cost_seeds = [int(x) for x in args.cost_seeds.split(",")]
    cases: list[dict[str, object]] = []
    holdouts: dict[str, list[dict[str, object]]] = {r: [] for r in regimes}
    costs: dict[int, list[dict[str, object]]] = {s: [] for s in intervals}
    plan_seconds: dict[str, float] = {}
    plan_count = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for regime in regimes:
            for seed in seeds:
                spec = DriftSpec(num_passes=args.passes, tokens_per_pass=args.tokens_per_pass, seed=seed)
                path = record_trace(Path(tmp) / f"{regime}-{seed}.h5", regime, spec)
                with open_trace(path) as tr:
                    index = select_layers(tr, None)
                    series = {s: load_series(tr, index, bt.bucket_for(args.window, s)) for s in sorted({args.every, *intervals})}
                    free = load_series(tr, index)
                for config in CONFIGS:
                    main_series = series[args.every]
                    chosen = planners(args.every // main_series.bucket, PlanCache(), args.hedges)
                    timed = {name: p if isinstance(p, ValidatedPlanner) else _timed(p, name, plan_seconds) for name, p in chosen.items()}
                    result = bt.backtest(main_series, args.window, args.every, config, timed, expert_bytes=EXPERT_BYTES)
                    plan_count += len(result.first_pass)
                    cases.append({"regime": regime, "seed": seed, **result.to_dict()})
                    held = bt.holdout(free, 0.25, config)
                    holdouts[regime].append({"seed": seed, "config": dataclasses.asdict(config), **held.to_dict()})
                    line = "  ".join(f"{k} {v.mean():.4f}" for k, v in result.realized.items())
                    print(f"{regime} seed {seed} {config}: {line} [{time.perf_counter() - started:.0f} s]", flush=True)
                for every in intervals if seed in cost_seeds else ():
                    s = series[every]
                    runs = {DEFAULT: ValidatedPlanner(every // s.bucket), "greedy": CANDIDATES["greedy"]}
                    result = bt.backtest(s, args.window, every, CONFIGS[0], runs, expert_bytes=EXPERT_BYTES)
                    costs[every].append({"regime": regime, "seed": seed, **{
                        n: rebalance_value(result, n, EXPERT_BYTES, LINK_BYTES_PER_S).to_dict() for n in runs}})
    names = [*planners(1, PlanCache(), args.hedges), "oracle"]
    by_regime = {r: regime_summary([c for c in cases if c["regime"] == r], names) for r in regimes}
    overall = regime_summary(cases, names)
    hold = {r: _holdout_summary(h) for r, h in holdouts.items()}
    cost_table = {every: _cost_summary(rows) for every, rows in costs.items()}
    print("\nper regime (mean realised; below greedy in rebalances / backtests; gap closed):")
    for r, rows in by_regime.items():
        d = rows[DEFAULT]
        ok = d["realized_mean"] >= rows["greedy"]["realized_mean"] and d["below_greedy_rebalances"] <= 0.25
        print(f"  {r:13s} greedy {rows['greedy']['realized_mean']:.4f}  default {d['realized_mean']:.4f} ({d['below_greedy_rebalances']:.0%} / "
              f"{d['below_greedy_backtests']:.0%}; gap {d['gap_closed']:.0%})  oracle {rows['oracle']['realized_mean']:.4f}  "
              f"{'ok' if ok else 'FAILS the must-show'}")
        print("       " + "  ".join(f"{n} {v['realized_mean']:.4f}" for n, v in rows.items() if n not in (DEFAULT, "greedy", "oracle")))
    for every, row in cost_table.items():
        print(f"cost every {every}: {row}")
    write_results(
        "placement_backtest",
        {
            "data": "real OLMoE-1B-7B domain skews (reference routers) scheduled by labelled regimes (moetrace.reference.regimes), recorded per_token",
            "regimes": {r: REGIMES[r] for r in regimes},
            "seeds": seeds,
            "cost_seeds": cost_seeds,
            "passes": args.passes,
            "tokens_per_pass": args.tokens_per_pass,
            "window": args.window,
            "every": args.every,
            "configs": [dataclasses.asdict(c) for c in CONFIGS],
            "rebalances": sum(len(c["first_pass"]) for c in cases),
            "backtests": len(cases),
            "expert_bytes": EXPERT_BYTES,
            "link_bytes_per_s": LINK_BYTES_PER_S,
            "plan_ms": {k: 1e3 * v / plan_count for k, v in plan_seconds.items()},  # per plan, candidates and hedges alone
            "by_regime": by_regime,
            "overall": overall,
            "holdout": hold,
            "cost": cost_table,
            "cases": cases,
        },
    )


def _holdout_summary(rows: list[dict[str, object]]) -> dict[str, dict[str, float | None]]:
    names = ("current", "greedy", "moetrace-fit", "moetrace-robust", DEFAULT, "oracle")
    out: dict[str, dict[str, float | None]] = {}
    for n in names:
        held = np.array([r["held_out"][n] for r in rows], dtype=np.float64)
        greedy = np.array([r["held_out"]["greedy"] for r in rows])
        oracle = np.array([r["held_out"]["oracle"] for r in rows])
        out[n] = {
            "held_out_mean": float(held.mean()),
            "below_greedy_share": None if n in ("greedy", "oracle") else float((held < greedy - 1e-12).mean()),
            "gap_closed": None if n in ("greedy", "oracle") else bt.gap_closed(float(held.mean()), float(greedy.mean()), float(oracle.mean())),
        }
    chosen = [r["selection"]["chosen"] for r in rows]
    out[DEFAULT]["chosen"] = {k: chosen.count(k) for k in sorted(set(chosen))}
    return out


def _cost_summary(rows: list[dict[str, object]]) -> dict[str, dict[str, float | None]]:
    out = {}
    for n in (DEFAULT, "greedy"):
        values = [r[n] for r in rows]
        saved = float(np.mean([v["saved_share"] for v in values]))
        stall = float(np.mean([v["stall_s"] for v in values]))
        every = values[0]["every"]
        out[n] = {
            "gain": float(np.mean([v["gain"] for v in values])),
            "saved_share": saved,
            "moved": float(np.mean([v["moved"] for v in values])),
            "moved_peak": float(np.mean([v["moved_peak"] for v in values])),
            "bytes_moved": float(np.mean([v["bytes_moved"] for v in values])),
            "stall_s": stall,
            "break_even_pass_s": stall / (every * saved) if saved > 0 else None,
            "regimes_where_it_saves": float(np.mean([v["saved_share"] > 0 for v in values])),
        }
    return out


def _timed(planner: Planner, name: str, seconds: dict[str, float]) -> Planner:
    """``planner``, adding its wall time to ``seconds[name]``."""

    def run(*args: object) -> np.ndarray:
        start = time.perf_counter()
        out = planner(*args)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    return run


if __name__ == "__main__":
    main()
