"""What every placement planner refuses, and the sizes it plans for.

:class:`PlacementError` names the parameter in backticks; the CLI spells it as its flag.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["COMMAND_WORK", "EVALUATION_WORK", "PLAN_WORK", "PlacementConfig", "PlacementError", "check_placement_args"]


class PlacementError(ValueError):
    """Placement inputs that cannot work; the message says which and what to pass.

    Parameters are named in backticks (`` `window` ``); the CLI spells them as its flags.
    """


#: Swap evaluations (one candidate swap scored under one scenario) that one command's plans
#: may spend refining their packings: half on the deployed plan and its validation
#: (:data:`PLAN_WORK`), half on the evaluation beside it (:data:`EVALUATION_WORK`: the held-out
#: estimate, ``--holdout`` or ``--backtest``). About 10-20 s of numpy on one core; counted in
#: work, not seconds, so the plans do not depend on the machine's speed or load.
COMMAND_WORK = 1_000_000_000
PLAN_WORK = COMMAND_WORK // 2
EVALUATION_WORK = COMMAND_WORK - PLAN_WORK


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Sizes of a placement: ``N`` slots, ``G`` groups, ``M`` nodes, ``K`` GPUs.

    ``refine_work``: swap evaluations each plan made under this config may
    spend refining its packing (``plan_experts(refine_work=...)``; ``None``:
    no bound); :meth:`sharing` splits a command's budget over its plans.
    """

    replicas: int
    groups: int
    nodes: int
    gpus: int
    refine_work: int | None = None

    def sharing(self, work: int | None, plans: int) -> PlacementConfig:
        """This config with ``work`` split evenly over ``plans`` plans (``None``: unchanged)."""
        if work is None:
            return self
        return dataclasses.replace(self, refine_work=work // max(plans, 1))


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
