"""What every placement planner refuses, and the sizes it plans for.

:class:`PlacementError` names the parameter in backticks; the CLI spells it as its flag.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["PlacementConfig", "PlacementError", "check_placement_args"]


class PlacementError(ValueError):
    """Placement inputs that cannot work; the message says which and what to pass.

    Parameters are named in backticks (`` `window` ``); the CLI spells them as its flags.
    """


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Sizes of a placement: ``N`` slots, ``G`` groups, ``M`` nodes, ``K`` GPUs."""

    replicas: int
    groups: int
    nodes: int
    gpus: int


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise PlacementError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_placement_args(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """Validate placement inputs; returns ``weight`` as float64 ``[L, E]``.

    Raises:
        PlacementError: naming the inconsistent argument and what would work.
    """
    w = np.asarray(weight)
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise PlacementError(f"weight must be a non-empty [layers, experts] matrix, got shape {list(w.shape)}")
    if not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise PlacementError(f"weight must be numeric, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if not np.isfinite(w).all() or (w < 0).any():
        raise PlacementError("weight must hold finite, non-negative loads")
    num_experts = w.shape[1]
    replicas = _positive("replicas", num_replicas)
    _positive("groups", num_groups)
    nodes = _positive("nodes", num_nodes)
    gpus = _positive("gpus", num_gpus)
    if replicas < num_experts:
        raise PlacementError(f"replicas={replicas} is smaller than the {num_experts} experts; every expert needs a slot (pass `replicas` >= {num_experts})")
    if replicas % gpus:
        raise PlacementError(f"replicas={replicas} is not divisible by gpus={gpus}; every GPU must hold the same number of expert slots")
    if gpus % nodes:
        raise PlacementError(f"gpus={gpus} is not divisible by nodes={nodes}; every node must have the same number of GPUs")
    return w
