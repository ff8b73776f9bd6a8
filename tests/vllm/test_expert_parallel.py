"""vLLM 0.32 CPU at ``tensor_parallel_size=2, enable_expert_parallel=True``, with the CPU EP shim.

Without the shim the worker segfaults in ``csrc/cpu/cpu_fused_moe.cpp:242``,
moetrace on or off (see :mod:`tests.vllm.shims.cpu_expert_parallel`, loaded
through vLLM's ``worker_extension_cls``, and docs/integrations/vllm.md). With
it, EP runs as vLLM's GPU path does under TP attention: each rank routes the
whole batch, computes its half of the experts, and the outputs are all-reduced.

The plugin records ``per_token`` here (the tensor-parallel module records
``per_pass``), so that both streaming modes' dumps at exit are read back at TP=2,
and each row's request and position are checked against the tokens vLLM fed.
moetrace records EP rank ``r`` of 2 on worker ``r``, counts each token once
(the views are replicas), and its per-rank load equals the load the engine's
own placement gives: the counted view's counts summed over the experts each
worker's ``expert_map`` says it holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis.distributed import analyze_traces
from moetrace.routes import load_routes
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


def test_each_ranks_rows_are_the_tokens_vllm_fed_for_their_request(served: Served, tmp_path: Path) -> None:
    """Request rows at TP=2 EP=2: each rank follows its own model runner (every TP rank holds the whole
    batch). Every row's (request, position) names the token that rank's independent capture saw vLLM
    feed at that row, every computed position of every request is a row once, and ``moetrace routes``
    of both rank files passes ``moetrace audit`` against them."""
    sequences = dict(zip(served.request_ids, computed(served), strict=True))
    first = min(SPEC["layer_ids"])
    views = []
    for path, independent in zip(served.dumps, served.captures, strict=True):
        fed = np.concatenate([row["token"] for row in independent["routes"] if row["layer"] == first])
        with open_trace(path) as trace:
            chunks = list(trace.iter_tokens())
            table = [str(t) for t in trace.request_table()]
        request = np.concatenate([c.request for c in chunks]).astype(np.int64)
        position = np.concatenate([c.request_position for c in chunks]).astype(np.int64)
        assert len(request) == len(fed) and (request >= 0).all()
        owner = np.asarray([t.rsplit("-", 1)[0] for t in table])[request]  # vLLM's engine-core id: request_id + "-" + 8 characters
        for rid, tokens in sequences.items():
            mine = owner == rid
            assert sorted(position[mine].tolist()) == list(range(len(tokens)))
            np.testing.assert_array_equal(fed[mine], np.asarray(tokens)[position[mine]])
        views.append((owner.tolist(), position.tolist()))
    assert views[0] == views[1]  # the replica rank holds the same rows
    routes = tmp_path / "routes.json"
    cli = CliRunner().invoke(app, ["routes", *map(str, served.dumps), "-o", str(routes)])
    assert cli.exit_code == 0, cli.output
    assert sorted(t.rsplit("-", 1)[0] for t in load_routes(routes).requests) == sorted(served.request_ids)
    cli = CliRunner().invoke(app, ["audit", *map(str, served.dumps), "--returned", str(routes)])
    assert cli.exit_code == 0, cli.output


def test_outputs_are_the_same_without_moetrace(served: Served) -> None:
    assert served.plain_outputs == served.outputs
    assert [s["passes"] for s in served.after] == [c["passes"] for c in served.exit_captures]  # up to the second generate


def test_dumps_at_exit_name_each_rank_and_count_once(served: Served) -> None:
    check_dumps_at_exit(served, "per_token")
