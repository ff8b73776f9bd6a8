"""Rank-side fault checks (run by tests/megatron/test_failsafe.py): a hook that raises inside Megatron's forward."""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import harness
from .ranks import _ids, _step

__all__ = ["FAULTS", "hook_faults"]

FAULTS: dict[str, tuple[str, bool]] = {
    "router tap": ("on_select_experts", False),
    "dispatch tap": ("on_dispatch", False),
    "forward pass": ("with_forward_pass", False),
    "phase timing": ("with_phase", True),
}
"""fault -> (the recorder method made to raise, instrumented with timing)."""


class Injected(RuntimeError):
    """The fault a check injects."""


def _raise(*args: Any, **kwargs: Any) -> None:
    raise Injected("injected fault")


def _reraise(self: Any, exc: BaseException, where: str) -> None:
    raise exc


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _faulted_step(model: Any, ids: torch.Tensor, method: str, timing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """One training step of ``model`` instrumented while ``ExpertDistributionRecorder.<method>`` raises."""
    from moetrace.adapters import megatron as mt

    from moetrace.recorder import ExpertDistributionRecorder

    original = ExpertDistributionRecorder.__dict__[method]
    setattr(ExpertDistributionRecorder, method, _raise)  # before instrument(): the taps bind the recorder's methods
    handle = mt.instrument(model, timing=timing)
    try:
        handle.recorder.start_record()
        logits, grads = _step(model, ids)
        return logits, grads, handle
    finally:
        setattr(ExpertDistributionRecorder, method, original)
        handle.recorder.stop_record()
        handle.uninstrument()


def hook_faults(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Per fault: the step's logits and gradients against the uninstrumented step, the warnings, the fail-safe;
    and the negative control: the same fault with the fail-safe's trip raising again stops the forward."""
    from moetrace.adapters.failsafe import FailSafe

    harness.setup_parallel(world)
    model = harness.build(harness.StackSpec())
    ids = _ids(rank)
    base_logits, base_grads = _step(model, ids)
    records = _Records()
    logger = logging.getLogger("moetrace")
    logger.addHandler(records)
    results: dict[str, dict[str, Any]] = {}
    try:
        for name, (method, timing) in FAULTS.items():
            records.messages.clear()
            logits, grads, handle = _faulted_step(model, ids, method, timing)
            identical = torch.equal(logits, base_logits) and grads.keys() == base_grads.keys()
            identical = identical and all(torch.equal(grads[k], base_grads[k]) for k in grads)
            original_trip = FailSafe.trip
            FailSafe.trip = _reraise  # type: ignore[method-assign]
            try:
                _faulted_step(model, ids, method, timing)
                stopped = False
            except Injected:
                stopped = True
            finally:
                FailSafe.trip = original_trip  # type: ignore[method-assign]
            results[name] = {
                "identical": bool(identical), "warnings": list(records.messages), "on": handle.failsafe.on,
                "error": handle.failsafe.error, "stopped_without_failsafe": stopped,
            }
    finally:
        logger.removeHandler(records)
        harness.teardown_parallel()
    return results
