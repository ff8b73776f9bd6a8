"""Dense MoE layer vs expert parallelism (exact and padded exchange) on gloo ranks.

Reproduces the seed workload (batch 4, seq 16, hidden 512, intermediate 1024,
8 experts, top-2, 2 ranks, float32 on CPU) and a larger one. All ranks build
the same layer from one seed (rank r holds experts [r·E/R, (r+1)·E/R)) and the
same inputs; rank r processes its 1/R of the tokens (one thread per rank). In
one launch the variants are timed in interleaved rounds, in steady state
(after warm-up, excluding spawn and process-group set-up): EP exact, EP
padded, then the dense layer on all tokens on rank 0, with one thread and with
all the machine's threads, while the other ranks wait at a barrier.

Usage::

    python benchmarks/ep_bench.py --compare [--workload seed|large|all] [--rounds 3]

Prints a table and writes ``benchmarks/results/ep_bench.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results

from moetrace import PHASES, ExpertDistributionRecorder, RecorderConfig
from moetrace.dispatch import ep_ideal_bytes, ep_padded_bytes, exchanged_bytes, tp_bytes
from moetrace.reference import EPMoELayer, MoELayer, SwiGLUExperts, TopKRouter, launch, timed_steps

WORKLOADS: dict[str, dict[str, int]] = {
    "seed": {"batch": 4, "seq": 16, "hidden": 512, "intermediate": 1024, "experts": 8, "top_k": 2, "ranks": 2},
    "large": {"batch": 8, "seq": 64, "hidden": 1024, "intermediate": 2048, "experts": 8, "top_k": 2, "ranks": 2},
}


def _worker(rank: int, world: int, w: dict[str, int], rounds: int, iters: int, cores: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    h, e, k = w["hidden"], w["experts"], w["top_k"]
    tokens = w["batch"] * w["seq"]
    local = tokens // world
    x_all = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1234))
    x = x_all[rank * local : (rank + 1) * local].contiguous()
    router = TopKRouter(h, e, k, seed=11)
    per_rank = e // world
    layers = {
        mode: EPMoELayer(router, SwiGLUExperts(h, w["intermediate"], per_rank, rank * per_rank, seed=12),
                         ep_size=world, ep_rank=rank, mode=mode, max_tokens=local)
        for mode in ("exact", "padded")
    }
    dense = MoELayer(router, SwiGLUExperts(h, w["intermediate"], e, seed=12)) if rank == 0 else None
    times: dict[str, list[float]] = {"dense": [], "dense_1t": [], "exact": [], "padded": []}
    with torch.inference_mode():
        for _ in range(rounds):
            for mode, layer in layers.items():
                times[mode].append(timed_steps(lambda layer=layer: layer(x), warmup=2, iters=iters))
            dist.barrier()
            if dense is not None:
                times["dense_1t"].append(timed_steps(lambda: dense(x_all), warmup=2, iters=iters, barrier=False))
                torch.set_num_threads(cores)
                times["dense"].append(timed_steps(lambda: dense(x_all), warmup=2, iters=iters, barrier=False))
                torch.set_num_threads(1)
            dist.barrier()
        timed = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=e, top_k=k, ep_size=world, ep_rank=rank, timing=True))
        timed.start_record()
        for _ in range(iters):
            with timed.with_forward_pass():
                layers["exact"](x, recorder=timed)
        phases = timed.snapshot().timing["phase_seconds_sum"][0] / iters  # type: ignore[index]
        outputs = {mode: layer(x) for mode, layer in layers.items()}
        layout = layers["exact"].last_layout
        gathered = {}
        for mode, out in outputs.items():
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out)
            gathered[mode] = torch.cat(parts)
        send = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(send, layout.send_counts)
        loads = layout.expert_counts.clone()
        dist.all_reduce(loads)
        result: dict[str, Any] = {
            "times": times,
            "phases_exact_s": dict(zip(PHASES, phases.tolist(), strict=True)),
            "send_counts": torch.stack(send).tolist(),
            "expert_loads": loads.tolist(),
            "expert_bytes_per_rank": layers["exact"].experts.parameter_bytes(),
        }
        if dense is not None:
            reference = dense(x_all)
            result["max_abs_diff"] = {mode: (out - reference).abs().max().item() for mode, out in gathered.items()}
            result["dense_expert_bytes"] = dense.experts.parameter_bytes()
    return result


def run_workload(name: str, rounds: int, iters: int) -> dict[str, Any]:
    w = WORKLOADS[name]
    cores = os.cpu_count() or 1
    results = launch(_worker, w["ranks"], w, rounds, iters, cores, backend="gloo", threads_per_rank=1)
    r0 = results[0]
    tokens, h, k, ranks, b = w["batch"] * w["seq"], w["hidden"], w["top_k"], w["ranks"], 4
    median = {mode: statistics.median(ts) for mode, ts in r0["times"].items() if ts}
    copies = sum(map(sum, r0["send_counts"]))
    off_rank = sum(c for src, row in enumerate(r0["send_counts"]) for dst, c in enumerate(row) if src != dst)
    return {
        "workload": name, **w, "tokens": tokens, "dtype": "float32", "cores": cores,
        "seconds_per_pass": median,
        "tokens_per_s": {mode: tokens / s for mode, s in median.items()},
        "speedup_vs_dense": {mode: median["dense"] / median[mode] for mode in ("dense_1t", "exact", "padded")},
        "speedup_vs_dense_1t": {mode: median["dense_1t"] / median[mode] for mode in ("exact", "padded")},
        "max_abs_diff": r0["max_abs_diff"],
        "phases_exact_s_rank0": r0["phases_exact_s"],
        "send_counts": r0["send_counts"],
        "expert_loads": r0["expert_loads"],
        "expert_bytes_per_rank": r0["expert_bytes_per_rank"],
        "dense_expert_bytes": r0["dense_expert_bytes"],
        "bytes": {
            "tp": tp_bytes(tokens, h, b),
            "ep_ideal": ep_ideal_bytes(tokens, k, h, b),
            "ep_padded": ep_padded_bytes(tokens, k, h, b, ranks),
            "exact_exchanged": exchanged_bytes(copies, h, b),
            "exact_exchanged_off_rank": exchanged_bytes(off_rank, h, b),
        },
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        lines.append(f"## {r['workload']}: T={r['tokens']} (batch {r['batch']} x seq {r['seq']}), H={r['hidden']}, "
                     f"I={r['intermediate']}, E={r['experts']}, top-{r['top_k']}, {r['ranks']} ranks, float32")
        cores = r["cores"]
        lines.append(f"{'variant':<28}{'ms/pass':>10}{'tokens/s':>12}{'vs dense':>10}{'vs dense 1t':>13}{'max|diff|':>12}")
        labels = {"dense": f"dense, 1 rank x {cores} threads", "dense_1t": "dense, 1 rank x 1 thread",
                  "exact": f"EP exact, {r['ranks']} ranks x 1 thread", "padded": f"EP padded, {r['ranks']} ranks x 1 thread"}
        for mode in ("dense", "dense_1t", "exact", "padded"):
            diff = f"{r['max_abs_diff'][mode]:.2e}" if mode in r["max_abs_diff"] else "-"
            ratio = "1.00" if mode == "dense" else f"{r['speedup_vs_dense'][mode]:.2f}"
            ratio_1t = f"{r['speedup_vs_dense_1t'][mode]:.2f}" if mode in r["speedup_vs_dense_1t"] else ("1.00" if mode == "dense_1t" else "-")
            lines.append(f"{labels[mode]:<28}{r['seconds_per_pass'][mode] * 1e3:>10.2f}{r['tokens_per_s'][mode]:>12.0f}{ratio:>10}{ratio_1t:>13}{diff:>12}")
        by = r["bytes"]
        lines.append("bytes/layer (float32): " + ", ".join(f"{k}={v:,}" for k, v in by.items()))
        lines.append(f"send counts [src][dst]: {r['send_counts']}; expert loads: {r['expert_loads']}")
        lines.append(f"expert weights per rank: {r['expert_bytes_per_rank']:,} B vs dense {r['dense_expert_bytes']:,} B")
        lines.append("exact-mode phases on rank 0 (ms): " + ", ".join(f"{p}={s * 1e3:.2f}" for p, s in r["phases_exact_s_rank0"].items()))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", action="store_true", help="dense vs EP comparison (the only action; kept for the documented command)")
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median reported)")
    parser.add_argument("--iters", type=int, default=5, help="passes per timing")
    args = parser.parse_args(argv)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    rows = [run_workload(name, args.rounds, args.iters) for name in names]
    report = {"backend": "gloo", "rounds": args.rounds, "iters": args.iters, "workloads": rows}
    print(_table(rows))
    print(f"wrote {write_results('ep_bench', report)}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
