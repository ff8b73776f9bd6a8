"""vLLM 0.32 CPU at ``tensor_parallel_size=2`` in ``stat`` mode: the plainest way to use the plugin.

``vllm.LLM(..., tensor_parallel_size=2).generate(...)`` with ``MOETRACE_ENABLED=1
MOETRACE_MODE=stat``: each worker keeps its own totals and dumps them alone, through
its control endpoint's ``/dump`` and at exit, after vLLM has torn its process group
down (both files once said rank 0 of 1, and ``merge`` / ``analyze`` refused them).
One engine (:func:`.multirank.serve`, the same run as the ``per_pass`` and ``per_token``
modules) checks that:

- each ``/dump`` is rank r of 2 with the TP layout, and holds that worker's view,
  equal to an independent capture in that worker;
- ``analyze_traces`` of the two live files counts the tokens of the first
  ``generate`` once, with the engine's per-expert counts;
- each dump at exit is rank r of 2 and cumulative (both ``generate`` calls);
  ``moetrace analyze`` of the two files and ``moetrace merge`` give every token
  the engine ran once (:func:`.multirank.check_dumps_at_exit`).
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.analysis.distributed import analyze_traces
from moetrace.trace.reader import open_trace

from .multirank import SPEC, TP, Served, check_dumps_at_exit, computed, serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve(tmp_path_factory, "tp2stat", mode="stat")


def test_each_live_dump_is_its_rank_of_two(served: Served) -> None:
    assert len(served.dumps) == TP
    for rank, (path, independent) in enumerate(zip(served.dumps, served.captures, strict=True)):
        assert path.name == f"live-rank{rank}.h5"
        with open_trace(path) as trace:
            assert (trace.attrs["rank"], trace.attrs["world_size"], trace.mode) == (rank, TP, "stat")
            assert [(x.rank, x.tp_rank, x.source) for x in trace.layouts] == [(rank, rank, "vllm")]
            np.testing.assert_array_equal(trace.physical_count(), independent["counts"].sum(axis=0))
        assert independent["topk_violations"] == 0


def test_live_dumps_count_each_token_once(served: Served) -> None:
    tokens = sum(len(ids) for ids in computed(served))
    engine = served.captures[0]["counts"].sum(axis=0)  # [L, E]
    assert int(engine.sum()) == tokens * SPEC["top_k"] * len(SPEC["layer_ids"])
    report = analyze_traces(served.dumps)
    assert report.num_tokens == tokens
    np.testing.assert_array_equal(report.physical_count, engine)
    assert served.exported_tokens == tokens


def test_dumps_at_exit_name_each_rank_and_count_once(served: Served) -> None:
    check_dumps_at_exit(served, "stat")
