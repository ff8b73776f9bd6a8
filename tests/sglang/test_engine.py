"""moetrace on a live SGLang engine (``sglang.Engine``, CPU), attached through the ``sglang.srt.plugins`` entry point.

One plain engine (no moetrace) and one with ``MOETRACE_ENABLED=1`` run the same
requests. In the second, SGLang's own recorder runs in ``per_token`` mode and
moetrace's in ``per_token`` mode, and SGLang returns each request's routed
experts. Four sources of the same routing are compared:

- moetrace's trace (its recorder, fed by the bridge in SGLang's scheduler process);
- SGLang's own recorder dump (``.pt``, written by ``dump_expert_distribution_record``);
- SGLang's per-request routed experts (``meta_info["routed_experts"]``);
- an independent count: the Hugging Face forward of the same checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moetrace.adapters.sglang import read_routed_experts, routed_experts_payload

from moetrace.trace.convert import convert_sglang
from moetrace.trace.reader import Trace, open_trace
from moetrace.trace.token_routes import request_routes
from moetrace.wire import decode_routed_experts

from .checkpoint import NUM_EXPERTS, NUM_LAYERS, TOP_K, build_checkpoint
from .engine import GENERATION, PROMPTS, engine
from .reference import hf_routes
from .workload import (
    MANY,
    MANY_GENERATION,
    check_audit,
    check_request_rows,
    computed_sequences,
    workload_hf_routes,
)

pytestmark = pytest.mark.slow


@dataclasses.dataclass
class Run:
    checkpoint: Path
    sequential: list[dict[str, Any]]  # one generate call per prompt
    batched: list[dict[str, Any]]  # one generate call with every prompt
    moetrace_files: list[Path]
    sglang_files: list[Path]
    many: list[dict[str, Any]]  # MANY: one generate call of 16 requests sharing a prefix, chunked prefill


def _requests(llm: Any, routed: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    extra = {"return_routed_experts": True} if routed else {}
    sequential = [llm.generate(input_ids=p, sampling_params=GENERATION, **extra) for p in PROMPTS]
    batched = llm.generate(input_ids=PROMPTS, sampling_params=GENERATION, **extra)
    return sequential, batched


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with engine(str(checkpoint), {"MOETRACE_ENABLED": "0"}) as llm:
        return _requests(llm, routed=False)


@pytest.fixture(scope="module")
def run(checkpoint: Path, plain: Any, tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("dumps")
    env = {
        "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "per_token", "MOETRACE_OUTPUT_DIR": str(out / "moetrace"),
        "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(out / "sglang"),
    }
    with engine(str(checkpoint), env, expert_distribution_recorder_mode="per_token", enable_return_routed_experts=True) as llm:
        llm.start_expert_distribution_record()
        sequential, batched = _requests(llm, routed=True)
        many = llm.generate(input_ids=MANY, sampling_params=MANY_GENERATION, return_routed_experts=True)
        llm.stop_expert_distribution_record()
        llm.dump_expert_distribution_record()
    return Run(checkpoint, sequential, batched, sorted((out / "moetrace").glob("moetrace-*.h5")), sorted((out / "sglang").glob("*.pt")), many)


@pytest.fixture(scope="module")
def trace(run: Run) -> Trace:
    assert len(run.moetrace_files) == 1, f"expected one moetrace dump, found {run.moetrace_files}"
    with open_trace(run.moetrace_files[0]) as t:
        yield t


@pytest.fixture(scope="module")
def sglang_dump(run: Run) -> dict[str, Any]:
    assert len(run.sglang_files) == 1, f"expected one SGLang dump, found {run.sglang_files}"
    return torch.load(run.sglang_files[0], weights_only=True)


def _tokens(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = list(trace.iter_tokens())
    return tuple(np.concatenate([getattr(c, name) for c in chunks]) for name in ("topk_ids", "pass_id", "position"))  # type: ignore[return-value]


def _per_pass_counts(ids: np.ndarray, pass_ids: np.ndarray) -> dict[int, np.ndarray]:
    """``{pass id: [L, P] counts}`` from token rows ``ids [M, L, k]``."""
    counts = {}
    for pid in np.unique(pass_ids):
        rows = ids[pass_ids == pid]
        counts[int(pid)] = np.stack([np.bincount(rows[:, layer][rows[:, layer] >= 0], minlength=NUM_EXPERTS) for layer in range(NUM_LAYERS)])
    return counts


def test_outputs_are_identical_with_and_without_moetrace(run: Run, plain: Any) -> None:
    sequential, batched = plain
    assert [a["output_ids"] for a in run.sequential] == [a["output_ids"] for a in sequential]
    assert [a["output_ids"] for a in run.batched] == [a["output_ids"] for a in batched]
    assert all(len(a["output_ids"]) == GENERATION["max_new_tokens"] for a in sequential)


def test_trace_describes_the_sglang_model(trace: Trace) -> None:
    attrs = trace.attrs
    assert attrs["engine"] == "sglang" and trace.mode == "per_token"
    assert (trace.num_layers, trace.num_physical_experts, trace.top_k) == (NUM_LAYERS, NUM_EXPERTS, TOP_K)
    np.testing.assert_array_equal(trace.physical_to_logical, np.tile(np.arange(NUM_EXPERTS), (NUM_LAYERS, 1)))


def test_per_pass_counts_equal_sglang_recorder(trace: Trace, sglang_dump: dict[str, Any]) -> None:
    ids, pass_ids, position = _tokens(trace)
    ours = _per_pass_counts(ids, pass_ids)
    records = {int(r["forward_pass_id"]): r for r in sglang_dump["records"]}
    assert sorted(ours) == sorted(records), "moetrace and SGLang recorded different forward passes"
    for pid, record in records.items():
        np.testing.assert_array_equal(ours[pid], record["global_physical_count"].numpy(), err_msg=f"pass {pid}")
        theirs = record["topk_ids_of_layer"].numpy()[:, :, :TOP_K].transpose(1, 0, 2)  # [T, L, k]
        mine = ids[pass_ids == pid]
        np.testing.assert_array_equal(np.sort(mine, axis=-1), np.sort(theirs, axis=-1), err_msg=f"pass {pid}")
        np.testing.assert_array_equal(position[pass_ids == pid], np.arange(len(mine)))
    # prefill passes hold every prompt token, decode passes one token per running request
    assert sum(len(r["input_ids"]) for r in records.values()) == len(ids)


def test_every_pass_carries_the_phase_sglang_ran(trace: Trace, sglang_dump: dict[str, Any]) -> None:
    """SGLang's own per_token dump records each pass's ForwardMode: moetrace's rows carry its pass phase."""
    from moetrace.adapters.sglang.bridge import SGLANG_PASS_PHASES
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from moetrace.pass_phase import pass_phase_code
    from moetrace.trace.pass_phases import pass_phase_counts

    chunks = list(trace.iter_tokens())
    pass_ids, phases = np.concatenate([c.pass_id for c in chunks]), np.concatenate([c.pass_phase for c in chunks])
    seen = set()
    for record in sglang_dump["records"]:
        want = SGLANG_PASS_PHASES[ForwardMode(record["forward_mode"]).name]
        mine = phases[pass_ids == int(record["forward_pass_id"])]
        assert len(mine) and (mine == pass_phase_code(want)).all(), f"pass {record['forward_pass_id']}: SGLang ran {want}, moetrace says {set(mine.tolist())}"
        seen.add(want)
    assert seen == {"prefill", "decode"}  # the run has both (no chunked-prefill mixing in this engine's settings)
    passes, _, _ = pass_phase_counts(trace)
    assert passes[pass_phase_code("unknown")] == 0 and passes.sum() == len(sglang_dump["records"])


