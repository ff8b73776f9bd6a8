"""The reference engine every replica driver runs: one serving loop of the reference MoE model.

:func:`build_loop` builds a :class:`~moetrace.reference.ServingLoop` over a
:class:`~moetrace.reference.ReferenceMoEModel` (one torch thread, no capture),
with a prefix cache of ``cache_blocks`` blocks of ``block_size`` tokens.
:data:`REPLICA_MODEL` and :data:`REPLICA_LOOP` are the settings of the replicas
of :mod:`moetrace.drivers.live` and :mod:`moetrace.drivers.http_replica`, and
:func:`serve` is the loop both run: only how requests arrive and where the step
events go differ (a pipe and an event queue; HTTP handler threads).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["REPLICA_LOOP", "REPLICA_MODEL", "StepEvents", "build_loop", "serve"]

#: Model of the reference replicas (``ModelConfig`` fields).
REPLICA_MODEL: dict[str, Any] = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4, "num_experts": 8, "top_k": 2, "seed": 7}
#: Serving-loop settings of the reference replicas.
REPLICA_LOOP: dict[str, Any] = {"max_running": 8, "max_tokens_per_pass": 256, "num_kv_slots": 4096, "max_len": 512}


def build_loop(model_cfg: dict[str, Any], loop_cfg: dict[str, Any], cache_blocks: int | None, block_size: int) -> Any:
    """A reference serving loop (``ServingLoop``) with ``model_cfg`` (``ModelConfig`` fields) and ``loop_cfg`` settings."""
    import torch

    from ..reference import ModelConfig, ReferenceMoEModel, ServingLoop

    torch.set_num_threads(1)
    model = ReferenceMoEModel(ModelConfig(**model_cfg))
    return ServingLoop(model, capture=False, prefix_cache_blocks=cache_blocks, block_size=block_size, **loop_cfg)


class StepEvents(Protocol):
    """Where :func:`serve` reports each step (times are ``time.monotonic()``)."""

    def started(self, rid: str, t: float) -> None:
        """``rid`` was admitted (its prefill begins) at ``t``, taken before the step."""

    def kv(self, kind: str, hashes: list[int]) -> None:
        """Prefix-cache blocks ``stored`` or ``evicted`` by the step."""

    def first_token(self, rid: str, t: float) -> None:
        """``rid`` has its first token at ``t``, taken after the step."""

    def finished(self, result: Any, t: float) -> None:
        """``result`` (a ``ServingLoop`` result: ``rid``, ``output_ids``, ``cached_tokens``) finished at ``t``."""


def serve(loop: Any, take: Callable[[bool], bool], events: StepEvents) -> None:
    """Step ``loop`` (a ``ServingLoop``) until ``take`` says stop; report every step to ``events``.

    ``take(idle)`` submits what has arrived to ``loop`` (first waiting for something when
    ``idle``: nothing is pending) and returns ``False`` to stop.
    """
    while take(not loop.pending):
        t0 = time.monotonic()
        progress = loop.step()
        t1 = time.monotonic()
        if progress is None:
            continue
        for rid in progress.admitted:
            events.started(rid, t0)
        for kind, hashes in loop.take_kv_events():
            events.kv(kind, hashes)
        for rid in progress.first_tokens:
            events.first_token(rid, t1)
        for result in progress.new_results:
            events.finished(result, t1)
