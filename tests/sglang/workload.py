"""The request-rows workload and checks (issue 35) that the one-rank and the TP=2 SGLang modules share.

Workload: :data:`PROMPTS` one at a time, the same prompts in one call, then :data:`MANY`:
16 requests in one call, interleaved by continuous batching, half of them starting with
``PROMPTS[2]`` (cached by then: prefix-cache hits), their prompts together longer than
``chunked_prefill_size`` (chunked prefill). Checks, given each request's routes from
moetrace's ``per_token`` trace: at every computed position they equal SGLang's
``return_routed_experts`` answer and the independent Hugging Face forward, prefix-cache hits
are ``-1``; ``moetrace audit`` of the answers against the trace exits 0, and 1 naming exactly
the requests whose returned routes were planted with a fault.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
from moetrace.adapters.sglang import answers_routes, read_routed_experts

from .checkpoint import NUM_LAYERS, TOP_K
from .engine import ENGINE_ARGS, GENERATION, PROMPTS
from .reference import hf_routes

__all__ = ["MANY", "MANY_GENERATION", "WORKLOAD_PROMPTS", "check_audit", "check_request_rows", "computed_sequences", "routed_experts_b64", "workload_hf_routes"]

# 16 requests whose prompts start with PROMPTS[2] (cached by then) or with each other's first tokens,
# 6-13 tokens each with varied output lengths: 16 x ~14 prompt tokens > chunked_prefill_size=64
_rng = np.random.default_rng(11)
MANY = [(PROMPTS[2] if i % 2 else [40, 41, 42, 43]) + _rng.integers(50, 100, size=int(_rng.integers(2, 7))).tolist() for i in range(16)]
MANY_GENERATION = [dict(GENERATION, max_new_tokens=int(n)) for n in _rng.integers(2, 7, size=16)]

WORKLOAD_PROMPTS = PROMPTS + PROMPTS + MANY
"""The prompts of the workload's answers in order: sequential, batched, :data:`MANY`."""


def computed_sequences(answers: list[dict[str, Any]], prompts: list[list[int]]) -> list[list[int]]:
    """Each request's positions that went through a forward pass: prompt + generated tokens but the last."""
    return [p + a["output_ids"][:-1] for p, a in zip(prompts, answers, strict=True)]


def workload_hf_routes(checkpoint: Path, answers: list[dict[str, Any]]) -> list[np.ndarray]:
    """The independent routes of the workload's ``answers``: the HF forward's top-k ``[positions, L, k]`` of
    every position each request ran through a pass (prefix-cache hits included), ids sorted within a token."""
    return hf_routes(checkpoint, computed_sequences(answers, WORKLOAD_PROMPTS))


def check_request_rows(routes: dict[str, np.ndarray], answers: list[dict[str, Any]], independent: list[np.ndarray]) -> None:
    """``routes`` (request id -> ``[T, L, k]`` from the trace) of the workload's ``answers``: keyed by SGLang's
    own request ids; at every computed position equal to SGLang's returned routes and to ``independent``
    (:func:`workload_hf_routes`); positions served from the prefix cache ``-1`` (no pass computed them)."""
    assert sorted(routes) == sorted(a["meta_info"]["id"] for a in answers)
    cached = [a["meta_info"]["cached_tokens"] for a in answers]
    assert len(answers) == len(WORKLOAD_PROMPTS) and sum(c > 0 for c in cached[-16:]) >= 4  # prefix-cache hits among the 16
    assert sum(len(p) for p in MANY) > ENGINE_ARGS["chunked_prefill_size"]  # their prefill is chunked
    for answer, hit, reference in zip(answers, cached, independent, strict=True):
        rid = answer["meta_info"]["id"]
        got = routes[rid]
        assert got.shape == reference.shape, rid
        assert (got[:hit] == -1).all() and (got[hit:] >= 0).all(), rid
        np.testing.assert_array_equal(np.sort(got[hit:], axis=-1), np.sort(read_routed_experts(answer, NUM_LAYERS, TOP_K)[hit:], axis=-1), err_msg=rid)
        np.testing.assert_array_equal(np.sort(got[hit:], axis=-1), reference[hit:], err_msg=rid)


def check_audit(answers: list[dict[str, Any]], traces: list[Path], tmp_path: Path) -> None:
    """``moetrace audit`` of the ``answers`` against ``traces`` (the command, in this process): exit 0; then,
    with one request's routes shifted by a position and another's bound to a third request's, exit 1 naming
    exactly those two requests and their faults."""
    from moetrace.cli.app import app
    from typer.testing import CliRunner

    from moetrace.analysis.route_audit import audit_routes, trace_source


    report = audit_routes(answers_routes(answers, NUM_LAYERS, TOP_K), trace_source(traces))
    figures = report.to_dict()
    assert report.ok and figures["requests"] == len(answers) and figures["compared_rows"] == figures["matched_rows"] > 0
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(answers))
    files = [str(f) for f in traces]
    result = CliRunner().invoke(app, ["audit", *files, "--returned", str(path), "--model-layers", str(NUM_LAYERS)])
    assert result.exit_code == 0, result.output
    # plant: the longest uncached answer shifted by one position, a second one holding a third's routes (same length)
    faulty = json.loads(json.dumps(answers))
    decoded = {a["meta_info"]["id"]: read_routed_experts(a, NUM_LAYERS, TOP_K) for a in answers}
    fresh = [a for a in faulty if a["meta_info"]["cached_tokens"] == 0]
    shifted = max(fresh, key=lambda a: len(decoded[a["meta_info"]["id"]]))
    rows = decoded[shifted["meta_info"]["id"]].copy()
    rows[1:] = rows[:-1].copy()
    shifted["meta_info"]["routed_experts"] = routed_experts_b64(rows)

    def rows_of(answer: dict[str, Any]) -> np.ndarray:
        return decoded[answer["meta_info"]["id"]]

    pairs = [(a, b) for a in fresh for b in fresh if a is not b and shifted not in (a, b) and len(rows_of(b)) >= len(rows_of(a))
             and not np.array_equal(rows_of(a), rows_of(b)[: len(rows_of(a))])]
    bound, donor = pairs[0]
    bound["meta_info"]["routed_experts"] = routed_experts_b64(rows_of(donor)[: len(rows_of(bound))])
    path.write_text(json.dumps(faulty))
    result = CliRunner().invoke(app, ["audit", *files, "--returned", str(path), "--json"])
    assert result.exit_code == 1, result.output
    failed = {r["request"]: r for r in json.loads(result.stdout)["per_request"] if not r["ok"]}
    assert set(failed) == {shifted["meta_info"]["id"], bound["meta_info"]["id"]}
    assert set(failed[shifted["meta_info"]["id"]]["faults"]) == {"shifted"}
    assert set(failed[bound["meta_info"]["id"]]["faults"]) == {"foreign"}
    named = failed[bound["meta_info"]["id"]]["foreign_of"]  # the donor, or a request with the same prompt and routes
    assert len(named) == 1 and np.array_equal(decoded[named[0]][: len(rows_of(bound))], rows_of(donor)[: len(rows_of(bound))])


def routed_experts_b64(rows: np.ndarray) -> str:
    """``rows`` as SGLang returns them in ``meta_info["routed_experts"]``: base64 of little-endian int32 bytes."""
    return base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii")
