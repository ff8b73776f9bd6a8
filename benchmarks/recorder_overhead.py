"""Recorder overhead: a grouped MoE layer forward, plain vs with the recorder in each mode.

Run: ``.venv/bin/python benchmarks/recorder_overhead.py [--quick]``

Workloads (issue 2): prefill-like (4096 tokens) and decode-like (8 tokens),
hidden 1024, 64 experts, top-8. "plain" makes no recorder call at all;
"noop" calls the hooks on the default no-op recorder; the three modes record
every pass; "per_token+requests" is per_token with the engine's batch handed over each
pass (a :class:`~moetrace.batch.PassBatch` built from host arrays, as an adapter does:
16 requests of 256 prompt rows in prefill, 8 decoding requests in decode), so its rows
carry their request and position. Variants are interleaved round by round in one process. The
"<mode> hooks" rows time the hooks alone on the same ids (no layer compute) and
give them as a share of the plain forward: on a shared machine that is the
robust figure, the end-to-end ratios carry the machine's noise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from harness import interleaved, write_results

from moetrace import ExpertDistributionRecorder, NoOpRecorder, RecorderConfig
from moetrace.batch import PassBatch
from moetrace.reference.experts import SwiGLUExperts
from moetrace.reference.gate import TopKRouter

HIDDEN, EXPERTS, TOP_K = 1024, 64, 8


class GroupedMoE:
    """Route, sort copies by expert, run experts on contiguous groups, combine.

    ``forward(x [T, H], recorder)`` -> ``[T, H]``; ``recorder=None`` makes no hook call.
    """

    def __init__(self, intermediate: int) -> None:
        self.router = TopKRouter(HIDDEN, EXPERTS, TOP_K, seed=1)
        self.experts = SwiGLUExperts(HIDDEN, intermediate, EXPERTS, seed=2)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, recorder: ExpertDistributionRecorder | NoOpRecorder | None) -> torch.Tensor:
        ids, weights = self.router(x)
        if recorder is not None:
            recorder.on_select_experts(ids, layer=0)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sizes = torch.bincount(flat, minlength=EXPERTS).tolist()
        token = order // TOP_K
        y = self.experts.grouped(x[token], sizes) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)


def run(tokens: int, rounds: int, intermediate: int, out_dir: Path) -> dict[str, float]:
    layer = GroupedMoE(intermediate)
    x = torch.randn(tokens, HIDDEN)
    recorders: dict[str, ExpertDistributionRecorder | NoOpRecorder | None] = {"plain": None, "noop": NoOpRecorder()}
    for mode in ("stat", "per_pass", "per_token", "per_token+requests"):
        rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode.split("+")[0], output_dir=out_dir / mode,
                                                        max_tokens_per_pass=max(tokens, 8), stream_chunk_tokens=max(65536, tokens)))
        rec.start_record()
        recorders[mode] = rec
    requests = 16 if tokens > 64 else tokens
    ids_of_requests = [f"req-{i:08x}-{tokens}" for i in range(requests)]
    counts = np.full(requests, tokens // requests, dtype=np.int64)
    step = [0]

    def batch_of(name: str) -> PassBatch | None:
        """The adapter's work per pass: a PassBatch from host arrays (prefill chunks / decode positions move on)."""
        if not name.endswith("+requests"):
            return None
        step[0] += 1
        starts = np.full(requests, step[0] * (tokens // requests), dtype=np.int64)
        return PassBatch.of(ids_of_requests, starts, counts, prefill=tokens > 64)

    def variant(name, rec):  # type: ignore[no-untyped-def]
        if rec is None:
            return lambda: layer.forward(x, None)

        def call() -> torch.Tensor:
            with rec.with_forward_pass(batch=batch_of(name)):
                return layer.forward(x, rec)

        return call

    times = interleaved({name: variant(name, rec) for name, rec in recorders.items()}, rounds=rounds, inner=1 if tokens > 64 else 20)
    # The hooks alone (same ids, no layer compute): a low-noise figure of what recording adds.
    with torch.no_grad():
        ids = layer.router(x)[0]

    def hooks_only(name, rec):  # type: ignore[no-untyped-def]
        def call() -> None:
            with rec.with_forward_pass(batch=batch_of(name)):
                rec.on_select_experts(ids, layer=0)

        return call

    hook_times = interleaved({name: hooks_only(name, rec) for name, rec in recorders.items() if rec is not None}, rounds=rounds, inner=200)
    times.update({f"{name} hooks": t for name, t in hook_times.items()})
    for rec in recorders.values():
        if isinstance(rec, ExpertDistributionRecorder):
            rec.stop_record()
            rec.reset()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a smaller expert FFN")
    args = parser.parse_args()
    rounds = 5 if args.quick else 15
    intermediate = 128 if args.quick else 256
    results: dict[str, object] = {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "intermediate": intermediate, "rounds": rounds}
    print(f"recorder overhead (hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, FFN {intermediate}); median of {rounds} interleaved rounds")
    print(f"{'workload':<22}{'variant':<16}{'ms/forward':>12}{'vs plain':>10}")
    print("('<mode> hooks' rows: with_forward_pass + on_select_experts alone, as a share of the plain forward)")
    with tempfile.TemporaryDirectory() as tmp:
        for workload, tokens in (("prefill (4096 tokens)", 4096), ("decode (8 tokens)", 8)):
            times = run(tokens, rounds, intermediate, Path(tmp))
            base = times["plain"]
            results[workload] = {name: {"ms": t * 1e3, "ratio": t / base} for name, t in times.items()}
            for name, t in times.items():
                print(f"{workload:<22}{name:<16}{t * 1e3:>12.4f}{t / base:>10.4f}")
    print(f"wrote {write_results('recorder_overhead', results)}")


if __name__ == "__main__":
    main()
