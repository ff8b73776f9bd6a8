"""Request rows from vLLM's model runner V2, on the runner's own structures (the installed release).

A CPU engine cannot run the V2 runner here (it needs Triton with a CPU backend, and the release
wheel's kernels are CUDA), so the step is built the way the runner builds it: vLLM's own
``RequestState`` filled as ``GPUModelRunner.add_requests`` / ``update_requests`` fill it, vLLM's
own ``SchedulerOutput``, and the runner's own ``gather_batch_req_state`` and ``prepare_inputs``
(the real methods, on a runner object given only the collaborators these two methods use). The
three Triton kernels ``prepare_inputs`` launches (token ids, positions and logits indices, written
into device buffers moetrace does not read) are replaced by stand-ins for the test (:func:`_no_kernels`).
moetrace's :class:`StepBatches` follows that runner; the rows of the forward it sees must be the
batch the runner holds: its ``req_ids`` order, ``query_start_loc_np`` rows, positions from
``num_computed_tokens_np``, and its own ``is_prefilling_np``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from moetrace.adapters.base import HookRegistry
from moetrace.adapters.vllm.batches import StepBatches, vllm_v2_pass_batch

from moetrace.testing import assert_no_host_sync

CPU = torch.device("cpu")
MAX_REQS, MAX_TOKENS = 8, 512

# (request, prompt tokens, tokens the runner is given at add_request, computed tokens at this step, rows scheduled)
# a: a decode step (12-token prompt, 8 generated); b: the second 64-token chunk of a chunked prefill;
# c: a prefix-cache hit of 128 tokens; d: resumed after preemption, recomputing its 5 generated tokens;
# e: a new 7-token prompt; f: the last token of a 30-token prompt, alone in its chunk (a prefill row only by its position).
STEP = (
    ("a-00000000", 12, 12, 20, 1),
    ("b-11111111", 150, 150, 64, 64),
    ("c-22222222", 148, 148, 128, 20),
    ("d-33333333", 10, 15, 10, 5),
    ("e-44444444", 7, 7, 0, 7),
    ("f-55555555", 30, 30, 29, 1),
)


def _request_state() -> Any:
    """vLLM's ``RequestState`` as the runner builds it where UVA is unavailable (a GPU under confidential computing):
    the CPU platform says UVA is available, but CPU torch has no pinned memory to give it."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    wanted = dict(max_num_reqs=MAX_REQS, max_model_len=256, max_num_batched_tokens=MAX_TOKENS, num_speculative_steps=0, vocab_size=128, device=CPU)
    accepted = inspect.signature(RequestState).parameters
    uva, buffer_utils.is_uva_available = buffer_utils.is_uva_available, lambda: False
    try:
        return RequestState(**{name: value for name, value in wanted.items() if name in accepted})
    finally:
        buffer_utils.is_uva_available = uva


def _fill(req_states: Any) -> None:
    """What ``add_requests`` (every request once, at its first step) and ``update_requests`` (later steps) do to the host
    fields of ``req_states``; ``apply_staged_writes`` (a Triton kernel copying them to the device) is not run."""
    for req_id, prompt, given, _, _ in STEP:
        req_states.add_request(req_id=req_id, prompt_len=prompt, all_token_ids=list(range(given)), num_computed_tokens=0, max_tokens=16)
    for req_id, _, _, computed, _ in STEP:  # update_requests: num_computed_tokens from the scheduler's cached requests
        req_states.num_computed_tokens_np[req_states.req_id_to_index[req_id]] = computed
    np.minimum(req_states.num_computed_tokens_np, req_states.prefill_len.np, out=req_states.num_computed_prefill_tokens)


def _scheduler_output() -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    scheduled = {req_id: rows for req_id, _, _, _, rows in STEP}
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(), free_encoder_mm_hashes=[],
    )


