"""Time-ordered expert loads in buckets of passes: what the planners plan on and the backtests replay.

Read from a trace by :func:`moetrace.analysis.source.load_series` (or the
distributed reader); built directly in tests and benchmarks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["PassSeries"]


@dataclasses.dataclass(frozen=True)
class PassSeries:
    """Time-ordered loads, ``n`` buckets of ``bucket`` consecutive passes (the last may hold fewer).

    Attributes:
        bucket: passes per bucket.
        passes: ``[n]`` distinct passes in each bucket.
        first_pass: ``[n]`` pass id opening each bucket.
        logical: ``[n, L, E]`` token copies per logical expert.
        physical: ``[n, L, P]`` token copies per physical slot (the deployed placement).
        physical_to_logical: ``[L, P]`` the trace's map.
    """

    bucket: int
    passes: np.ndarray
    first_pass: np.ndarray
    logical: np.ndarray
    physical: np.ndarray
    physical_to_logical: np.ndarray

    def __len__(self) -> int:
        return len(self.passes)
