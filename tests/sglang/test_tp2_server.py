"""moetrace on a live two-rank SGLang HTTP server (``python -m sglang.launch_server --tp-size 2``, loopback).

Driven as a user would: ``moetrace start/stop/dump --sglang --url``, requests over
``/generate`` with ``return_routed_experts`` (the workload of tests/sglang/workload.py: 3 prompts
one at a time, the same 3 in one call, then 16 requests in one call, interleaved by continuous
batching, half of them sharing a cached prefix, chunked prefill). moetrace records in
``per_token`` mode: each rank writes its own trace (``-rank0``, ``-rank1``), joined by
``moetrace.trace.merge.merge_traces``; SGLang's own recorder runs in ``stat`` mode.

Both TP ranks route the same tokens (TP attention): the trace counts them once and its
per-expert counts equal SGLang's own recorder's (one rank's share of its all-reduced count).
Issue 35 at TP=2: both ranks' rows carry every request's id and positions, the two ranks' rows
agree, and the routes read from the per-rank files or the merged trace (the counted rank's rows,
once) equal SGLang's ``return_routed_experts`` answer and the independent Hugging Face forward at
every computed position; ``moetrace audit`` of the answers against the trace exits 0 honest and 1
naming exactly the requests planted with a fault.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetrace.reference import free_port
from moetrace.trace.merge import merge_traces
from moetrace.trace.reader import open_trace
from moetrace.trace.token_routes import request_routes

from ..servers import SUBPROCESS_BOUND_S, moetrace_cli, post_json, serve
from .checkpoint import NUM_LAYERS, TOP_K, build_checkpoint
from .engine import CPU_ENV, ENGINE_ARGS, GENERATION, PROMPTS
from .multirank import TWO_RANKS, WORKLOAD_TOKENS, expert_count, sglang_recorder_count
from .test_server import START_TIMEOUT, _flags
from .workload import (
    MANY,
    MANY_GENERATION,
    WORKLOAD_PROMPTS,
    check_audit,
    check_request_rows,
    computed_sequences,
    workload_hf_routes,
)

pytestmark = pytest.mark.slow

_post = functools.partial(post_json, timeout=SUBPROCESS_BOUND_S)
_cli = moetrace_cli


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp2_server")
    checkpoint = build_checkpoint(root / "qwen3_moe")
    port = free_port()
    env = {**os.environ, **CPU_ENV, **TWO_RANKS, "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "per_token", "MOETRACE_OUTPUT_DIR": str(root / "moetrace"),
           "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(root / "sglang")}
    args = {**ENGINE_ARGS, "tp_size": 2, "expert_distribution_recorder_mode": "stat", "enable_return_routed_experts": True}
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), *_flags(args)]
    url = f"http://127.0.0.1:{port}"

    def generate(input_ids: Any, sampling_params: Any) -> Any:
        return _post(url + "/generate", {"input_ids": input_ids, "sampling_params": sampling_params, "return_routed_experts": True})

    with serve(command, env, root / "server.log", url + "/health", START_TIMEOUT):
        _cli("start", "--sglang", "--url", url)
        answers = [generate(p, GENERATION) for p in PROMPTS]
        answers += generate(PROMPTS, GENERATION) + generate(MANY, MANY_GENERATION)
        _cli("stop", "--sglang", "--url", url)
        _cli("dump", "--sglang", "--url", url)
    files = sorted((root / "moetrace").glob("moetrace-*.h5"))
    assert [f.stem.rsplit("-", 1)[-1] for f in files] == ["rank0", "rank1"], f"per_token: one trace per rank, found {files}"
    yield {"checkpoint": checkpoint, "answers": answers, "files": files, "merged": merge_traces(files, root / "merged.h5"),
           "sglang_files": sorted((root / "sglang").glob("*.pt"))}


@pytest.fixture(scope="module")
def independent(served: dict[str, Any]) -> list[np.ndarray]:
    """The HF forward's routes of every position each request computed."""
    return workload_hf_routes(served["checkpoint"], served["answers"])


