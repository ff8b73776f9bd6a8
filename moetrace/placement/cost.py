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
:func:`recommendation` over a backtest's rebalances; :func:`replan_advice` for
one replan away from a deployed plan (``moetrace placement --current``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .backtesting import BacktestResult

__all__ = ["RebalanceValue", "ReplanAdvice", "break_even_pass_s", "rebalance_value", "recommendation", "replan_advice", "stall_seconds"]


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


def stall_seconds(moved_peak: float, expert_bytes: int, link_bytes_per_s: float) -> float:
    """Seconds the move stalls: the GPU receiving the most replicas (``moved_peak``) sets it, GPUs receive in parallel."""
    return moved_peak * expert_bytes / link_bytes_per_s


def break_even_pass_s(stall_s: float, every: int, saved_share: float) -> float | None:
    """MoE time per pass above which saving ``saved_share`` of it over ``every`` passes repays ``stall_s``; None when nothing is saved."""
    return None if saved_share <= 0 else stall_s / (every * saved_share)


def _check_rates(expert_bytes: int | None, link_bytes_per_s: float) -> None:
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s must be positive, got {link_bytes_per_s!r}")
    if expert_bytes is not None and expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be positive, got {expert_bytes!r}")


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
    _check_rates(expert_bytes, link_bytes_per_s)
    kept = result.kept[planner]
    measured = np.isfinite(kept) & (np.arange(len(kept)) >= 1)
    if not measured.any():
        return None
    new = result.realized[planner][measured]
    old = kept[measured]
    saved = float(np.mean(1 - old / new))
    peak = float(result.moved_peak[planner][measured].mean())
    stall = None if expert_bytes is None else stall_seconds(peak, expert_bytes, link_bytes_per_s)
    break_even = None if stall is None else break_even_pass_s(stall, result.every, saved)
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



@dataclasses.dataclass(frozen=True)
class ReplanAdvice:
    """Whether one replan away from the deployed plan pays: its weight copies' stall against the MoE time it saves.

    Attributes:
        recommended: True when the saving exceeds the stall (or nothing moves),
            False when it does not (or the new plan gains nothing), None when
            it cannot be weighed (no bytes per expert, or no MoE time per pass).
        balance_source: where ``b_keep``/``b_new`` come from ("held-out estimate" or "in-sample").
        b_keep, b_new: mean balancedness of the deployed and the new plan on the same passes.
        saved_share: mean ``1 - b_keep / b_new`` (per scored window).
        every: passes the new plan is weighed over (``S``).
        moved, moved_peak: replicas copied in all, and into the busiest GPU.
        stall_s: ``moved_peak`` × bytes per expert / link bandwidth (None without bytes).
        pass_s: MoE time per pass under the deployed plan (None when not known).
        gain_s: ``every`` × ``pass_s`` × ``saved_share`` (None without ``pass_s``).
        break_even_pass_s: MoE time per pass above which the replan pays (None when it never does or without bytes).
        reason: one sentence with the figures.
    """

    recommended: bool | None
    balance_source: str
    b_keep: float
    b_new: float
    saved_share: float
    every: int
    moved: int
    moved_peak: int
    stall_s: float | None
    pass_s: float | None
    gain_s: float | None
    break_even_pass_s: float | None
    reason: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def replan_advice(b_keep: np.ndarray, b_new: np.ndarray, every: int, moved: int, moved_peak: int, expert_bytes: int | None,
                  link_bytes_per_s: float, pass_s: float | None, balance_source: str) -> ReplanAdvice:
    """Weigh one replan: ``b_keep [W]``, ``b_new [W]`` are the deployed and the new plan's balancedness on the same ``W`` scored windows.

    The saving over the next ``every`` passes is ``every · pass_s · mean(1 - b_keep / b_new)``;
    the stall :func:`stall_seconds`. A replan that copies nothing is recommended; one
    that saves nothing is not, at any pass time.

    Raises:
        ValueError: a non-positive bandwidth or bytes per expert, or empty or mismatched balancedness.
    """
    _check_rates(expert_bytes, link_bytes_per_s)
    keep, new = np.asarray(b_keep, dtype=np.float64), np.asarray(b_new, dtype=np.float64)
    if keep.shape != new.shape or keep.size == 0:
        raise ValueError(f"b_keep and b_new must be the same non-empty shape, got {keep.shape} and {new.shape}")
    saved = float(np.mean(1 - keep / new))
    stall = None if expert_bytes is None else stall_seconds(moved_peak, expert_bytes, link_bytes_per_s)
    break_even = None if stall is None else break_even_pass_s(stall, every, saved)
    gain = None if pass_s is None else every * pass_s * saved
    figures = f"balancedness {keep.mean():.4f} kept vs {new.mean():.4f} new ({balance_source}), {moved} replicas copied ({moved_peak} into the busiest GPU)"
    if moved == 0:
        recommended, reason = True, f"the replan copies no weights ({figures})"
    elif saved <= 0:
        recommended, reason = False, f"the new plan saves no MoE time over the deployed one at any pass time ({figures})"
    elif stall is None:
        recommended, reason = None, f"cannot weigh the copies: give --intermediate-size for the bytes per expert ({figures})"
    elif gain is None:
        recommended, reason = None, (f"cannot weigh the copies: the MoE time per pass is unknown (give --pass-ms); the replan pays when it exceeds "
                                     f"{1e3 * break_even:.3g} ms ({figures}, a {stall:.3g} s stall)")
    else:
        recommended = gain > stall
        verdict = "pays" if recommended else "does not pay"
        reason = (f"the replan {verdict}: saves {gain:.3g} s over the next {every} passes at {1e3 * pass_s:.3g} ms per pass against a "
                  f"{stall:.3g} s stall (pays above {1e3 * break_even:.3g} ms per pass; {figures})")
    return ReplanAdvice(recommended, balance_source, float(keep.mean()), float(new.mean()), saved, every, moved, moved_peak,
                        stall, pass_s, gain, break_even, reason)
