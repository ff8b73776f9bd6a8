"""Placement backtest: which planner's placement holds on the next window, and what moving costs.

Data: **synthetic drift of real counts** (:mod:`moetrace.reference.drift`). Each
pass serves requests from the 6 real OLMoE-1B-7B domains; each domain's expert
skew is the real one (reference routers biased with the packaged counts); the
domain mix drifts over time (synthetic). The routes are recorded by the real
recorder as ``per_token`` traces (OLMoE sizes: H=2048 recorded in the trace,
expert FFN width I=1024, bf16) and read back with ``load_series``.

For each seed and placement configuration, ``backtest`` replays a rebalancing
schedule: plan on the last ``W`` passes, deploy for the next ``S``, score the
realised balancedness there. Planners:

- ``greedy``: EPLB's replicate-then-pack on the window's total;
- ``moetrace-fit``: moetrace's previous planner (swap search on the window's total);
- ``subwindows``: + packing for the mean peak over 10 sub-windows (no shrinkage, no move penalty);
- ``+shrink``: + loads shrunk 25% toward the longer history;
- ``moetrace``: + a layer keeps its deployed placement unless the new one is
  expected to be >2% better (the default, ``RobustSettings()``);
- ``current``: no rebalancing (the trace's contiguous placement).

Also a hold-out split (plan on the first 75% of the passes, score on the rest)
with the in-sample figure beside it.

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
from moetrace.analysis import backtest as bt
from moetrace.analysis.source import select_layers
from moetrace.reference.drift import DriftSpec, drift_routes
from moetrace.trace import open_trace

HIDDEN, INTERMEDIATE, DTYPE_BYTES = 2048, 1024, 2
CONFIGS = [bt.PlacementConfig(64, 1, 1, 8), bt.PlacementConfig(72, 1, 1, 8), bt.PlacementConfig(80, 8, 2, 8), bt.PlacementConfig(128, 4, 1, 16)]


def _robust(settings: bt.RobustSettings, use_current: bool = True) -> bt.Planner:
    return lambda h, w, c, cur: bt.robust_rebalance(h, w, c, settings, cur if use_current else None).phy2log


PLANNERS: dict[str, bt.Planner] = {
    "greedy": bt.PLANNERS["greedy"],
    "moetrace-fit": bt.PLANNERS["moetrace-fit"],
    "subwindows": _robust(bt.RobustSettings(shrink=0.0, keep_tolerance=0.0), use_current=False),
    "+shrink": _robust(bt.RobustSettings(keep_tolerance=0.0), use_current=False),
    "moetrace": bt.PLANNERS["moetrace"],
}


def record_trace(path: Path, spec: DriftSpec) -> Path:
    passes, _, _ = drift_routes(spec)
    cfg = RecorderConfig(
        num_layers=3, num_physical_experts=64, top_k=8, ep_size=8, mode="per_token", output_dir=path.parent, layer_ids=(0, 7, 15),
        max_tokens_per_pass=spec.tokens_per_pass, stream_chunk_tokens=65536, hidden_size=HIDDEN, dtype_bytes=DTYPE_BYTES, model="OLMoE-1B-7B (synthetic drift)",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed instead of three")
    parser.add_argument("--passes", type=int, default=800)
    parser.add_argument("--tokens-per-pass", type=int, default=64)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--every", type=int, default=50)
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    expert_bytes = 3 * HIDDEN * INTERMEDIATE * DTYPE_BYTES
    cases: list[dict[str, object]] = []
    holdouts: list[dict[str, object]] = []
    plan_seconds: dict[str, float] = dict.fromkeys(PLANNERS, 0.0)
    plan_count = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            spec = DriftSpec(num_passes=args.passes, tokens_per_pass=args.tokens_per_pass, seed=seed)
            path = record_trace(Path(tmp) / f"drift-{seed}.h5", spec)
            with open_trace(path) as tr:
                index = select_layers(tr, None)
                series = bt.load_series(tr, index, bt.bucket_for(args.window, args.every))
                free = bt.load_series(tr, index)
            for config in CONFIGS:
                timed = {name: _timed(planner, name, plan_seconds) for name, planner in PLANNERS.items()}
                result = bt.backtest(series, args.window, args.every, config, timed, expert_bytes=expert_bytes)
                plan_count += len(result.first_pass)
                cases.append({"seed": seed, **result.to_dict()})
                held = bt.holdout(free, 0.25, config)
                holdouts.append({"seed": seed, "config": dataclasses.asdict(config), **held.to_dict()})
                line = "  ".join(f"{k} {v.mean():.4f}" for k, v in result.realized.items())
                print(f"seed {seed} {config}: realised {line}", flush=True)
    realized = {name: np.concatenate([np.asarray(c["realized"][name]) for c in cases]) for name in [*PLANNERS, "current"]}
    in_sample = {name: np.concatenate([np.asarray(c["in_sample"][name]) for c in cases]) for name in PLANNERS}
    moved = {name: np.concatenate([np.asarray(c["moved"][name])[1:] for c in cases]) for name in PLANNERS}  # after the first deployment
    greedy = realized["greedy"]
    per_case_greedy = np.array([np.mean(c["realized"]["greedy"]) for c in cases])
    summary = {}
    for name, values in realized.items():
        row: dict[str, object] = {"realized_mean": float(values.mean()), "realized_min": float(values.min())}
        if name in PLANNERS:
            row.update(
                in_sample_mean=float(in_sample[name].mean()),
                moved_per_rebalance=float(moved[name].mean()),
                moved_bytes_per_rebalance=float(moved[name].mean() * expert_bytes),
                plan_ms=1e3 * plan_seconds[name] / plan_count,
            )
        if name != "greedy":
            per_case = np.array([np.mean(c["realized"][name]) for c in cases])
            row.update(
                below_greedy_rebalances=float((values < greedy - 1e-12).mean()),
                below_greedy_backtests=float((per_case < per_case_greedy - 1e-12).mean()),
                gain_over_greedy=float((values - greedy).mean()),
            )
        summary[name] = row
    hold = {
        name: {
            "in_sample_mean": float(np.mean([h["in_sample"][name] for h in holdouts])),
            "held_out_mean": float(np.mean([h["held_out"][name] for h in holdouts])),
            "below_greedy_share": None if name == "greedy" else float(np.mean([h["held_out"][name] < h["held_out"]["greedy"] - 1e-12 for h in holdouts])),
        }
        for name in ("current", "greedy", "moetrace-fit", "moetrace")
    }
    for name, row in summary.items():
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    for name, row in hold.items():
        print("holdout", name, row)
    write_results(
        "placement_backtest",
        {
            "data": "synthetic drift of real OLMoE-1B-7B domain counts (moetrace.reference.drift), recorded per_token",
            "seeds": seeds,
            "passes": args.passes,
            "tokens_per_pass": args.tokens_per_pass,
            "window": args.window,
            "every": args.every,
            "configs": [dataclasses.asdict(c) for c in CONFIGS],
            "rebalances": len(greedy),
            "backtests": len(cases),
            "expert_bytes": expert_bytes,
            "summary": summary,
            "holdout": hold,
            "cases": cases,
        },
    )


def _timed(planner: bt.Planner, name: str, seconds: dict[str, float]) -> bt.Planner:
    """``planner``, adding its wall time to ``seconds[name]``."""

    def run(*args: object) -> np.ndarray:
        start = time.perf_counter()
        out = planner(*args)
        seconds[name] += time.perf_counter() - start
        return out

    return run


if __name__ == "__main__":
    main()
