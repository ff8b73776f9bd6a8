"""Host time of one ``on_select_experts`` hook, against a bare ``scatter_add_`` of the same ids.

Run: ``.venv/bin/python benchmarks/hook_cost.py [--quick] [--device cuda]``

DeepSeek-V3 decode shape on one EP rank (issue 50): 58 MoE layers, 288 physical slots, top-8,
256 tokens a pass. One pass is ``with_forward_pass`` around 58 ``with_current_layer`` blocks,
each one hook on that layer's ids (random ids with 1 in 16 set to -1, as padding or masked
experts). Variants, interleaved round by round in one process (:func:`harness.interleaved`):

* ``bare scatter_add_``: per layer, one ``scatter_add_`` of the same ids (already shifted to
  ``int64`` columns, so the baseline does no index work at all) into a ``[L, C]`` buffer;
* ``hook ops, no moetrace``: per layer, the ops a hook issues (``copy_`` of the ids into an
  int64 stage, ``fill_`` of the layer's row end) on plain tensors
  (:func:`deepseek_workload.bare_ops`, without its pass end): the floor of the hook's design, so
  that a hook's figure less this one is moetrace's own host work;
* ``<mode> hooks``: the 58 hooks of a pass (``on_select_experts(ids, layer=l)``), timed without
  the layer scopes and the pass end;
* ``<mode> pass``: a whole recorded pass, pass end included, per layer.

Figures are microseconds per layer (per hook) and their ratio to the bare ``scatter_add_``.
On CUDA each timed call ends with ``torch.cuda.synchronize()``, so there the figures hold the
device time as well as the launches.
The number of device ops a hook issues is counted by ``tests/recorder/test_hook_ops.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepseek_workload import LAYERS, SLOTS, TOKENS, TOP_K, bare_ops
from harness import interleaved, write_results

from moetrace import ExpertDistributionRecorder, RecorderConfig

MODES = ("stat", "per_pass", "per_token")


def decode_ids(device: torch.device) -> list[torch.Tensor]:
    """Each layer's ``[TOKENS, TOP_K]`` int32 ids (as SGLang and vLLM give them), 1 in 16 set to -1."""
    gen = torch.Generator().manual_seed(50)
    ids = torch.randint(0, SLOTS, (LAYERS, TOKENS, TOP_K), generator=gen, dtype=torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < 1 / 16] = -1
    return [layer.to(device) for layer in ids]


def variants(out_dir: Path, device: torch.device) -> tuple[dict[str, object], list[ExpertDistributionRecorder]]:
    """The timed callables, and the recorders to stop afterwards."""
    ids = decode_ids(device)
    columns = [(layer.long() + 2).clamp_(0, SLOTS + 2).reshape(-1) for layer in ids]
    target = torch.zeros((LAYERS, SLOTS + 8), dtype=torch.int64, device=device)
    ones = torch.ones(TOKENS * TOP_K, dtype=torch.int64, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def bare() -> None:
        for layer in range(LAYERS):
            target[layer].scatter_add_(0, columns[layer], ones)
        sync()

    hook_ops = bare_ops(ids, pass_end=False)

    def ops_alone() -> None:
        hook_ops()
        sync()

    timed: dict[str, object] = {"bare scatter_add_": bare, "hook ops, no moetrace": ops_alone}
    recorders = []
    for mode in MODES:
        rec = ExpertDistributionRecorder(RecorderConfig(
            num_layers=LAYERS, num_physical_experts=SLOTS, top_k=TOP_K, mode=mode, device=device, output_dir=out_dir / mode,
            max_tokens_per_pass=TOKENS, stream_chunk_tokens=65536, segment_seconds=0,
        ))
        rec.start_record()
        recorders.append(rec)
        timed[f"{mode} hooks"], timed[f"{mode} pass"] = _hooks(rec, ids, sync), _pass(rec, ids, sync)
    return timed, recorders


def _hooks(rec: ExpertDistributionRecorder, ids: list[torch.Tensor], sync: object) -> object:
    """The hooks of one pass, inside a pass that stays open (no pass end timed)."""
    scope = contextlib.ExitStack()
    scope.enter_context(rec.with_forward_pass())
    # Where the rows restart: the pass counter now, the per_token sink before issue 50 (so that
    # the same script times the code before the change, run with that tree first on PYTHONPATH).
    counter = rec._counter
    restart = counter.restart_rows if hasattr(counter, "restart_rows") else rec._sink.restart_rows  # type: ignore[attr-defined]

    def run() -> None:
        restart()  # each timed round writes the pass's rows again from row 0
        for layer, layer_ids in enumerate(ids):
            rec.on_select_experts(layer_ids, layer=layer)
        sync()  # type: ignore[operator]

    run.close = scope.close  # type: ignore[attr-defined]
    return run


def _pass(rec: ExpertDistributionRecorder, ids: list[torch.Tensor], sync: object) -> object:
    def run() -> None:
        with rec.with_forward_pass():
            for layer, layer_ids in enumerate(ids):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(layer_ids)
        sync()  # type: ignore[operator]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--label", default="", help="a name for this run in the results file (e.g. before / after)")
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        timed, recorders = variants(Path(tmp), device)
        hooks_only = {name: run for name, run in timed.items() if not name.endswith(" pass")}
        passes = {name: run for name, run in timed.items() if name.endswith(" pass") or name.startswith("bare")}
        seconds = interleaved(hooks_only, rounds=30 if args.quick else 200)  # type: ignore[arg-type]
        for name, run in timed.items():
            if name.endswith(" hooks"):
                run.close()  # type: ignore[attr-defined]
        seconds.update({n: s for n, s in interleaved(passes, rounds=30 if args.quick else 200).items() if n.endswith(" pass")})  # type: ignore[arg-type]
        for rec in recorders:
            rec.stop_record()
            rec.reset()
    bare = seconds["bare scatter_add_"]
    print(f"{'variant':<22} {'us/layer':>9} {'x bare':>7}")
    rows = {}
    for name, s in seconds.items():
        per_layer = s / LAYERS * 1e6
        rows[name] = {"us_per_layer": round(per_layer, 2), "ratio_to_bare": round(s / bare, 2)}
        print(f"{name:<22} {per_layer:>9.1f} {s / bare:>7.2f}")
    label = f"-{args.label}" if args.label else ""
    shape = {"layers": LAYERS, "slots": SLOTS, "top_k": TOP_K, "tokens": TOKENS, "device": str(device)}
    print(f"wrote {write_results(f'hook_cost{label}', {'shape': shape, 'label': args.label, 'variants': rows})}")


if __name__ == "__main__":
    main()
