"""``moetrace traffic`` is exact against the real exchange: the reference EP runtime at EP=4, as 2 nodes of 2 ranks, over gloo.

Each rank runs the reference model (2 MoE layers, 8 experts, top-2) on its own tokens under its own recorder
(DP attention: each rank routes its own tokens) and writes its own trace. The test captures, on every rank,
the split sizes the runtime actually passed to ``torch.distributed.all_to_all_single`` (the dispatch's
``input_split_sizes``: copies this rank sends to each rank; capture only, the values pass through unchanged),
and the top-k ids each router returned. ``rank_tokens`` of the per-rank traces must equal the captured splits
per layer, and a hand count from the captured ids; ``nodes_per_token`` a hand count from the same ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moetrace import ExpertDistributionRecorder
from moetrace.analysis.traffic import trace_traffic
from moetrace.layout import RankLayout
from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel, launch, zipf_bias

WORLD, GPUS_PER_NODE, PASSES = 4, 2, 3
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2,
                    dense_layers=(1,), router_bias=tuple(zipf_bias(8, 1.0, seed=0).tolist()), seed=3)


def _capture_splits(calls: list[list[int]]):
    """Wrap ``dist.all_to_all_single``: append each call's ``input_split_sizes`` (when given) to ``calls``, change nothing."""
    real = dist.all_to_all_single

    def capturing(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        if input_split_sizes is not None:
            calls.append(list(input_split_sizes))
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    return capturing


def _capture_ids(model: ReferenceMoEModel, seen: list[list[np.ndarray]]) -> None:
    """Record the ``[T, k]`` ids each MoE layer's router returns, per layer."""
    for index, layer in enumerate(model.moe_layers):
        real = layer.router.forward

        def routed(x, _real=real, _index=index):
            ids, weights = _real(x)
            seen[_index].append(ids.numpy().copy())
            return ids, weights

        layer.router.forward = routed


def _worker(rank: int, world: int, out: str) -> dict:
    model = ReferenceMoEModel(MODEL, ep=EPSpec(world, rank, "exact"))
    layout = RankLayout.independent(rank, world, ep_size=world, ep_rank=rank, source="reference")
    calls: list[list[int]] = []
    dist.all_to_all_single = _capture_splits(calls)
    seen: list[list[np.ndarray]] = [[] for _ in model.moe_layers]
    _capture_ids(model, seen)
    results = {}
    for mode in ("per_token", "per_pass"):
        calls.clear()
        recorder = ExpertDistributionRecorder(model.recorder_config(mode=mode, layout=layout, output_dir=out, max_tokens_per_pass=64,
                                                                            run_id=f"traffic-{mode}"))
        recorder.start_record()
        with torch.inference_mode():
            for step in range(PASSES):
                ids = torch.randint(0, MODEL.vocab_size, (2, 3 + 2 * rank + step), generator=torch.Generator().manual_seed(10 * rank + step))
                model(ids, recorder=recorder)
        recorder.stop_record()
        path = recorder.dump_record(Path(out) / f"{mode}-rank{rank}.h5")
        # Per layer and pass: the counts exchange (no splits), the dispatch (input splits = copies sent), the combine.
        dispatch = np.array(calls[0::2]).reshape(PASSES, len(model.moe_layers), world).sum(axis=0)
        results[mode] = {"path": str(path), "dispatch_splits": dispatch.tolist()}
    results["ids"] = [np.concatenate(layer_ids) for layer_ids in seen]  # [2 modes x passes x tokens, k] per layer
    return results


@pytest.mark.slow
def test_rank_tokens_equal_the_split_sizes_passed_to_all_to_all(tmp_path: Path) -> None:
    ranks = launch(_worker, WORLD, str(tmp_path), backend="gloo", threads_per_rank=1)
    layers = len(ranks[0]["ids"])
    for mode in ("per_token", "per_pass"):
        result = trace_traffic([r[mode]["path"] for r in ranks], GPUS_PER_NODE)
        captured = np.stack([np.array(r[mode]["dispatch_splits"]) for r in ranks], axis=1)  # [L, source, destination]
        assert result.rank_tokens.tolist() == captured.tolist(), mode
        assert result.fabric.nodes == 2 and result.to_dict()["complete"]
    # A hand count from the ids the routers returned (both modes' passes: the two traces together).
    per_rank = 8 // WORLD
    hand = np.zeros((layers, WORLD, WORLD), dtype=np.int64)
    nodes = np.zeros((layers, 3), dtype=np.int64)
    for source, r in enumerate(ranks):
        for layer, ids in enumerate(r["ids"]):
            for token in ids:
                for expert in token:
                    hand[layer, source, expert // per_rank] += 1
                nodes[layer, len({int(e) // per_rank // GPUS_PER_NODE for e in token})] += 1
    both = trace_traffic([r["per_token"]["path"] for r in ranks], GPUS_PER_NODE).rank_tokens + \
        trace_traffic([r["per_pass"]["path"] for r in ranks], GPUS_PER_NODE).rank_tokens
    assert both.tolist() == hand.tolist()
    tokens = trace_traffic([r["per_token"]["path"] for r in ranks], GPUS_PER_NODE).to_dict()
    half = np.zeros((layers, 3), dtype=np.int64)  # the per_token run is the first half of each rank's routed ids
    for r in ranks:
        for layer, ids in enumerate(r["ids"]):
            for token in ids[: len(ids) // 2]:
                half[layer, len({int(e) // per_rank // GPUS_PER_NODE for e in token})] += 1
    assert [row["nodes_per_token"] for row in tokens["layers"]] == half.tolist()
    assert nodes.sum() == 2 * half.sum()
    # Negative control: the splits are not the same on every source, so a transposed or a single-source matrix would fail.
    captured = np.stack([np.array(r["per_token"]["dispatch_splits"]) for r in ranks], axis=1)
    assert not np.array_equal(captured, captured.transpose(0, 2, 1))
