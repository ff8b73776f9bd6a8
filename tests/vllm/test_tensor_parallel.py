"""vLLM 0.32 CPU at ``tensor_parallel_size=2``: one worker per rank, one moetrace file per worker,
each token counted once.

One engine (two worker processes, one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``)
serves the three prompts with moetrace's plugin on. Each TP rank routes the
same tokens; the recorder is told so (``layout_source = "vllm"``) and:

- each worker's per_pass file (``/dump`` of its control endpoint) holds its own
  view, equal to an independent capture in that worker;
- ``merge_traces`` of both files, ``analyze_traces`` of them, and the sum of
  ``moetrace_tokens_total`` over both endpoints give the tokens the engine
  computed once, and the per-expert counts of the engine's own routing
  (rank 0's independent capture);
- how often vLLM TP=2's top-k set equals the Hugging Face fp32 router's on the
  same token ids is measured per layer and printed, not asserted: near-tied
  router scores flip under bf16 and another all-reduce order;
- ``moetrace top --once`` against both endpoints names each rank's place;
- after the hooks are removed in both workers the same prompts give the same
  outputs (greedy), and the recorders count nothing more;
- each worker's dump at exit (vLLM has torn its process group down by then)
  says rank r of 2 and holds the passes after the live dump; ``moetrace
  analyze`` of the two files and ``moetrace merge`` count those tokens once.
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analysis.distributed import analyze_traces
from moetrace.trace.merge import merge_traces
from moetrace.trace.reader import open_trace

from .engine import GENERATION, PROMPTS
from .multirank import (
    SPEC,
    TP,
    Served,
    check_dumps_at_exit,
    computed,
    hf_count,
    hf_logits,
    pass_counts,
    serve,
    topk_agreement,
)

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
        np.testing.assert_array_equal(pass_counts(path), independent["counts"])  # this rank's view, pass by pass
        assert independent["topk_violations"] == 0
    np.testing.assert_array_equal(served.captures[0]["counts"], served.captures[1]["counts"])  # TP ranks route alike


def test_tokens_once_and_counts_equal_what_the_engine_computed(served: Served) -> None:
    """Tokens and assignments: the tokens vLLM ran (HF tokenisation of the same ids), once; per-expert
    counts: the engine's own routing (rank 0's independent capture; rank 1 routes alike, checked above).
    The per-expert counts are not compared with the HF fp32 router: near-tied router scores flip under
    bf16 and another all-reduce order (measured in test_routing_agreement_with_the_fp32_reference)."""
    tokens, _ = hf_count(served.checkpoint, computed(served))
    assert tokens == sum(len(p) for p in served.prompt_ids) + len(PROMPTS) * (GENERATION["max_tokens"] - 1)
    assignments = tokens * SPEC["top_k"] * len(SPEC["layer_ids"])
    engine_counts = served.captures[0]["counts"].sum(axis=0)  # [L, E]
    assert int(engine_counts.sum()) == assignments
    merged = merge_traces(served.dumps, served.dumps[0].with_name("tp-merged.h5"))
    with open_trace(merged) as trace:
        assert trace.tokens_served() == tokens
        np.testing.assert_array_equal(trace.physical_count(), engine_counts)
    report = analyze_traces(served.dumps)
    assert report.num_tokens == tokens
    np.testing.assert_array_equal(report.physical_count, engine_counts)
    assert served.exported_tokens == tokens  # Prometheus: the replica rank exports 0
    assert [s["tokens"] for s in served.statuses] == [tokens, tokens]  # each rank's own view, in /status
    print(f"vLLM TP=2: tokens {tokens} (HF tokenisation {tokens}), assignments {assignments}")


def test_routing_agreement_with_the_fp32_reference(served: Served) -> None:
    """Measured, not asserted equal: per MoE layer, the share of tokens whose top-k set under vLLM TP=2
    (bf16, two ranks) is the Hugging Face fp32 router's on the same token ids. Every routed row of
    rank 0 is matched with its reference token (what is asserted)."""
    sequences = computed(served)
    agreement = topk_agreement(served.captures[0]["routes"], sequences, hf_logits(served.checkpoint, sequences))
    tokens = sum(len(ids) for ids in sequences)
    assert agreement[:, 1].tolist() == [tokens] * len(SPEC["layer_ids"])
    shares = ", ".join(f"layer {layer} {agree}/{total} ({agree / total:.3f})" for layer, (agree, total) in zip(SPEC["layer_ids"], agreement, strict=True))
    print(f"vLLM TP=2 top-{SPEC['top_k']} set agreement with the HF fp32 router: {shares}")

def test_status_and_top_show_each_rank(served: Served) -> None:
    layouts = [s["layout"] for s in served.statuses]
    assert [(x["rank"], x["tp_rank"], x["replicates_tokens"]) for x in layouts] == [(0, 0, False), (1, 1, True)]
    assert "rank 0 [TP2 (TP attention) tp0 ep0]" in served.top and "rank 1 [TP2 (TP attention) tp1 ep0, replica]" in served.top
    tokens = sum(len(p) for p in served.prompt_ids) + len(PROMPTS) * (GENERATION["max_tokens"] - 1)
    assert f"tokens served: {tokens} (1 replica rank(s)" in served.top


def test_outputs_are_the_same_without_moetrace(served: Served) -> None:
    assert served.plain_outputs == served.outputs
    # The hooks were really gone: the recorders counted nothing of the second generate.
    assert [s["passes"] for s in served.after] == [c["passes"] for c in served.exit_captures]  # up to the second generate



def test_dumps_at_exit_name_each_rank_and_count_once(served: Served) -> None:
    check_dumps_at_exit(served, "per_pass")
