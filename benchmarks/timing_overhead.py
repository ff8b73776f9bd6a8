"""Phase-timing overhead: the reference model's forward with the recorder's timing off vs on.

Run: ``.venv/bin/python benchmarks/timing_overhead.py [--quick]``

The model is the reference runtime's (4 MoE layers, EP on one rank, exact
exchange, which computes only the routed rows), recording in ``stat`` mode. "timing off" is
``RecorderConfig(timing=False)`` (``with_phase`` returns a shared null
context), "timing on" times 4 phases and the layer in every MoE layer plus the
pass. Variants are interleaved round by round in one process. The "hooks"
rows time the timing calls alone (one pass of ``with_phase`` x 4 per layer,
no compute) as a share of the plain forward: on a shared machine that is the
robust figure, the end-to-end ratio carries the machine's noise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved, write_results

from moetrace import PHASES, ExpertDistributionRecorder
from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel

CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4, num_experts=16, top_k=2, seed=0)


def run(tokens: int, rounds: int, out_dir: Path) -> dict[str, float]:
    model = ReferenceMoEModel(CONFIG, ep=EPSpec(1, 0, "exact"))
    ids = torch.randint(0, CONFIG.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    recorders = {}
    for name, timing in (("timing off", False), ("timing on", True)):
        rec = ExpertDistributionRecorder(model.recorder_config(timing=timing, output_dir=out_dir, max_tokens_per_pass=tokens))
        rec.start_record()
        recorders[name] = rec

    def forward(rec):  # type: ignore[no-untyped-def]
        def call() -> None:
            with torch.inference_mode():
                model(ids, recorder=rec)

        return call

    def hooks(rec):  # type: ignore[no-untyped-def]
        layers = range(len(CONFIG.moe_layer_ids))

        def call() -> None:
            with rec.with_forward_pass():
                for layer in layers:
                    with rec.with_current_layer(layer):
                        for phase in PHASES:
                            with rec.with_phase(phase):
                                pass

        return call

    times = interleaved({name: forward(rec) for name, rec in recorders.items()}, rounds=rounds, inner=1 if tokens > 64 else 10)
    hook_times = interleaved({name: hooks(rec) for name, rec in recorders.items()}, rounds=rounds, inner=200)
    times.update({f"{name} hooks": t for name, t in hook_times.items()})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    rounds = 5 if args.quick else 15
    torch.set_num_threads(1)
    results: dict[str, object] = {"model": {"hidden": CONFIG.hidden_size, "experts": CONFIG.num_experts, "top_k": CONFIG.top_k,
                                            "moe_layers": len(CONFIG.moe_layer_ids)}, "rounds": rounds}
    print(f"timing overhead (reference model, {len(CONFIG.moe_layer_ids)} MoE layers, H={CONFIG.hidden_size}, "
          f"{CONFIG.num_experts} experts, top-{CONFIG.top_k}); median of {rounds} interleaved rounds")
    print(f"{'workload':<20}{'variant':<20}{'ms/forward':>12}{'vs off':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for workload, tokens in (("prefill (256 tok)", 256), ("decode (8 tok)", 8)):
            times = run(tokens, rounds, Path(tmp))
            base = times["timing off"]
            entry = {name: {"ms": t * 1e3, "ratio_to_off": t / base} for name, t in times.items()}
            entry["hooks_share_of_forward"] = {name: times[f"{name} hooks"] / base for name in ("timing off", "timing on")}
            results[workload] = entry
            for name, t in times.items():
                print(f"{workload:<20}{name:<20}{t * 1e3:>12.4f}{t / base:>10.4f}")
            share = entry["hooks_share_of_forward"]
            print(f"{workload:<20}timing calls alone: off {100 * share['timing off']:.2f}%, on {100 * share['timing on']:.2f}% of the forward")
    print(f"wrote {write_results('timing_overhead', results)}")


if __name__ == "__main__":
    main()
