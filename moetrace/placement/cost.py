"""What a rebalance moves, and whether the balance it gains pays for the move.

A rebalance copies expert weights to the GPUs that gain replicas, and while
they move the engine stalls or runs degraded (vLLM's EPLB users report
rearrangement stalls that erase its gains). What it buys is a better-balanced
next interval. The model here:

- an MoE pass at balancedness ``b`` takes ``tau / b`` (``tau`` = the time at
  perfect balance: the heaviest GPU sets the pace);
- keeping the deployed plan realises ``b_keep`` on the next ``S`` passes, the
  new plan ``b_new``; with ``T`` the MoE time per pass under the kept plan, the
  rebalance saves ``S · T · (1 - b_keep / b_new)``;
- the move stalls for ``peak_bytes / bandwidth``: GPUs receive in parallel, so
  the GPU receiving the most replicas (``moved_peak`` × bytes per expert) sets it.

Rebalancing every ``S`` passes pays when ``T`` exceeds the break-even
``stall / (S · mean(1 - b_keep / b_new))``: :func:`rebalance_value`,
:func:`recommendation`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .backtesting import BacktestResult

__all__ = ["RebalanceValue", "rebalance_value", "recommendation"]


@dataclasses.dataclass(frozen=True)
class RebalanceValue:
    """Cost and benefit of one planner's rebalances in a backtest (rebalances after the first deployment).

    Attributes:
        planner: the planner measured.
        every: passes each plan is deployed for (``S``).
        rebalances: rebalances measured (those with a previous deployment).
        gain: mean ``b_new - b_keep``: balancedness gained on the next window over keeping the plan.
        saved_share: mean ``1 - b_keep / b_new``: share of the MoE time per pass saved.
        moved: mean replicas moved per rebalance (all GPUs).
        moved_peak: mean replicas the busiest GPU receives per rebalance.
        bytes_moved: ``moved`` × ``expert_bytes`` (None without bytes per expert).
        stall_s: ``moved_peak`` × ``expert_bytes`` / ``link_bytes_per_s``.
        break_even_pass_s: MoE time per pass above which rebalancing every
            ``S`` passes pays (None when it never does: no time is saved).
    """

    planner: str
    every: int
    rebalances: int
    gain: float
    saved_share: float
    moved: float
    moved_peak: float
    bytes_moved: float | None
    stall_s: float | None
    break_even_pass_s: float | None

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def rebalance_value(result: BacktestResult, planner: str, expert_bytes: int | None, link_bytes_per_s: float) -> RebalanceValue | None:
    """:class:`RebalanceValue` of ``planner`` in ``result`` over its rebalances after the first; None when there are none.

    The first rebalance replaces whatever the trace was recorded with (often a
    naive contiguous placement), so it is left out: the figures are what each
    later rebalance costs and gains in steady state.

    Raises:
        ValueError: ``planner`` not in the backtest, or a non-positive bandwidth or bytes per expert.
    """
    if planner not in result.kept:
        raise ValueError(f"planner {planner!r} is not in the backtest; pass one of {', '.join(result.kept)}")
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s must be positive, got {link_bytes_per_s!r}")
    if expert_bytes is not None and expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be positive, got {expert_bytes!r}")
    kept = result.kept[planner]
    measured = np.isfinite(kept) & (np.arange(len(kept)) >= 1)
    if not measured.any():
        return None
    new = result.realized[planner][measured]
    old = kept[measured]
    saved = float(np.mean(1 - old / new))
    peak = float(result.moved_peak[planner][measured].mean())
    stall = None if expert_bytes is None else peak * expert_bytes / link_bytes_per_s
    break_even = None if stall is None or saved <= 0 else stall / (result.every * saved)
    moved = float(result.moved[planner][measured].mean())
    return RebalanceValue(
        planner=planner,
        every=result.every,
        rebalances=int(measured.sum()),
        gain=float(np.mean(new - old)),
        saved_share=saved,
        moved=moved,
        moved_peak=peak,
        bytes_moved=None if expert_bytes is None else moved * expert_bytes,
        stall_s=stall,
        break_even_pass_s=break_even,
    )


def recommendation(value: RebalanceValue, pass_s: float | None) -> str:
    """One sentence: does rebalancing every ``value.every`` passes pay, for an MoE time per pass of ``pass_s`` seconds?"""
    if value.saved_share <= 0:
        return (f"rebalancing every {value.every} passes does not pay at any pass time: the new plans realised no better than keeping "
                f"the deployed one on the next window ({value.gain:+.4f} balancedness)")
    if value.break_even_pass_s is None:
        return (f"rebalancing every {value.every} passes saves {value.saved_share:.1%} of MoE time per pass and moves {value.moved:.0f} replicas; "
                "give the bytes per expert to weigh the stall")
    verdict = f"pays when the MoE time per pass exceeds {1e3 * value.break_even_pass_s:.3g} ms"
    if pass_s is not None:
        saved = value.every * pass_s * value.saved_share
        verb = "pays" if saved > value.stall_s else "does not pay"
        return (f"rebalancing every {value.every} passes {verb} at {1e3 * pass_s:.3g} ms per pass: saves {saved:.3g} s per interval "
                f"against a {value.stall_s:.3g} s stall ({verdict})")
    return f"rebalancing every {value.every} passes {verdict} (saves {value.saved_share:.1%} of it, stalls {value.stall_s:.3g} s per rebalance)"
