"""The reference engine every replica driver runs: one serving loop of the reference MoE model.

:func:`build_loop` builds a :class:`~moetrace.reference.ServingLoop` over a
:class:`~moetrace.reference.ReferenceMoEModel` (one torch thread, no capture),
with a prefix cache of ``cache_blocks`` blocks of ``block_size`` tokens.
:data:`REPLICA_MODEL` and :data:`REPLICA_LOOP` are the settings of the replicas
of :mod:`moetrace.drivers.live` and :mod:`moetrace.drivers.http_replica`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REPLICA_LOOP", "REPLICA_MODEL", "build_loop"]

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