def _computed(answers: list[dict[str, Any]]) -> int:
    """Positions the engine ran through a forward pass for the first ``len(answers)`` requests of the workload:
    prompt + generated but the last, less prefix-cache hits."""
    sequences = computed_sequences(answers, WORKLOAD_PROMPTS[: len(answers)])
    return sum(len(s) - a["meta_info"]["cached_tokens"] for s, a in zip(sequences, answers, strict=True))


def test_server_trace_counts_each_token_once(served: dict[str, Any], independent: list[np.ndarray]) -> None:
    """Each token once (each rank's own view holds all of them); per expert, what SGLang's own recorder
    counted and what the independent Hugging Face forward of the computed positions routes."""
    answers, computed = served["answers"], _computed(served["answers"])
    assert _computed(answers[:3]) == WORKLOAD_TOKENS == 24  # the sequential requests: nothing cached
    expected = sglang_recorder_count(served["sglang_files"], 2)
    hf = expert_count([route[a["meta_info"]["cached_tokens"] :] for route, a in zip(independent, answers, strict=True)])
    with open_trace(served["merged"]) as trace:
        assert [(x.rank, x.tp_rank, x.tp_size) for x in trace.layouts] == [(0, 0, 2), (1, 1, 2)]
        assert trace.tokens_served() == computed and list(trace.num_tokens()) == [computed, computed]
        np.testing.assert_array_equal(trace.logical_count(), expected)
        assert int(trace.logical_count().sum()) == computed * NUM_LAYERS * TOP_K
    np.testing.assert_array_equal(expected, hf)


def test_inspect_shows_the_layout(served: dict[str, Any]) -> None:
    text = _cli("inspect", str(served["merged"]))
    assert f"Rank rows: TP2 (TP attention) (sglang); tokens served {_computed(served['answers'])}" in text, text


def test_per_token_rows_of_both_ranks_are_each_requests_routes(served: dict[str, Any], independent: list[np.ndarray], tmp_path: Path) -> None:
    """Issue 35 at TP=2: each rank's own trace holds every request's rows (the ranks agree row for row);
    ``moetrace routes`` of the per-rank files, and the merged trace, give each request's routes once,
    equal to SGLang's return_routed_experts answer and the HF forward at every computed position
    (prefix-cache hits -1)."""
    from moetrace.cli.app import app
    from typer.testing import CliRunner

    from moetrace.routes import load_routes

    answers, files = served["answers"], served["files"]
    per_rank = [request_routes(f) for f in files]  # each rank's own trace alone
    merged = request_routes(served["merged"])
    result = CliRunner().invoke(app, ["routes", *map(str, files), "-o", str(tmp_path / "routes.json")])
    assert result.exit_code == 0, result.output
    assert f"{len(answers)} requests, {_computed(answers)} positions computed" in result.output  # every computed position, no cached one
    written = {rid: arr for rid, (_, arr) in load_routes(tmp_path / "routes.json").requests.items()}
    for routes in (per_rank[0], per_rank[1], written):
        assert sorted(routes) == sorted(merged)
        for rid, rows in merged.items():
            np.testing.assert_array_equal(routes[rid], rows, err_msg=rid)
    check_request_rows(merged, answers, independent)


def test_audit_of_tp2_answers_against_the_trace(served: dict[str, Any], tmp_path: Path) -> None:
    """Issue 35 at TP=2: ``moetrace audit`` of SGLang's answers against the per-rank traces exits 0, and 1 with
    a request's routes shifted and another's bound to a third request's, naming exactly those two; the merged
    trace audits the honest answers the same."""
    from moetrace.adapters.sglang import answers_routes

    from moetrace.analysis.route_audit import audit_routes, trace_source

    check_audit(served["answers"], served["files"], tmp_path)
    report = audit_routes(answers_routes(served["answers"], NUM_LAYERS, TOP_K), trace_source([served["merged"]]))
    assert report.ok and report.to_dict()["matched_rows"] == _computed(served["answers"]) * NUM_LAYERS
