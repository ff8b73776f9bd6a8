"""vLLM 0.32 CPU at ``tensor_parallel_size=2, enable_expert_parallel=True``, with the CPU EP shim.

Without the shim the worker segfaults in ``csrc/cpu/cpu_fused_moe.cpp:242``,
moetrace on or off (see :mod:`tests.vllm.shims.cpu_expert_parallel`, loaded
through vLLM's ``worker_extension_cls``, and docs/integrations/vllm.md). With
it, EP runs as vLLM's GPU path does under TP attention: each rank routes the
whole batch, computes its half of the experts, and the outputs are all-reduced.

The plugin records ``per_token`` here (the tensor-parallel module records
``per_pass``), so that both streaming modes' dumps at exit are read back at TP=2.
moetrace records EP rank ``r`` of 2 on worker ``r``, counts each token once
(the views are replicas), and its per-rank load equals the load the engine's
own placement gives: the counted view's counts summed over the experts each
worker's ``expert_map`` says it holds.
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analysis.distributed import analyze_traces
from moetrace.trace.merge import merge_traces
from moetrace.trace.reader import open_trace

from .multirank import SPEC, TP, Served, check_dumps_at_exit, computed, hf_count, pass_counts, serve
from .shims.cpu_expert_parallel import EXTENSION

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve(tmp_path_factory, "tp2ep2", mode="per_token", enable_expert_parallel=True, worker_extension_cls=EXTENSION)


def test_each_rank_holds_its_experts_and_its_ep_coordinates(served: Served) -> None:
    for rank, (path, maps) in enumerate(zip(served.dumps, served.expert_maps, strict=True)):
        assert sorted(maps) == list(SPEC["layer_ids"])
        held = {layer: [e for e, slot in enumerate(m) if slot >= 0] for layer, m in maps.items()}
        assert all(len(experts) == SPEC["num_experts"] // TP for experts in held.values())
        with open_trace(path) as trace:
            (layout,) = trace.layouts
            assert (layout.ep_size, layout.ep_rank, layout.tp_rank, layout.attention) == (TP, rank, rank, "tp")
            assert trace.ep_size == TP


def test_tokens_once_and_rank_load_from_the_engines_placement(served: Served) -> None:
    tokens, _ = hf_count(served.checkpoint, computed(served))
    assignments = tokens * SPEC["top_k"] * len(SPEC["layer_ids"])
    merged = merge_traces(served.dumps, served.dumps[0].with_name("ep-merged.h5"))
    with open_trace(merged) as trace:
        assert trace.tokens_served() == tokens
        counts = trace.physical_count()
        assert int(counts.sum()) == assignments
    engine_load = np.zeros((len(SPEC["layer_ids"]), TP), dtype=np.int64)
    for rank, maps in enumerate(served.expert_maps):
        for i, layer in enumerate(SPEC["layer_ids"]):
            engine_load[i, rank] = counts[i, [e for e, slot in enumerate(maps[layer]) if slot >= 0]].sum()
    report = analyze_traces(served.dumps)
    np.testing.assert_array_equal(report.rank_load, engine_load)
    assert report.num_tokens == tokens and served.exported_tokens == tokens
    for rank, independent in enumerate(served.captures):
        np.testing.assert_array_equal(pass_counts(served.dumps[rank]), independent["counts"])
    print(f"vLLM TP=2 EP=2: tokens {tokens}, assignments {assignments}, rank load per layer {engine_load.tolist()}")


def test_outputs_are_the_same_without_moetrace(served: Served) -> None:
    assert served.plain_outputs == served.outputs
    assert [s["passes"] for s in served.after] == [c["passes"] for c in served.exit_captures]  # up to the second generate


def test_dumps_at_exit_name_each_rank_and_count_once(served: Served) -> None:
    check_dumps_at_exit(served, "per_token")
