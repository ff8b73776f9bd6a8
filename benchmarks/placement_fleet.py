"""Placement at DeepSeek-V3 size: plan time beside EPLB's, and what a replan under drift copies.

Sizes: 58 MoE layers, 256 experts in 8 groups, 288 slots on 72 GPUs over 8 nodes
(4 slots per GPU). Loads: lognormal skews (sigma 1) per layer; a drifted window
multiplies each expert's load by a lognormal factor (sigma ``--drift``). One run,
one process:

1. Plan time: EPLB's contract (``moetrace.placement.rebalance_experts``, torch
   tensors in and out), moetrace's planner (``plan_experts``; then with the
   deployed plan as ``current``), the robust candidate (scenario refinement, under
   the work the CLI's deployed plan gets: ``PLAN_WORK / 2`` swap evaluations), and
   what the CLI runs (``plan_with_selection``: validation on the series' own folds
   and the deployed plan, ``PLAN_WORK``; then ``held_out_estimate``,
   ``EVALUATION_WORK``). Interleaved rounds, median seconds, ratios to EPLB.
2. Replanning under drift: slots kept, weight copies and bytes (DeepSeek-V3's
   expert: 3 x 7168 x 2048 FP8 bytes = 44 MB) of moetrace's replan against
   vLLM-style slot preservation of the same fresh plan (an expert that stays on
   a GPU keeps its slot; GPUs not renumbered) and against the fresh plan as it
   falls (slots reshuffled).

    python benchmarks/placement_fleet.py            # 3 rounds
    python benchmarks/placement_fleet.py --quick    # 1 round, 16 layers
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, write_results

from moetrace import balance
from moetrace.placement import (
    PassSeries,
    PlacementConfig,
    plan_experts,
    plan_with_selection,
    rebalance_experts,
)
from moetrace.placement.backtesting import held_out_estimate
from moetrace.placement.checks import PLAN_WORK
from moetrace.placement.plan import colocated, keep_slots, predicted_gpu_load, replicas_moved
from moetrace.placement.planners import robust_rebalance

EXPERTS, SLOTS, GROUPS, NODES, GPUS = 256, 288, 8, 8, 72
EXPERT_BYTES = 3 * 7168 * 2048  # DeepSeek-V3 routed expert, FP8


def series_of(rng: np.random.Generator, layers: int, buckets: int, drift: float) -> np.ndarray:
    """``[buckets, L, E]`` token counts: a lognormal skew that drifts a little every bucket."""
    base = rng.lognormal(0, 1.0, (layers, EXPERTS))
    steps = rng.normal(0, drift / np.sqrt(buckets), (buckets, layers, EXPERTS)).cumsum(axis=0)
    return np.floor(rng.poisson(base * np.exp(steps) * 400)).astype(np.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drift", type=float, default=0.6)
    args = parser.parse_args()
    layers, rounds = (16, 1) if args.quick else (58, args.rounds)
    rng = np.random.default_rng(0)
    history = series_of(rng, layers, 40, args.drift)
    config = PlacementConfig(SLOTS, GROUPS, NODES, GPUS)
    before, after = history[:20].sum(axis=0), history[20:].sum(axis=0)
    weight = torch.from_numpy(before)
    deployed = plan_experts(before, SLOTS, GROUPS, NODES, GPUS).phy2log
    series = PassSeries(1, np.ones(40, dtype=np.int64), np.arange(40), history, history, np.tile(np.arange(SLOTS) % EXPERTS, (layers, 1)))
    variants = {
        "eplb": lambda: rebalance_experts(weight, SLOTS, GROUPS, NODES, GPUS),
        "plan_experts": lambda: plan_experts(before, SLOTS, GROUPS, NODES, GPUS),
        "plan_experts_current": lambda: plan_experts(after, SLOTS, GROUPS, NODES, GPUS, current=deployed),
        "robust": lambda: robust_rebalance(history, 20, dataclasses.replace(config, refine_work=PLAN_WORK // 2)),
    }
    seconds = interleaved(variants, rounds=rounds, warmup=0)
    start = time.perf_counter()
    plan, selection = plan_with_selection(before, series, config)
    seconds["default_with_selection"] = time.perf_counter() - start
    start = time.perf_counter()
    estimate = held_out_estimate(series, config)
    seconds["held_out_estimate"] = time.perf_counter() - start
    assert estimate is not None
    eplb = rebalance_experts(weight, SLOTS, GROUPS, NODES, GPUS)[0].numpy()
    ours = plan_experts(before, SLOTS, GROUPS, NODES, GPUS)
    fresh = plan_experts(after, SLOTS, GROUPS, NODES, GPUS).phy2log
    replanned = plan_experts(after, SLOTS, GROUPS, NODES, GPUS, current=deployed).phy2log
    vllm_style = keep_slots(deployed, fresh, GPUS)
    total = layers * SLOTS
    drift = {
        name: {"copies": replicas_moved(deployed, p, GPUS), "kept_slots": int((deployed == p).sum()), "slots": total,
               "bytes": replicas_moved(deployed, p, GPUS) * EXPERT_BYTES, "balancedness_on_new_load": balance.balancedness(predicted_gpu_load(after, p, GPUS))}
        for name, p in (("moetrace replan (current=)", replanned), ("vLLM-style slot preservation", vllm_style), ("fresh plan, slots as they fall", fresh))
    }
    payload = {
        "layers": layers, "experts": EXPERTS, "slots": SLOTS, "groups": GROUPS, "nodes": NODES, "gpus": GPUS, "rounds": rounds,
        "seconds": seconds, "ratio_to_eplb": {k: v / seconds["eplb"] for k, v in seconds.items()},
        "balancedness": {"eplb": balance.balancedness(predicted_gpu_load(before, eplb, GPUS)), "plan_experts": ours.balancedness,
                         "default_with_selection": plan.balancedness},
        "colocated_replicas": {"eplb": int(colocated(eplb, GPUS).sum()), "plan_experts": int(ours.colocated.sum())},
        "selection": selection.reason,
        "held_out_estimate": {k: float(v.mean()) for k, v in estimate.realized.items()},
        "drift": drift,
        "expert_bytes": EXPERT_BYTES,
    }
    path = write_results("placement_fleet", payload)
    for name, s in seconds.items():
        print(f"{name:28s} {s:8.3f} s  ({s / seconds['eplb']:.2f}x EPLB)")
    print("balancedness", payload["balancedness"], "colocated", payload["colocated_replicas"])
    for name, d in drift.items():
        print(f"{name:32s} copies {d['copies']:5d} of {total} slots ({d['bytes'] / 1e9:.1f} GB), kept {d['kept_slots']}, balancedness {d['balancedness_on_new_load']:.4f}")
    print(f"selection: {selection.reason}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
