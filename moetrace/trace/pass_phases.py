"""A trace's totals split by pass phase (prefill, decode, mixed, idle; :mod:`moetrace.pass_phase`).

``/stat/pass_phase_*`` hold each rank row's counts, passes, tokens and requests per pass
phase; the readers below add the counted rank rows (each token once, as
:meth:`~moetrace.trace.reader.Trace.physical_count` does). A trace written before pass
phases reads as every pass ``unknown``.
"""

from __future__ import annotations

import json

import numpy as np

from ..pass_phase import PASS_PHASES, UNKNOWN, pass_phase_code
from .reader import Trace
from .schema import PHASE_COUNTS, Attr, Data, TraceError

__all__ = ["has_pass_phases", "pass_phase_counts", "pass_phase_physical_count", "phase_of"]


def has_pass_phases(trace: Trace) -> bool:
    """Whether the trace records pass phases (``/stat/pass_phase_physical_count``)."""
    if not trace.has(Data.STAT_PASS_PHASE_PHYSICAL_COUNT):
        return False
    names = trace.attrs.get(Attr.PASS_PHASES)
    if names is not None and tuple(json.loads(str(names))) != PASS_PHASES:
        raise TraceError(f"{trace.path}: written with pass phases {json.loads(str(names))}, this moetrace knows {list(PASS_PHASES)}; upgrade moetrace")
    return True


def phase_of(trace: Trace, phase: str | int) -> int:
    """The code of pass phase ``phase`` in ``trace``.

    Raises:
        TraceError: the trace records no pass phases (written before them, or converted) and
            ``phase`` is not ``unknown``.
        ValueError: ``phase`` names no pass phase.
    """
    code = pass_phase_code(phase)
    if code != UNKNOWN and not has_pass_phases(trace):
        raise TraceError(f"{trace.path}: records no pass phases (written by an older moetrace or converted), so none of its passes is known to be "
                         f"{PASS_PHASES[code]!r}; record again with an adapter that names each pass's phase")
    return code


def pass_phase_physical_count(trace: Trace) -> np.ndarray:
    """``[Q, L, P]`` token copies per pass phase and physical expert over the counted rank rows
    (their sum over ``Q`` is :meth:`Trace.physical_count`)."""
    if not has_pass_phases(trace):
        total = trace.physical_count()
        out = np.zeros((len(PASS_PHASES), *total.shape), dtype=np.int64)
        out[UNKNOWN] = total
        return out
    trace.check_invariants()
    counts = trace._read(Data.STAT_PASS_PHASE_PHYSICAL_COUNT)
    return counts[trace.counted().assignments].sum(axis=0)


def pass_phase_counts(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(passes [Q], tokens [Q], requests [Q])`` of each pass phase over the counted rank rows
    (requests: the sum of each pass's request count, where the engine gave one)."""
    if not has_pass_phases(trace):
        out = [np.zeros(len(PASS_PHASES), np.int64) for _ in PHASE_COUNTS]
        out[0][UNKNOWN] = int(trace.num_passes()[trace.counted().tokens].max(initial=0))
        out[1][UNKNOWN] = trace.tokens_served()
        return out[0], out[1], out[2]
    trace.check_invariants()
    rows = trace.counted().tokens
    passes, tokens, requests = (trace._read(name)[rows] for name in PHASE_COUNTS)
    return passes.max(axis=0, initial=0), tokens.sum(axis=0), requests.sum(axis=0)