@pytest.fixture(scope="module")
def independent(run: Run) -> list[np.ndarray]:
    """The HF forward's routes of every position each of the run's requests computed."""
    return workload_hf_routes(run.checkpoint, run.sequential + run.batched + run.many)


def test_counts_equal_an_independent_hugging_face_count(run: Run, trace: Trace, independent: list[np.ndarray]) -> None:
    """Recorders count the tokens a forward pass computed: prefix-cache hits (``cached_tokens``) are not routed again."""
    answers = run.sequential + run.batched + run.many
    computed = [route[a["meta_info"]["cached_tokens"] :] for a, route in zip(answers, independent, strict=True)]
    assert sum(a["meta_info"]["cached_tokens"] for a in run.batched) > 0  # the batch reuses the earlier prompts
    expected = np.zeros((NUM_LAYERS, NUM_EXPERTS), np.int64)
    for route in computed:
        for layer in range(NUM_LAYERS):
            expected[layer] += np.bincount(route[:, layer].ravel(), minlength=NUM_EXPERTS)
    np.testing.assert_array_equal(trace.physical_count(), expected)
    ids, _, _ = _tokens(trace)
    assert len(ids) == sum(len(r) for r in computed)


def test_routed_experts_equal_moetrace_tokens(run: Run, trace: Trace) -> None:
    """Sequential requests: request r's rows are the next P_r + N - 1 token rows of the trace, in pass order."""
    ids, pass_ids, _ = _tokens(trace)
    order = np.argsort(pass_ids, kind="stable")
    rows = ids[order]
    start = 0
    for prompt, answer in zip(PROMPTS, run.sequential, strict=True):
        routed = read_routed_experts(answer, NUM_LAYERS, TOP_K)
        assert routed.shape == (len(prompt) + GENERATION["max_new_tokens"] - 1, NUM_LAYERS, TOP_K)
        np.testing.assert_array_equal(np.sort(rows[start : start + len(routed)], axis=-1), np.sort(routed, axis=-1))
        start += len(routed)
        payload = routed_experts_payload(answer, NUM_LAYERS, TOP_K)  # moetrace's wire format
        np.testing.assert_array_equal(decode_routed_experts(payload), routed)


