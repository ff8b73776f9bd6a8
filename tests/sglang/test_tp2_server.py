"""moetrace on a live two-rank SGLang HTTP server (``python -m sglang.launch_server --tp-size 2``, loopback).

Driven as a user would: ``moetrace start/stop/dump --sglang --url``, requests over
``/generate`` one at a time, then ``moetrace inspect`` of the gathered ``stat`` trace.
Both TP ranks route the same tokens (TP attention); the trace counts them once and
its per-expert counts equal SGLang's own recorder's (one rank's share of its all-reduced count).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from moetrace.reference import free_port
from moetrace.trace.reader import open_trace

from ..servers import SUBPROCESS_BOUND_S, moetrace_cli, post_json, serve
from .checkpoint import build_checkpoint
from .engine import CPU_ENV, ENGINE_ARGS, GENERATION, PROMPTS
from .multirank import (
    TWO_RANKS,
    WORKLOAD_TOKENS,
    expert_count,
    hf_computed_routes,
    sglang_recorder_count,
)
from .test_server import START_TIMEOUT, _flags

pytestmark = pytest.mark.slow

_post = functools.partial(post_json, timeout=SUBPROCESS_BOUND_S)
_cli = moetrace_cli


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp2_server")
    checkpoint = build_checkpoint(root / "qwen3_moe")
    port = free_port()
    env = {**os.environ, **CPU_ENV, **TWO_RANKS, "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "stat", "MOETRACE_OUTPUT_DIR": str(root / "moetrace"),
           "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(root / "sglang")}
    args = {**ENGINE_ARGS, "tp_size": 2, "expert_distribution_recorder_mode": "stat"}
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), *_flags(args)]
    url = f"http://127.0.0.1:{port}"
    with serve(command, env, root / "server.log", url + "/health", START_TIMEOUT):
        _cli("start", "--sglang", "--url", url)
        answers = [_post(url + "/generate", {"input_ids": p, "sampling_params": GENERATION}) for p in PROMPTS]
        _cli("stop", "--sglang", "--url", url)
        _cli("dump", "--sglang", "--url", url)
    (trace,) = (root / "moetrace").glob("moetrace-*.h5")
    yield {"checkpoint": checkpoint, "answers": answers, "trace": trace, "sglang_files": sorted((root / "sglang").glob("*.pt"))}


def test_server_trace_counts_each_token_once(served: dict[str, Any]) -> None:
    """Each token once; per expert, what SGLang's own recorder counted (not the HF fp32 forward, whose
    near-tied router scores may rank differently after the two ranks' all-reduce: printed as a figure)."""
    expected = sglang_recorder_count(served["sglang_files"], 2)
    hf = expert_count(hf_computed_routes(served["checkpoint"], served["answers"]))
    with open_trace(served["trace"]) as trace:
        assert [(x.rank, x.tp_rank, x.tp_size) for x in trace.layouts] == [(0, 0, 2), (1, 1, 2)]
        assert trace.tokens_served() == WORKLOAD_TOKENS
        np.testing.assert_array_equal(trace.logical_count(), expected)
        assert int(trace.logical_count().sum()) == 144
    print(f"SGLang TP=2 server: [layer, expert] cells equal to the HF fp32 count: {int((expected == hf).sum())} of {hf.size}")


def test_inspect_shows_the_layout(served: dict[str, Any]) -> None:
    text = _cli("inspect", str(served["trace"]))
    assert "Rank rows: TP2 (TP attention) (sglang); tokens served 24" in text, text
