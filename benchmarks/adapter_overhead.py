"""Overhead of observing a Hugging Face MoE model: plain vs moetrace vs moewatch.

Model: a tiny random-weight Mixtral (hidden 256, 4 layers, 8 experts, top-2).
Workloads: prefill of a batch of 8 x 128 tokens (one forward, no cache) and
decode steps of batch 8 (one token per sequence against a 128-token KV cache).
Variants, interleaved in one process (the order rotates every round so that
drift in machine load hits all of them alike):

- ``plain``: no hooks;
- ``moetrace``: ``moetrace.adapters.hf.instrument(model)`` in stat mode,
  recording every pass (one ``with_forward_pass`` per forward, a pre-hook on
  every experts module);
- ``moewatch``: ``MoEWatch(model, WatchConfig(sample_every=1)).start()`` from
  PyPI (forward hooks on every router, every pass).

Each variant is attached just before and detached just after its own timed
run, so the model runs the same weights in every variant. Reported: median
milliseconds per forward and the median over rounds of the ratio of each run
to the same round's ``plain`` run (with its inter-quartile range). Run::

    .venv/bin/python benchmarks/adapter_overhead.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from moetrace.adapters import hf

import moetrace

__all__ = ["main"]

RESULTS = Path(__file__).parent / "results" / "adapter_overhead.json"
BATCH, PROMPT, DECODE_STEPS = 8, 128, 8


def build_model() -> torch.nn.Module:
    """The tiny Mixtral of the issue: hidden 256, 4 layers, 8 experts, top-2."""
    torch.manual_seed(0)
    config = tf.MixtralConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512,
    )
    return tf.MixtralForCausalLM(config).eval()


class Variant:
    """Attach / detach one way of observing the model."""

    name = "plain"

    def attach(self, model: torch.nn.Module) -> None:
        pass

    def detach(self, model: torch.nn.Module) -> None:
        pass


class Moetrace(Variant):
    name = "moetrace"

    def __init__(self) -> None:
        self.recorder: Any = None
        self.handle: Any = None

    def attach(self, model: torch.nn.Module) -> None:
        self.handle = hf.instrument(model, recorder=self.recorder)  # first time: builds a stat-mode recorder
        if self.recorder is None:
            self.recorder = self.handle.recorder
            self.recorder.start_record()

    def detach(self, model: torch.nn.Module) -> None:
        self.handle.uninstrument()


class Moewatch(Variant):
    name = "moewatch"

    def __init__(self) -> None:
        self.watcher: Any = None

    def attach(self, model: torch.nn.Module) -> None:
        from moewatch import MoEWatch, WatchConfig
        from moewatch.config import OutputMode

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it warns that sample_every=1 is costly: that is what we measure
            self.watcher = MoEWatch(model, WatchConfig(sample_every=1, output=OutputMode.SILENT)).start()

    def detach(self, model: torch.nn.Module) -> None:
        self.watcher.stop()


def _prefill(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        model(ids, use_cache=False)
        return time.perf_counter() - start

    return run


def _decode(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    """DECODE_STEPS one-token steps from a copy of one 128-token prefill cache; returns seconds per step."""
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    prefix, first = out.cache, out.logits[:, -1:].argmax(-1)

    def run() -> float:
        cache, token = copy.deepcopy(prefix), first
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / DECODE_STEPS

    return run


def hook_cost(model: torch.nn.Module, tokens: int, passes: int = 200) -> dict[str, float]:
    """Microseconds per forward spent in each variant's own hooks alone, for a pass of ``tokens`` tokens.

    The hooks each variant installs are called directly on the inputs/outputs
    the MoE layers produce, so this figure does not depend on the model's
    compute and is far less noisy than the end-to-end ratio on a shared machine.
    """
    ids = torch.randint(0, 1024, (1, tokens), generator=torch.Generator().manual_seed(2))
    captured: dict[str, list[tuple[torch.nn.Module, Any, Any]]] = {"experts": [], "router": []}
    handles = []
    for module in model.modules():
        kind = "experts" if hf.families.is_experts_machinery(module) else "router" if type(module).__name__.endswith("TopKRouter") else None
        if kind:
            handles.append(module.register_forward_hook(lambda m, a, o, k=kind: captured[k].append((m, a, o))))
    with torch.inference_mode():
        model(ids, use_cache=False)
    for handle in handles:
        handle.remove()
    costs = {}
    tracer = Moetrace()
    tracer.attach(model)
    pre_hooks = [(m, a, h) for m, a, _ in captured["experts"] for h in m._forward_pre_hooks.values()]
    recorder = tracer.recorder
    start = time.perf_counter()
    for _ in range(passes):
        with recorder.with_forward_pass():
            for module, args, hook in pre_hooks:
                hook(module, args, {})
    costs["moetrace"] = 1e6 * (time.perf_counter() - start) / passes
    tracer.detach(model)
    watch = Moewatch()
    watch.attach(model)
    post_hooks = [(m, a, o, h) for m, a, o in captured["router"] for h in m._forward_hooks.values()]
    start = time.perf_counter()
    for _ in range(passes):
        for module, args, output, hook in post_hooks:
            hook(module, args, output)
    costs["moewatch"] = 1e6 * (time.perf_counter() - start) / passes
    watch.detach(model)
    return costs


def measure(rounds: int) -> dict[str, Any]:
    """Per round and workload, every variant runs once (attached just for its run), in rotating order."""
    model = build_model()
    ids = torch.randint(0, 1024, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    variants: list[Variant] = [Variant(), Moetrace(), Moewatch()]
    workloads = {"prefill": _prefill(model, ids), "decode": _decode(model, ids)}
    times: dict[str, dict[str, list[float]]] = {w: {v.name: [] for v in variants} for w in workloads}
    with torch.inference_mode():
        for variant in variants:  # warm-up, every path once
            variant.attach(model)
            for run in workloads.values():
                run()
            variant.detach(model)
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for workload, run in workloads.items():
                for variant in order:
                    variant.attach(model)
                    times[workload][variant.name].append(run())
                    variant.detach(model)
    tracer = variants[1]
    assert isinstance(tracer, Moetrace)
    snap = tracer.recorder.snapshot()
    tracer.recorder.stop_record()
    hooks = {"prefill": hook_cost(model, BATCH * PROMPT), "decode": hook_cost(model, BATCH)}
    return {"times": times, "hook_us": hooks, "moetrace_passes": snap.num_passes, "moetrace_tokens": snap.num_tokens,
            "moetrace_count_total": int(snap.physical_count.sum())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds (default 12)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    measured = measure(args.rounds)
    table: dict[str, dict[str, dict[str, float]]] = {}
    for workload, by_variant in measured["times"].items():
        plain = by_variant["plain"]
        table[workload] = {
            name: {
                "median_ms": 1e3 * statistics.median(ts),
                # ratio of each round's run to the same round's plain run, then the median over rounds
                "ratio_to_plain": statistics.median(t / p for t, p in zip(ts, plain, strict=True)),
                "ratio_iqr": _iqr([t / p for t, p in zip(ts, plain, strict=True)]),
                "samples": len(ts),
                "hook_us_per_forward": measured["hook_us"][workload].get(name, 0.0),
            }
            for name, ts in by_variant.items()
        }
    tokens = measured["moetrace_tokens"]
    assert measured["moetrace_count_total"] == tokens * 2 * 4, "moetrace did not count every routed token"

    print(f"adapter overhead: tiny Mixtral (hidden 256, 4 layers, 8 experts, top-2), torch {torch.__version__}, "
          f"transformers {tf.__version__}, {torch.get_num_threads()} threads")
    print(f"{'workload':<26}{'variant':<10}{'median ms':>11}{'x plain':>9}  {'IQR of ratios':<17}{'hooks alone':>12}")
    labels = {"prefill": f"prefill {BATCH}x{PROMPT}", "decode": f"decode step, batch {BATCH}"}
    for workload, rows in table.items():
        for name, row in rows.items():
            low, high = row["ratio_iqr"]
            hook_share = 1e-3 * row["hook_us_per_forward"] / table[workload]["plain"]["median_ms"]
            print(f"{labels[workload]:<26}{name:<10}{row['median_ms']:>11.3f}{row['ratio_to_plain']:>9.4f}  "
                  f"[{low:.3f}, {high:.3f}]  {row['hook_us_per_forward']:>8.0f} us ({100 * hook_share:.2f}% of plain)")
    print(f"moetrace recorded {measured['moetrace_passes']} passes, {tokens} tokens (every pass, stat mode)")

    result = {
        "benchmark": "adapter_overhead",
        "command": " ".join(["python benchmarks/adapter_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "transformers": tf.__version__, "moetrace": moetrace.__version__,
                     "moewatch": _version("moewatch")},
        "model": {"family": "mixtral", "hidden_size": 256, "num_layers": 4, "num_experts": 8, "top_k": 2},
        "workloads": {"prefill": {"batch": BATCH, "tokens": PROMPT}, "decode": {"batch": BATCH, "cache_tokens": PROMPT, "steps": DECODE_STEPS}},
        "rounds": args.rounds,
        "results": table,
        "moetrace_recorded": {"passes": measured["moetrace_passes"], "tokens": tokens},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _iqr(values: list[float]) -> tuple[float, float]:
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[0], quartiles[2]


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