@contextlib.contextmanager
def _no_kernels() -> Iterator[None]:
    """Stand-ins for the Triton kernels ``prepare_inputs`` launches; they write device buffers only (token ids,
    positions, logits indices), which moetrace never reads. Test-harness only; removed afterwards."""
    from vllm.v1.worker.gpu import model_runner

    def logits_indices(input_ids: Any, idx_mapping: Any, last_sampled: Any, query_start_loc: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return query_start_loc[1:] - 1  # the last row of each request, as the kernel gives without drafts

    stand_ins = {"prepare_prefill_inputs": lambda *a, **k: None, "prepare_pos_seq_lens": lambda *a, **k: None, "combine_sampled_and_draft_tokens": logits_indices}
    saved = {name: getattr(model_runner, name) for name in stand_ins}
    for name, value in stand_ins.items():
        setattr(model_runner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model_runner, name, value)


def _runner() -> Any:
    """A ``GPUModelRunner`` (V2) holding what ``gather_batch_req_state`` and ``prepare_inputs`` use, and a stand-in model."""
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = GPUModelRunner.__new__(GPUModelRunner)
    req_states = _request_state()
    _fill(req_states)
    vars(runner).update(
        device=CPU, max_num_reqs=MAX_REQS, req_states=req_states, input_buffers=InputBuffers(MAX_REQS, MAX_TOKENS, CPU),
        decode_query_len=1, use_pp=False, adaptive_verification=None, pcp_manager=None, fast_prefill=None,
        model_state=SimpleNamespace(num_new_sampled_tokens_per_step=1), model_config=SimpleNamespace(rswa_window=None),
        execute_model_state=None,
    )
    return runner


def _prepare(runner: Any, scheduler_output: Any, padded_tokens: int = 0) -> Any:
    """The step's ``InputBatch`` from the runner's own ``gather_batch_req_state`` and ``prepare_inputs`` (eager, no CUDA graph)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    batch_req_state, _ = runner.gather_batch_req_state(scheduler_output, False)
    batch_desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=max(padded_tokens, batch_req_state.num_tokens), num_reqs=None)
    return runner.prepare_inputs(scheduler_output, batch_req_state, batch_desc, 0)


def _execute_model(runner: Any, model: Any) -> Any:
    """The order of ``GPUModelRunner.execute_model``: batch state, ``prepare_inputs``, the forward, then ``execute_model_state``."""

    def execute_model(scheduler_output: Any) -> None:
        input_batch = _prepare(runner, scheduler_output)
        model(input_ids=input_batch.input_ids, positions=input_batch.positions)
        runner.execute_model_state = SimpleNamespace(input_batch=input_batch)

    return execute_model


def test_rows_of_the_v2_runner_step_are_the_batch_it_holds() -> None:
    runner = _runner()
    hooks = HookRegistry()
    batches = StepBatches(hooks)
    seen: list[Any] = []
    runner.execute_model = _execute_model(runner, lambda **kwargs: seen.append(batches.batch_of((), kwargs)))
    batches.attach(runner)
    assert "prepare_inputs" in vars(runner)  # the V2 runner is recognised: its prepare_inputs is followed
    with _no_kernels():
        runner.execute_model(_scheduler_output())
    held = runner.execute_model_state.input_batch
    batch = seen[0]
    assert batch is not None
    n = held.num_reqs
    assert batch.request_ids == tuple(held.req_ids) and sorted(held.req_ids) == sorted(r for r, *_ in STEP)
    assert held.req_ids[0] == "a-00000000"  # V2 sorts decodes first: not the scheduler's order
    request, position = batch.row_requests()
    rows = np.diff(held.query_start_loc_np[: n + 1])
    np.testing.assert_array_equal(request, np.repeat(np.arange(n), rows))
    np.testing.assert_array_equal(position, np.concatenate([np.arange(c, c + r) for c, r in zip(held.num_computed_tokens_np, rows, strict=True)]))
    np.testing.assert_array_equal(batch.prefill, held.is_prefilling_np)  # the runner's own prefill flags
    assert dict(zip(held.req_ids, batch.prefill.tolist(), strict=True)) == {"a-00000000": False, "b-11111111": True, "c-22222222": True, "d-33333333": True, "e-44444444": True, "f-55555555": True}
    assert batch.phase == "mixed"
    assert hooks.remove_all() == [] and "prepare_inputs" not in vars(runner)


def test_reading_the_held_batch_syncs_nothing() -> None:
    runner = _runner()
    with _no_kernels():
        held = _prepare(runner, _scheduler_output(), padded_tokens=128)  # padded as for a CUDA graph: rows past 98 are no request's
    with assert_no_host_sync():
        batch = vllm_v2_pass_batch(held, runner.req_states, num_rows=held.num_tokens_after_padding)
    assert batch.num_tokens == 98 and batch.num_rows == 128
    request, _ = batch.row_requests()
    assert (request[98:] == -1).all()


def test_a_dummy_step_has_no_requests() -> None:
    runner = _runner()
    batches = StepBatches(HookRegistry())
    seen: list[Any] = []

    def dummy_step(scheduler_output: Any) -> None:  # execute_model(dummy_run=True): InputBatch.make_dummy, no prepare_inputs
        seen.append(batches.batch_of((), {"input_ids": torch.zeros(4)}))

    runner.execute_model = dummy_step
    batches.attach(runner)
    runner.execute_model(_scheduler_output())
    assert seen == [None]
