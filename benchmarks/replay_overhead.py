"""Routing replay cost in a training step: forward + backward with ``hf.replay`` vs without, interleaved.

A transformers Mixtral (random weights, 4 layers, hidden 256, 8 experts, top-2)
runs a training step — forward over ``[batch, seq]`` tokens with labels, then
``loss.backward()`` — plainly and under ``moetrace.adapters.hf.replay`` of
routes of the same shape: the model's own routes (every row replayed), and the
same routes with 10% of the rows ``-1`` (padding: those tokens also run the
live top-k). Rounds rotate the variants; the figure is the median step time,
and the ratio is against the plain step of the same run. Both this process's
CPU time (the headline: one thread, so it counts only the work done here, while
other processes on a shared machine inflate wall time at random) and wall time
are reported, and so is the cost of ``hf.replay()`` + ``remove()`` alone (route
validation, per-layer device routes, hooks), once per training step in an RL loop,
and of the replay machinery itself: one router's forward + backward under
``TopKReplay`` vs plain, times the MoE layers (robust to machine load, unlike
the end-to-end ratios).

Usage::

    python benchmarks/replay_overhead.py [--rounds 10] [--batch 4] [--seq 256]

Prints a table and writes ``benchmarks/results/replay_overhead.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, machine, write_results


def build(hidden: int, layers: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                              num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                              max_position_embeddings=2048)
    return tf.MixtralForCausalLM(config).train()


def own_routes(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """``[B, S, L, k]`` routes the model picks for ``ids`` (read at each experts module)."""
    from moetrace.adapters import hf

    sites = hf.find_moe_sites(model)
    seen: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(args[1].detach().clone())

    handles = [s.module.register_forward_pre_hook(keep) for s in sites]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return torch.stack(seen, 1).reshape(*ids.shape, len(sites), -1).numpy()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from moetrace.adapters import hf

    model = build(args.hidden, args.layers)
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    routes = own_routes(model, ids)
    padded = routes.copy()
    padded[np.random.default_rng(2).random(routes.shape[:2]) < 0.1] = -1

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    def replayed(r: np.ndarray) -> Callable[[], None]:
        def run() -> None:
            with hf.replay(model, r):
                step()
        return run

    start = time.process_time()
    for _ in range(20):
        hf.replay(model, routes).remove()
    install_ms = (time.process_time() - start) / 20 * 1e3

    # The replay machinery alone: one router's forward + backward plainly and under TopKReplay, times the MoE layers.
    from moetrace.replay import LayerRoutes, TopKReplay

    router = hf.find_moe_sites(model)[0]
    gate = model.get_submodule(router.name.rpartition(".")[0]).gate
    hidden = torch.randn(ids.numel(), args.hidden, generator=torch.Generator().manual_seed(3))
    layer_routes = LayerRoutes(routes.reshape(-1, *routes.shape[2:])[:, 0], hidden.device)

    def route(replaying: bool) -> Callable[[], None]:
        def run() -> None:
            gate.zero_grad(set_to_none=True)
            if replaying:
                with TopKReplay(layer_routes, 8, 2):
                    weights = gate(hidden)[1]
            else:
                weights = gate(hidden)[1]
            weights.sum().backward()
        return run

    router_s = interleaved({"plain": route(False), "replay": route(True)}, rounds=args.rounds, inner=20)
    machinery_ms = (router_s["replay"] - router_s["plain"]) * 1e3 * len(hf.find_moe_sites(model))

    variants = {"plain": step, "replay": replayed(routes), "replay_10pct_padding": replayed(padded)}
    cpu: dict[str, list[float]] = {name: [] for name in variants}

    def cpu_timed(name: str) -> Callable[[], None]:
        def run() -> None:
            start = time.process_time()
            variants[name]()
            cpu[name].append(time.process_time() - start)
        return run

    warmup = 2
    wall = interleaved({name: cpu_timed(name) for name in variants}, rounds=args.rounds, warmup=warmup)
    cpu_median = {name: statistics.median(samples[warmup:]) for name, samples in cpu.items()}
    results = {
        name: {"wall_ms": wall[name] * 1e3, "wall_ratio": wall[name] / wall["plain"],
               "cpu_ms": cpu_median[name] * 1e3, "cpu_ratio": cpu_median[name] / cpu_median["plain"]}
        for name in variants
    }
    print(f"training step (forward + backward), Mixtral {args.layers} layers H={args.hidden}, {args.batch} x {args.seq} tokens, "
          f"{args.rounds} interleaved rounds; {machine()}")
    print(f"{'variant':<24}{'CPU ms':>10}{'/ plain':>10}{'wall ms':>10}{'/ plain':>10}")
    for name, r in results.items():
        print(f"{name:<24}{r['cpu_ms']:>10.1f}{r['cpu_ratio']:>10.3f}{r['wall_ms']:>10.1f}{r['wall_ratio']:>10.3f}")
    payload = {"workload": {"batch": args.batch, "seq": args.seq, "hidden": args.hidden, "layers": args.layers, "experts": 8, "top_k": 2,
                            "threads": args.threads, "rounds": args.rounds}, "results": results}
    print(f"hf.replay() + remove() alone (validation, per-layer routes, hooks): {install_ms:.2f} ms CPU = "
          f"{install_ms / results['plain']['cpu_ms'] * 100:.2f}% of a plain step")
    print(f"router forward + backward under TopKReplay vs plain: {router_s['replay'] * 1e6:.0f} vs {router_s['plain'] * 1e6:.0f} us per layer; "
          f"x {args.layers} layers = {machinery_ms:.2f} ms = {machinery_ms / results['plain']['wall_ms'] * 100:.2f}% of a plain step (wall)")
    payload["install_ms"] = install_ms
    payload["router_us"] = {k: v * 1e6 for k, v in router_s.items()}
    payload["machinery_ms_per_step"] = machinery_ms
    print(f"wrote {write_results('replay_overhead', payload)}")
    return payload


if __name__ == "__main__":
    main()
