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

__all__ = ["PASS_PHASES", "UNKNOWN", "pass_phase_code", "phase_counts"]

#: Names in code order; a trace's ``pass_phases`` attribute stores this list.
PASS_PHASES: tuple[str, ...] = ("unknown", "prefill", "decode", "mixed", "idle")
#: Code of ``unknown`` (a pass whose phase nobody set).
UNKNOWN = 0


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
