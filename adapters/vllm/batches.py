"""vLLM's step batch as the recorder reads it: each request's rows of the pass, from host fields only.

vLLM's v1 model runner (``GPUModelRunner``, and ``CPUModelRunner`` derived from it) runs
one model forward per ``execute_model(scheduler_output)``. :class:`StepBatches` wraps that
method on the runner instance (a matched patch in the instrumentation's
:class:`~moetrace.adapters.base.HookRegistry`: removed by ``uninstrument()``, left alone
and reported if someone replaced it since) to keep the step's ``SchedulerOutput`` while
the step runs. When the model's ``forward`` starts (inside the step: the runner has
updated its persistent batch and prepared the inputs by then), :meth:`StepBatches.batch_of`
describes the pass from what the runner holds on the host:

- ``input_batch.req_ids``: the requests in row order (vLLM packs each request's
  scheduled tokens consecutively in this order);
- ``scheduler_output.num_scheduled_tokens[req_id]``: rows of each request in the pass;
- ``input_batch.num_computed_tokens_cpu``: position of each request's first row (tokens
  already computed: a prefix-cache hit or an earlier prefill chunk are not rows);
- ``input_batch.num_prompt_tokens``: a request whose first row is a prompt position is
  a prefill row, and so is a request recomputing several positions after preemption
  (more rows than its draft tokens plus one); the others are decode rows.

The request ids are vLLM's engine-core request ids: ``RequestOutput.request_id`` plus
the ``-`` and 8 random characters vLLM appends to make it unique
(``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``: the id as given). Forwards outside a step
(warm-up and profiling dummy runs) get no batch: their rows are recorded without
requests. Nothing is read from the device and nothing runs per token in Python: the
arrays are ``[num_reqs]`` numpy views the runner keeps on the host.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from moetrace.batch import PassBatch

from ..base import HookRegistry

__all__ = ["StepBatches", "vllm_pass_batch"]

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
    prefill = (start < prompt) | (count > drafts + 1)
    return PassBatch.of(req_ids, start, count, prefill=prefill, num_rows=num_rows)


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
    ``execute_model`` (the in-process ``instrument(llm)`` attaches at once, the plugin
    once the worker has warmed up).
    """

    def __init__(self, hooks: HookRegistry) -> None:
        self._hooks = hooks
        self._runner: Any = None
        self._step: Any = None  # the SchedulerOutput of the step being executed
        self._warned = False

    @property
    def attached(self) -> bool:
        """Whether a model runner's steps are being followed."""
        return self._runner is not None

    def attach(self, runner: Any) -> None:
        """Wrap ``runner.execute_model`` (once; a second runner is refused)."""
        if self._runner is runner:
            return
        if self._runner is not None:
            raise RuntimeError("moetrace follows one vLLM model runner per instrumentation; this one follows another already")
        original = runner.execute_model
        self._hooks.patch(runner, "execute_model", self._wrap(original))
        self._runner = runner
        self._hooks.on_remove("vLLM step batches", self._detach)

    def _detach(self) -> None:
        self._runner, self._step = None, None

    def _wrap(self, execute_model: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(execute_model)
        def execute_model_in_step(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._step = scheduler_output
            try:
                return execute_model(scheduler_output, *args, **kwargs)
            finally:
                self._step = None

        return execute_model_in_step

    def batch_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PassBatch | None:
        """The batch of the model forward called with ``args``/``kwargs`` (``None`` outside a step)."""
        step, runner = self._step, self._runner
        if step is None or runner is None:
            return None
        rows = _rows(args, kwargs)
        try:
            if rows is None:
                raise ValueError("the model forward got no input_ids, positions or inputs_embeds to count its rows")
            return vllm_pass_batch(runner.input_batch, step, rows)
        except Exception as exc:  # never vLLM's problem: the pass's rows are recorded without requests
            if not self._warned:
                logger.warning("moetrace: the step's requests could not be read from vLLM's model runner (%s); rows are recorded without requests", exc)
                self._warned = True
            return None
