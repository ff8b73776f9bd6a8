"""The robust candidate's plan under the command's work budget: held-out balance and time against the unbounded search.

DeepSeek-V3 size: 58 MoE layers, 256 experts, loads as in ``placement_fleet.py`` (lognormal
skews per layer drifting over 40 buckets); the robust candidate plans on buckets 10-29 (window
20, the history before it shrinks the estimate) and is scored on buckets 30-39 (held out). For each
layout (``--gpus R`` of the CLI at 8 and 72 GPUs, the report's one redundant slot per GPU at 72,
and DeepSeek-V3's 288 slots in 8 groups over 8 nodes) the swap search runs unbounded, with the
deployed plan's share of a command (``PLAN_WORK / 2``), with one held-out-estimate plan's share
(``EVALUATION_WORK / 40``) and with none (the greedy packing it starts from). CPU seconds,
evaluations spent, held-out balancedness (mean / max GPU load summed over layers) and the mean
scenario peak the search minimises.

    python benchmarks/placement_work.py            # 58 layers
    python benchmarks/placement_work.py --layers 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results
from placement_fleet import series_of

from moetrace import balance
from moetrace.placement.checks import EVALUATION_WORK, PLAN_WORK, PlacementConfig
from moetrace.placement.plan import expected_peak, predicted_gpu_load
from moetrace.placement.planners import RobustSettings, robust_inputs, robust_rebalance

LAYOUTS = {"cli --gpus 8": (256, 1, 1, 8), "cli --gpus 72": (288, 1, 1, 72), "report, 72 GPUs": (360, 1, 1, 72), "DeepSeek-V3 8 groups / 8 nodes": (288, 8, 8, 72)}
WORK = {"unbounded": None, "deployed plan (PLAN_WORK / 2)": PLAN_WORK // 2, "one estimate plan (EVALUATION_WORK / 40)": EVALUATION_WORK // 40, "none (greedy packing)": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=58)
    args = parser.parse_args()
    history = series_of(np.random.default_rng(0), args.layers, 40, 0.6)
    plan_on, future = history[:30], history[30:].sum(axis=0)
    scenarios = robust_inputs(plan_on, 20, RobustSettings())[1]
    rows = []
    for layout, sizes in LAYOUTS.items():
        for label, work in WORK.items():
            config = PlacementConfig(*sizes, refine_work=work)
            start = time.process_time()
            plan = robust_rebalance(plan_on, 20, config)
            seconds = time.process_time() - start
            held = predicted_gpu_load(future, plan.phy2log, config.gpus)
            rows.append({"layout": layout, "sizes": sizes, "work": label, "cpu_s": seconds, "evaluations": plan.refine_work,
                         "held_out_balancedness": balance.balancedness(held),
                         "mean_scenario_peak": float(expected_peak(scenarios, plan.phy2log, config.gpus).sum())})
            print(f"{layout:32s} {label:42s} {seconds:7.2f} s  {plan.refine_work:>13,d} evals  held-out {rows[-1]['held_out_balancedness']:.4f}", flush=True)
    print(f"wrote {write_results('placement_work', {'layers': args.layers, 'rows': rows})}")


if __name__ == "__main__":
    main()
