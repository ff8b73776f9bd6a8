"""vLLM 0.32 CPU at ``tensor_parallel_size=2``: one worker per rank, one moetrace file per worker,
each token counted once.

One engine (two worker processes, one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``)
serves the three prompts with moetrace's plugin on. Each TP rank routes the
same tokens; the recorder is told so (``layout_source = "vllm"``) and:

- each worker's per_pass file (``/dump`` of its control endpoint) holds its own
  view, equal to an independent capture in that worker;
- ``merge_traces`` of both files, ``analyze_traces`` of them, and the sum of
  ``moetrace_tokens_total`` over both endpoints give the tokens the engine
  computed once, equal to the Hugging Face forward of the same checkpoint on
  the same token ids (and the assignments: tokens x top-k x MoE layers);
- ``moetrace top --once`` against both endpoints names each rank's place;
- after the hooks are removed in both workers the same prompts give the same
  outputs (greedy), and the recorders count nothing more.
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analysis.distributed import analyze_traces
from moetrace.trace.merge import merge_traces
from moetrace.trace.reader import open_trace

from .engine import GENERATION, PROMPTS
from .multirank import SPEC, TP, Served, computed, hf_count, serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve(tmp_path_factory, "tp2")


def test_each_worker_writes_its_own_view(served: Served) -> None:
    assert len(served.dumps) == TP and len(served.captures) == TP
    for rank, (path, independent) in enumerate(zip(served.dumps, served.captures, strict=True)):
        with open_trace(path) as trace:
            (layout,) = trace.layouts
            assert (layout.rank, layout.tp_rank, layout.tp_size, layout.source) == (rank, rank, TP, "vllm")
            assert layout.replicates_tokens == (rank > 0)
            counts = np.concatenate([c.physical_count for c in trace.iter_passes()])
            np.testing.assert_array_equal(counts, independent["counts"])  # this rank's view, pass by pass
        assert independent["topk_violations"] == 0
    np.testing.assert_array_equal(served.captures[0]["counts"], served.captures[1]["counts"])  # TP ranks route alike


def test_tokens_and_assignments_equal_the_hf_forward(served: Served) -> None:
    tokens, hf_counts = hf_count(served.checkpoint, computed(served))
    assert tokens == sum(len(p) for p in served.prompt_ids) + len(PROMPTS) * (GENERATION["max_tokens"] - 1)
    assignments = tokens * SPEC["top_k"] * len(SPEC["layer_ids"])
    merged = merge_traces(served.dumps, served.dumps[0].with_name("tp-merged.h5"))
    with open_trace(merged) as trace:
        assert trace.tokens_served() == tokens
        assert int(trace.physical_count().sum()) == assignments
        vllm_counts = trace.physical_count()
    report = analyze_traces(served.dumps)
    assert report.num_tokens == tokens and int(report.physical_count.sum()) == assignments
    assert served.exported_tokens == tokens  # Prometheus: the replica rank exports 0
    assert [s["tokens"] for s in served.statuses] == [tokens, tokens]  # each rank's own view, in /status
    np.testing.assert_array_equal(vllm_counts, hf_counts)  # [L, E]: the same experts as the HF fp32 router, too
    print(f"vLLM TP=2: tokens {tokens} (HF forward {tokens}), assignments {assignments} (HF {int(hf_counts.sum())})")

def test_status_and_top_show_each_rank(served: Served) -> None:
    layouts = [s["layout"] for s in served.statuses]
    assert [(x["rank"], x["tp_rank"], x["replicates_tokens"]) for x in layouts] == [(0, 0, False), (1, 1, True)]
    assert "rank 0 [TP2 (TP attention) tp0 ep0]" in served.top and "rank 1 [TP2 (TP attention) tp1 ep0, replica]" in served.top
    tokens = sum(len(p) for p in served.prompt_ids) + len(PROMPTS) * (GENERATION["max_tokens"] - 1)
    assert f"tokens served: {tokens} (1 replica rank(s)" in served.top


def test_outputs_are_the_same_without_moetrace(served: Served) -> None:
    assert served.plain_outputs == served.outputs
    # The hooks were really gone: the recorders counted nothing of the second generate.
    assert [s["passes"] for s in served.after] == [s["passes"] for s in served.statuses]

