"""EP projection: what expert parallelism over ``R`` ranks would make of a trace's load.

From the logical expert load ``w [L, E]`` of any trace (one rank is enough), each
divisor ``R > 1`` of ``E`` gets the rank-level balancedness
(:func:`moetrace.balance.balancedness`) of three placements:

- **contiguous**: rank ``r`` holds experts ``[r·E/R, (r+1)·E/R)``, the default of
  SGLang, vLLM and the reference runtime (:func:`moetrace.balance.rank_load`);
- **planned**: moetrace's planner (:func:`~moetrace.placement.plan.plan_experts`,
  global, one node) with ``E`` slots, i.e. no replica;
- **planned + redundant**: the same with ``redundant_per_rank`` extra slots per rank
  (``E + R·redundant_per_rank`` slots) holding replicas of hot experts.

A placement is only worth deploying where it helps, so per layer the planned load is
the planner's unless its hottest rank is hotter than the contiguous one's, and the
redundant plan falls back likewise to the plan without replicas (which it can always
realise by filling the spare slots with in-place duplicates). Hence, per layer and
overall, ``contiguous <= planned <= planned + redundant``. ``layers_kept_contiguous``
counts the layers where the planner's own plan was worse than contiguous (rare: none of
the 18 real OLMoE layers at any ``R``).

Balancedness is ``mean / max`` rank load: an EP step waits for its hottest rank, so it
is also the share of the step's expert time the ranks spend busy (see ``docs/concepts.md``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import balance
from ..placement.plan import plan_experts

__all__ = ["DEFAULT_REDUNDANT_PER_RANK", "ProjectionRow", "ep_projection", "projection_ranks"]

#: Extra physical slots per rank of the "planned + redundant" placement.
DEFAULT_REDUNDANT_PER_RANK = 1


@dataclasses.dataclass(frozen=True)
class ProjectionRow:
    """Projected rank balance for one EP size.

    Attributes:
        ranks: EP ranks ``R`` (a divisor of ``E``).
        experts_per_rank: ``E / R``.
        contiguous_balancedness: overall balancedness of the contiguous placement.
        planned_balancedness: the planned placement without replicas.
        redundant_slots: extra slots in total (``R · redundant_per_rank``).
        planned_redundant_balancedness: the planned placement with those slots.
        layers_kept_contiguous: layers where the planner's plan had a hotter rank than contiguous.
        contiguous_layer_balancedness, planned_layer_balancedness,
        planned_redundant_layer_balancedness: the same per MoE layer ``[L]``.
    """

    ranks: int
    experts_per_rank: int
    contiguous_balancedness: float
    planned_balancedness: float
    redundant_slots: int
    planned_redundant_balancedness: float
    layers_kept_contiguous: int
    contiguous_layer_balancedness: np.ndarray
    planned_layer_balancedness: np.ndarray
    planned_redundant_layer_balancedness: np.ndarray

    def to_dict(self) -> dict[str, object]:
        """JSON-ready row (``docs/analysis.md``, key ``ep_projection``)."""
        out: dict[str, object] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = [float(x) for x in value] if isinstance(value, np.ndarray) else value
        return out


def projection_ranks(num_experts: int) -> list[int]:
    """The EP sizes projected: every divisor ``R > 1`` of ``num_experts``, ascending."""
    return [r for r in range(2, num_experts + 1) if num_experts % r == 0]


def _lower_peak(candidate: np.ndarray, fallback: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, ``candidate`` unless its hottest rank is above ``fallback``'s (``[L, R]`` loads).

    Returns the chosen loads ``[L, R]`` and which layers fell back ``[L]`` (bool).
    """
    worse = candidate.max(axis=1) > fallback.max(axis=1)
    return np.where(worse[:, None], fallback, candidate), worse


def ep_projection(
    logical_count: np.ndarray, redundant_per_rank: int = DEFAULT_REDUNDANT_PER_RANK
) -> list[ProjectionRow]:
    """Project rank balance for every EP size ``R`` dividing ``E``.

    Args:
        logical_count: ``[L, E]`` token copies per logical expert (the loads).
        redundant_per_rank: extra slots per rank of the redundant plan (>= 1).

    Returns:
        One :class:`ProjectionRow` per ``R`` in :func:`projection_ranks` (empty when ``E < 2``).

    Raises:
        ValueError: ``logical_count`` is not a non-empty ``[L, E]`` matrix, or
            ``redundant_per_rank < 1``.
    """
    load = np.asarray(logical_count, dtype=np.float64)
    if load.ndim != 2 or load.size == 0:
        raise ValueError(f"logical_count must be a non-empty [layers, experts] matrix, got shape {list(load.shape)}")
    if redundant_per_rank < 1:
        raise ValueError(f"redundant_per_rank must be at least 1, got {redundant_per_rank}")
    num_experts = load.shape[1]
    rows = []
    for ranks in projection_ranks(num_experts):
        contiguous = balance.rank_load(load, ranks)
        planner = plan_experts(load, num_experts, 1, 1, ranks).gpu_load
        planned, kept = _lower_peak(planner, contiguous)
        extra = ranks * redundant_per_rank
        replicated = plan_experts(load, num_experts + extra, 1, 1, ranks).gpu_load
        redundant, _ = _lower_peak(replicated, planned)
        rows.append(
            ProjectionRow(
                ranks=ranks,
                experts_per_rank=num_experts // ranks,
                contiguous_balancedness=balance.balancedness(contiguous),
                planned_balancedness=balance.balancedness(planned),
                redundant_slots=extra,
                planned_redundant_balancedness=balance.balancedness(redundant),
                layers_kept_contiguous=int(kept.sum()),
                contiguous_layer_balancedness=balance.layer_balancedness(contiguous),
                planned_layer_balancedness=balance.layer_balancedness(planned),
                planned_redundant_layer_balancedness=balance.layer_balancedness(redundant),
            )
        )
    return rows