def test_routed_experts_of_batched_requests_equal_hugging_face(run: Run) -> None:
    """Routed experts cover every position, prefix-cache hits included (SGLang keeps them by KV slot)."""
    routes = hf_routes(run.checkpoint, computed_sequences(run.batched, PROMPTS))
    for answer, route in zip(run.batched, routes, strict=True):
        np.testing.assert_array_equal(np.sort(read_routed_experts(answer, NUM_LAYERS, TOP_K), axis=-1), route)


def test_convert_reads_the_real_per_token_dump(run: Run, trace: Trace, tmp_path: Path) -> None:
    out = convert_sglang(run.sglang_files[0], tmp_path / "converted.h5", top_k=TOP_K)
    with open_trace(out) as converted:
        assert converted.mode == "per_token" and converted.attrs["engine"] == "sglang"
        np.testing.assert_array_equal(converted.physical_count(), trace.physical_count())
        theirs, their_pass, _ = _tokens(converted)
    ours, our_pass, _ = _tokens(trace)
    o1, o2 = np.lexsort((np.arange(len(our_pass)), our_pass)), np.lexsort((np.arange(len(their_pass)), their_pass))
    np.testing.assert_array_equal(np.sort(ours[o1], axis=-1), np.sort(theirs[o2], axis=-1))


def test_report_of_the_sglang_trace_in_a_real_browser(run: Run, tmp_path: Path) -> None:
    """``moetrace report`` of the live engine's trace with SGLang's own per-request routed experts, opened in Chromium."""
    from moetrace.report import build_report
    from moetrace.routes import save_routes

    from ..report.browser import available, browser, check_page, choose_request, open_report

    routes = save_routes(tmp_path / "routes.json", {f"req-{i}": read_routed_experts(a, NUM_LAYERS, TOP_K) for i, a in enumerate(run.sequential)},
                         model="sglang-qwen3-moe", num_experts=NUM_EXPERTS)
    out = build_report(run.moetrace_files, tmp_path / "sglang.html", routes=routes)
    assert available() is None, available()
    with browser() as driver:
        view = open_report(driver, out)
        assert {"headline", "experts", "routes", "coactivation"} <= set(view.sections)
        check_page(view, view.sections)
        before, after = choose_request(driver, 1)
        assert before["z"] != after["z"]


def test_per_token_rows_are_each_requests_routes(run: Run, trace: Trace, independent: list[np.ndarray]) -> None:
    """Issue 35: the trace alone gives every request's routes, keyed by SGLang's own request id; at every
    computed position they equal SGLang's return_routed_experts answer and the independent HF forward,
    and positions served from the prefix cache are -1 (no pass computed them)."""
    check_request_rows(request_routes(trace), run.sequential + run.batched + run.many, independent)


def test_audit_of_sglang_answers_against_the_trace(run: Run, tmp_path: Path) -> None:
    """Issue 35: ``moetrace audit`` of SGLang's returned routes against moetrace's trace of the same run exits 0;
    the same answers with one request's routes shifted by a position and another's bound to a third request's
    fail, naming exactly those requests and faults (exit 1)."""
    check_audit(run.sequential + run.batched + run.many, run.moetrace_files, tmp_path)
