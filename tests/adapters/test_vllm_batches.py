"""vLLM's step batch read from the model runner's host fields (no vLLM needed: the fields are stood in for).

The live engine checks (every row's request and position against the tokens vLLM fed, chunked
prefill, prefix-cache hits, continuous batching) are in tests/vllm/test_divergence_replay.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from moetrace.adapters.base import HookRegistry
from moetrace.adapters.vllm.batches import StepBatches, vllm_pass_batch, vllm_v2_pass_batch

from moetrace.testing import assert_no_host_sync

# Five requests as a runner holds them (arrays sized for more requests than run, as vLLM's are):
# a decode step, the second chunk of a chunked prefill, a prefix-cache hit of 128 tokens, a request
# recomputing its generated tokens after preemption, and a decode step with two draft tokens.
REQ_IDS = ["a-00000000", "b-11111111", "c-22222222", "d-33333333", "e-44444444"]
COMPUTED = [20, 64, 128, 10, 9]
PROMPT = [12, 150, 148, 10, 5]
SCHEDULED = [1, 64, 20, 5, 3]


def _runner_state(scheduled: list[int] = SCHEDULED, spec: dict[str, list[int]] | None = None) -> tuple[Any, Any]:
    pad = np.zeros(3, dtype=np.int32)
    input_batch = SimpleNamespace(
        req_ids=list(REQ_IDS),
        num_computed_tokens_cpu=np.concatenate([np.asarray(COMPUTED, dtype=np.int32), pad]),
        num_prompt_tokens=np.concatenate([np.asarray(PROMPT, dtype=np.int32), pad]),
    )
    step = SimpleNamespace(num_scheduled_tokens=dict(zip(REQ_IDS, scheduled, strict=True)),
                           scheduled_spec_decode_tokens=spec if spec is not None else {"e-44444444": [7, 8]})
    return input_batch, step


def test_rows_positions_and_phase_from_the_host_fields() -> None:
    input_batch, step = _runner_state()
    with assert_no_host_sync():
        batch = vllm_pass_batch(input_batch, step, num_rows=96)
    assert batch.request_ids == tuple(REQ_IDS)
    assert batch.prefill.tolist() == [False, True, True, True, False]  # d recomputes 5 positions: prefill rows
    assert batch.phase == "mixed" and batch.num_requests == 5 and batch.num_tokens == 93
    request, position = batch.row_requests()
    expected_request = np.repeat(np.arange(5), SCHEDULED)
    expected_position = np.concatenate([np.arange(c, c + n) for c, n in zip(COMPUTED, SCHEDULED, strict=True)])
    np.testing.assert_array_equal(request[:93], expected_request)
    np.testing.assert_array_equal(position[:93], expected_position)
    assert (request[93:] == -1).all() and (position[93:] == -1).all()  # a padded batch's extra rows belong to no request


def test_without_drafts_several_positions_past_the_prompt_are_prefill_rows() -> None:
    input_batch, step = _runner_state(spec={})
    batch = vllm_pass_batch(input_batch, step, num_rows=93)
    assert batch.prefill.tolist() == [False, True, True, True, True]


def test_decode_only_step() -> None:
    input_batch, step = _runner_state(scheduled=[1, 0, 0, 0, 1], spec={})
    batch = vllm_pass_batch(input_batch, step, num_rows=2)
    assert batch.phase == "decode" and batch.num_requests == 2


class _Runner:
    """Stands in for vLLM's model runner: ``execute_model`` runs the model once."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.input_batch, _ = _runner_state()

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        return self.model(input_ids=torch.zeros(96, dtype=torch.int64), positions=torch.zeros(96, dtype=torch.int64))


def test_step_batches_follow_execute_model_and_undo_cleanly() -> None:
    hooks = HookRegistry()
    batches = StepBatches(hooks)
    seen: list[Any] = []
    runner = _Runner(lambda *args, **kwargs: seen.append(batches.batch_of(args, kwargs)))
    assert batches.batch_of((), {"input_ids": torch.zeros(3)}) is None  # not attached
    batches.attach(runner)
    batches.attach(runner)  # once
    with pytest.raises(RuntimeError, match="one vLLM model runner"):
        batches.attach(_Runner(lambda **_: None))
    _, step = _runner_state()
    runner.execute_model(step)
    assert seen[-1] is not None and seen[-1].num_rows == 96 and seen[-1].request_ids == tuple(REQ_IDS)
    runner.model(input_ids=torch.zeros(4))  # a forward outside a step (a warm-up dummy run)
    assert seen[-1] is None
    assert hooks.remove_all() == []
    assert "execute_model" not in vars(runner) and not batches.attached


