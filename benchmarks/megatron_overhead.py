"""Overhead of moetrace's Megatron-Core hooks on a training step: plain vs instrumented vs instrumented + timing.

Model: Megatron-Core ``MoELayer`` s from the local spec (no Transformer Engine) in a small
stack (tests/megatron/harness.py: embedding, 4 residual MoE layers of 8 experts, top-2,
hidden 256, expert FFN 512, output head), fp32, at EP=2 over two gloo ranks (alltoall
dispatcher), with Megatron's aux loss and z-loss on. A step is one micro-batch: forward
over 8 x 128 tokens per rank, cross-entropy, backward. Variants, interleaved in one run
(the order rotates every round):

- ``plain``: no hooks;
- ``moetrace``: ``moetrace.adapters.megatron.instrument(model)`` in stat mode, recording
  every pass (router slot, dispatcher taps, one ``with_forward_pass`` per forward);
- ``moetrace+timing``: the same with ``timing=True`` (phases route / dispatch / expert /
  combine wrapped).

Each variant is attached just before and detached just after its own steps. Reported per
rank: median ms per step and the median over rounds of each run's ratio to the same
round's ``plain`` run (with its inter-quartile range), and the time spent inside the taps
(``LayerTap.topk`` / ``dispatched`` / ``received``, every layer) per step, which does not
depend on the machine's load the way end-to-end ratios do. Megatron runs on CPU through the
test harness's stand-ins for its CUDA-only calls (tests/megatron/shims.py). Run::

    .venv-megatron/bin/python benchmarks/megatron_overhead.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VARIANTS = ("plain", "moetrace", "moetrace+timing")


def _rank(rank: int, world: int, rounds: int, steps: int) -> dict[str, Any]:
    from moetrace.adapters import megatron as mt

    import moetrace
    from tests.megatron import harness

    harness.setup_parallel(world)
    spec = harness.StackSpec(num_layers=4, num_experts=8, top_k=2, hidden=256, ffn=512, vocab=512)
    model = harness.build(spec)
    ids = torch.randint(0, spec.vocab, (8, 128), generator=torch.Generator().manual_seed(rank))
    previous = moetrace.get_recorder()
    hook_seconds = {v: 0.0 for v in VARIANTS}
    hook_steps = {v: 0 for v in VARIANTS}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab), ids[:, 1:].reshape(-1)).backward()

    def run(variant: str) -> float:
        handle = None
        if variant != "plain":
            handle = mt.instrument(model, timing=variant.endswith("timing"), output_dir=str(ROOT / "benchmarks" / "results"))
            handle.recorder.start_record()
            for tap in handle.taps:  # "hooks alone": time spent inside the taps
                for name in ("topk", "dispatched", "received"):
                    setattr(tap, name, _timed(getattr(tap, name), hook_seconds, variant))
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.distributed.barrier()
        elapsed = (time.perf_counter() - start) / steps
        if handle is not None:
            hook_steps[variant] += steps
            handle.recorder.stop_record()
            handle.recorder.reset()
            handle.uninstrument()
            moetrace.set_recorder(previous)
        return elapsed

    for variant in VARIANTS:  # warm-up
        run(variant)
    for variant in VARIANTS:
        hook_seconds[variant], hook_steps[variant] = 0.0, 0
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        times = {variant: run(variant) for variant in order}
        for variant, seconds in times.items():
            samples[variant].append(seconds)
            ratios[variant].append(seconds / times["plain"])
    harness.teardown_parallel()

    def iqr(values: list[float]) -> list[float]:
        q = statistics.quantiles(values, n=4)
        return [q[0], q[2]]

    plain_ms = statistics.median(samples["plain"]) * 1e3
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        row = {"ms": statistics.median(samples[variant]) * 1e3, "ratio": statistics.median(ratios[variant]), "ratio_iqr": iqr(ratios[variant])}
        if hook_steps[variant]:
            row["taps_ms_per_step"] = hook_seconds[variant] / hook_steps[variant] * 1e3
            row["taps_share_of_plain"] = row["taps_ms_per_step"] / plain_ms
        out[variant] = row
    return out


def _timed(method: Any, totals: dict[str, float], variant: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[variant] += time.perf_counter() - start

    return timed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="training steps per variant per round")
    args = parser.parse_args(argv)
    from harness import write_results
    from megatron.core import package_info

    from moetrace.reference.launcher import launch

    per_rank = launch(_rank, 2, args.rounds, args.steps, timeout=3600.0)
    payload = {
        "megatron_core": package_info.__version__,
        "workload": "EP=2 gloo, alltoall; 4 MoE layers x 8 experts top-2, hidden 256, ffn 512; fwd+bwd over 8x128 tokens per rank",
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "ranks": per_rank,
    }
    path = write_results("megatron_overhead", payload)
    for rank, result in enumerate(per_rank):
        for variant, r in result.items():
            taps = f"; taps {r['taps_ms_per_step']:.2f} ms/step ({100 * r['taps_share_of_plain']:.2f}% of plain)" if "taps_ms_per_step" in r else ""
            print(f"rank {rank} {variant:16s} {r['ms']:8.1f} ms/step  x{r['ratio']:.3f} plain (IQR {r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}){taps}")
    print(f"written {path}")
    return payload


if __name__ == "__main__":
    main()
