"""The phase of a forward pass: what kind of work the engine's batch was.

A *pass phase* is a property of a whole forward pass, set from the host by the
engine's adapter from the batch it holds (SGLang's ``ForwardMode``, vLLM's
scheduler output, the reference serving loop's plan, Hugging Face ``generate``):

=========  ==================================================================
``unknown``  nobody said (a bare loop, an engine without plumbing); code 0
``prefill``  prompt tokens only: prefill or extend (chunked prefill included)
``decode``   one new token per running request
``mixed``    prefill and decode tokens in one pass
``idle``     a pass with no tokens of its own (SGLang's IDLE/DP padding, dummy runs)
=========  ==================================================================

Not to be confused with the *timing phases* of :mod:`moetrace.timing`
(``route``, ``dispatch``, ``expert``, ``combine``: stages inside one MoE layer,
``RecorderConfig(timing=True)``). Traces and metrics spell this one
``pass_phase`` everywhere; the CLI's ``--phase`` takes these names.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IDLE", "PASS_PHASES", "REQUESTS_RULE", "UNKNOWN", "pass_phase_code", "pass_requests", "phase_counts", "requests_allowed"]

#: Names in code order; a trace's ``pass_phases`` attribute stores this list.
PASS_PHASES: tuple[str, ...] = ("unknown", "prefill", "decode", "mixed", "idle")
#: Code of ``unknown`` (a pass whose phase nobody set).
UNKNOWN = 0
#: Code of ``idle`` (a pass without requests).
IDLE = PASS_PHASES.index("idle")
#: The rule a pass's request count keeps (recorder, batch and trace reader): 0 says "idle", -1 says
#: "unknown", never both in one phase, so a stored ``-1`` turned into ``0`` (HDF5's Fletcher-32 cannot
#: tell the two apart) breaks it.
REQUESTS_RULE = "an idle pass has 0 requests; a pass of any other phase -1 (unknown) or at least 1"


def pass_phase_code(phase: str | int) -> int:
    """The code of ``phase`` (a name of :data:`PASS_PHASES` or its code).

    Raises:
        ValueError: an unknown name or an out-of-range code.
    """
    if isinstance(phase, bool):
        raise ValueError(f"pass phase must be a name of {PASS_PHASES} or its code, got {phase!r}")
    if isinstance(phase, int):
        if 0 <= phase < len(PASS_PHASES):
            return phase
        raise ValueError(f"pass phase code {phase} is outside [0, {len(PASS_PHASES)}): {PASS_PHASES}")
    try:
        return PASS_PHASES.index(phase)
    except ValueError:
        raise ValueError(f"unknown pass phase {phase!r}; use one of {PASS_PHASES}") from None


def requests_allowed(phase: np.ndarray | int, requests: np.ndarray | int) -> np.ndarray:
    """``[...]`` bool: whether each pass's ``requests`` fits its phase code ``phase`` (same shape; see :data:`REQUESTS_RULE`).
    A phase code outside :data:`PASS_PHASES` fits nothing."""
    code, count = np.asarray(phase, dtype=np.int64), np.asarray(requests, dtype=np.int64)
    known = (code >= 0) & (code < len(PASS_PHASES))
    return known & np.where(code == IDLE, count == 0, (count == -1) | (count >= 1))


def pass_requests(phase: int, num_requests: int) -> int:
    """The request count to store for a pass of phase code ``phase`` given ``num_requests``: an idle pass
    of unknown count (-1) has 0; any other count must keep :data:`REQUESTS_RULE`.

    Raises:
        ValueError: naming the count, the phase and the fix.
    """
    count = int(num_requests)
    if phase == IDLE and count == -1:
        return 0
    if not requests_allowed(phase, count):
        raise ValueError(f"num_requests={count} for a {PASS_PHASES[phase]!r} pass: {REQUESTS_RULE}. Give -1 when the count is unknown, "
                         "name a pass without requests 'idle', and a pass with requests by the work it ran (prefill, decode, mixed)")
    return count


def phase_counts(phase: np.ndarray, tokens: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """``[3, Q]`` passes, tokens and requests of each pass phase from per-pass ``phase``, ``tokens``
    and ``requests [n]`` (a request count of -1, unknown, adds nothing)."""
    q = len(PASS_PHASES)
    code = np.asarray(phase, dtype=np.int64)
    return np.stack([
        np.bincount(code, minlength=q),
        np.bincount(code, weights=np.asarray(tokens, dtype=np.float64), minlength=q),
        np.bincount(code, weights=np.maximum(np.asarray(requests, dtype=np.float64), 0), minlength=q),
    ]).astype(np.int64)