def test_a_batch_that_does_not_fit_the_rows_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    hooks = HookRegistry()
    batches = StepBatches(hooks)
    seen: list[Any] = []
    runner = _Runner(lambda *args, **kwargs: seen.append(batches.batch_of(args, {"input_ids": torch.zeros(10)})))
    batches.attach(runner)
    _, step = _runner_state()
    runner.execute_model(step)
    assert seen == [None]
    assert "rows are recorded without requests" in caplog.text
    hooks.remove_all()


def test_a_replaced_execute_model_is_left_alone_and_reported() -> None:
    hooks = HookRegistry()
    batches = StepBatches(hooks)
    runner = _Runner(lambda **_: None)
    batches.attach(runner)
    def other(scheduler_output: Any) -> None:
        return None

    runner.execute_model = other
    with pytest.warns(RuntimeWarning, match="replaced by someone else"):
        problems = hooks.remove_all()
    assert len(problems) == 1 and runner.execute_model is other


class _V2Runner:
    """Stands in for vLLM's model runner V2: ``execute_model`` builds the step's batch in ``prepare_inputs``, then runs the model
    (the real structures, built as the runner builds them, are checked in tests/vllm_contract/test_runner_batches.py)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        pad = np.zeros(3, dtype=np.int32)
        slots = np.array([4, 0, 2, 6, 1])  # each request's slot in req_states (V2 keeps requests in slots, not in row order)
        prompt_len = np.zeros(8, dtype=np.int32)
        prompt_len[slots] = PROMPT
        self.req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=prompt_len))
        self._batch = SimpleNamespace(
            req_ids=list(REQ_IDS), num_scheduled_tokens=np.asarray(SCHEDULED, dtype=np.int32),
            num_computed_tokens_np=np.asarray(COMPUTED, dtype=np.int32), idx_mapping_np=slots,
            num_draft_tokens_per_req=np.array([0, 0, 0, 0, 2], dtype=np.int32), prefill_len_np=np.concatenate([np.asarray(PROMPT), pad]),
        )

    def prepare_inputs(self, scheduler_output: Any, *args: Any) -> Any:
        return self._batch

    def execute_model(self, scheduler_output: Any, dummy_run: bool = False) -> Any:
        if dummy_run:
            return self.model(input_ids=torch.zeros(4, dtype=torch.int64))
        batch = self.prepare_inputs(scheduler_output)
        return self.model(input_ids=torch.zeros(96, dtype=torch.int64), positions=torch.zeros(96, dtype=torch.int64), batch=batch)


def test_the_v2_runner_is_followed_through_the_batch_its_prepare_inputs_builds() -> None:
    hooks = HookRegistry()
    batches = StepBatches(hooks)
    seen: list[Any] = []
    runner = _V2Runner(lambda *args, **kwargs: seen.append(batches.batch_of(args, kwargs)))
    batches.attach(runner)
    assert {"execute_model", "prepare_inputs"} <= set(vars(runner))
    runner.execute_model(SimpleNamespace())
    v1_input_batch, step = _runner_state()
    v1 = vllm_pass_batch(v1_input_batch, step, num_rows=96)  # the same batch as the v1 runner's fields give
    assert (seen[-1].request_ids, seen[-1].phase, seen[-1].num_rows) == (v1.request_ids, v1.phase, v1.num_rows)
    np.testing.assert_array_equal(seen[-1].prefill, v1.prefill)
    for got, expected in zip(seen[-1].row_requests(), v1.row_requests(), strict=True):
        np.testing.assert_array_equal(got, expected)
    runner.execute_model(SimpleNamespace(), dummy_run=True)  # a dummy batch: no prepare_inputs, no requests
    assert seen[-1] is None
    runner.model(input_ids=torch.zeros(4))  # outside a step
    assert seen[-1] is None
    assert hooks.remove_all() == [] and not ({"execute_model", "prepare_inputs"} & set(vars(runner)))


def test_v2_prompt_lengths_on_the_device_only_are_not_read() -> None:
    runner = _V2Runner(None)
    runner.req_states.prompt_len = torch.zeros(8, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="on meta only; moetrace reads host values"):
        vllm_v2_pass_batch(runner._batch, runner.req_states, num_rows=96)
