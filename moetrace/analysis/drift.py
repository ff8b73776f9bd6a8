"""Drift over time: routing distributions of successive windows of passes.

A window is ``N`` consecutive distinct passes. For each window we keep its
token count, its balancedness over EP ranks and the Jensen-Shannon divergence
(``balance.js_divergence``) of its per-layer logical distribution from the
previous window's. Only per-window summaries are kept, so memory does not grow
with the window size or the trace length beyond one float row per window.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import balance
from ..ids import to_logical
from .source import PassBlock

__all__ = ["DriftSeries", "WindowAccumulator"]


@dataclasses.dataclass(frozen=True)
class DriftSeries:
    """Per-window summaries ``[W]`` (W windows, the last one may be partial).

    Attributes:
        passes_per_window: ``N``.
        first_pass, last_pass: pass ids bounding each window.
        passes: distinct passes in each window.
        tokens: tokens in each window.
        balancedness: balancedness over EP ranks of each window's counts.
        js_mean: mean over layers of the JS divergence from the previous
            window (``nan`` for the first).
        js_max: largest layer JS divergence from the previous window (``nan`` first).
        js_max_layer: model layer id where ``js_max`` occurs (-1 for the first).
    """

    passes_per_window: int
    first_pass: np.ndarray
    last_pass: np.ndarray
    passes: np.ndarray
    tokens: np.ndarray
    balancedness: np.ndarray
    js_mean: np.ndarray
    js_max: np.ndarray
    js_max_layer: np.ndarray

    def __len__(self) -> int:
        return len(self.passes)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: summary plus one entry per window."""
        js = self.js_mean[1:]
        windows = [
            {
                "index": i,
                "first_pass": int(self.first_pass[i]),
                "last_pass": int(self.last_pass[i]),
                "passes": int(self.passes[i]),
                "tokens": int(self.tokens[i]),
                "balancedness": float(self.balancedness[i]),
                "js_from_previous": None if i == 0 else float(self.js_mean[i]),
                "js_max_layer": None if i == 0 else {"layer": int(self.js_max_layer[i]), "js": float(self.js_max[i])},
            }
            for i in range(len(self))
        ]
        return {
            "passes_per_window": self.passes_per_window,
            "num_windows": len(self),
            "mean_js": float(js.mean()) if len(js) else None,
            "max_js": float(js.max()) if len(js) else None,
            "balancedness_min": float(self.balancedness.min()) if len(self) else None,
            "balancedness_mean": float(self.balancedness.mean()) if len(self) else None,
            "balancedness_max": float(self.balancedness.max()) if len(self) else None,
            "windows": windows,
        }


class WindowAccumulator:
    """Fold :class:`PassBlock` s into windows of ``passes_per_window`` passes.

    Args:
        passes_per_window: ``N`` >= 1.
        physical_to_logical: ``[L, P]`` map of the selected layers.
        ep_size: EP ranks ``R`` (``P % R == 0``).
        layer_ids: model layer ids ``[L]`` of the selected layers (for reporting).
    """

    def __init__(self, passes_per_window: int, physical_to_logical: np.ndarray, ep_size: int, layer_ids: np.ndarray) -> None:
        if passes_per_window < 1:
            raise ValueError(f"window must be at least 1 pass, got {passes_per_window}")
        self._n = int(passes_per_window)
        self._map = np.asarray(physical_to_logical)
        self._ep = ep_size
        self._layer_ids = np.asarray(layer_ids)
        self._sum = np.zeros(self._map.shape, dtype=np.int64)
        self.total = np.zeros(self._map.shape, dtype=np.int64)  # [L, P] over all rows seen
        self._window = -1
        self._passes = 0
        self._tokens = 0
        self._first = self._last = -1
        self._last_pass_id: int | None = None
        self._pass_index = -1
        self._previous: np.ndarray | None = None
        self._rows: list[tuple[int, int, int, int, float, float, float, int]] = []

    def add(self, block: PassBlock) -> None:
        """Add consecutive rows (pass ids non-decreasing)."""
        n = len(block.pass_id)
        if n == 0:
            return
        pid = block.pass_id
        previous = np.concatenate([[self._last_pass_id if self._last_pass_id is not None else pid[0] - 1], pid[:-1]])
        pass_index = self._pass_index + np.cumsum(pid != previous)
        window = pass_index // self._n
        new_pass = pid != previous
        starts = np.flatnonzero(np.concatenate([[True], window[1:] != window[:-1]]))
        ends = np.append(starts[1:], n)
        for s, e in zip(starts, ends, strict=True):
            if window[s] != self._window:
                self._close()
                self._window = int(window[s])
                self._first = int(pid[s])
            self._sum += block.physical_count[s:e].sum(axis=0, dtype=np.int64)
            self._passes += int(new_pass[s:e].sum())
            self._tokens += int(block.num_tokens[s:e].sum())
            self._last = int(pid[e - 1])
        self.total += block.physical_count.sum(axis=0, dtype=np.int64)
        self._pass_index = int(pass_index[-1])
        self._last_pass_id = int(pid[-1])

    def add_window(self, first_pass: int, last_pass: int, passes: int, tokens: int, physical_count: np.ndarray) -> None:
        """Add one whole window's totals (``physical_count [L, P]``), e.g. reduced from partial accumulators.

        Gives the same summary row as :meth:`add` of the window's rows. Windows
        come in order, each once; do not mix with :meth:`add`.
        """
        self._close()
        self._window += 1
        self._first, self._last, self._passes, self._tokens = first_pass, last_pass, passes, tokens
        self._sum += physical_count
        self.total += physical_count

    def _close(self) -> None:
        if self._window < 0:
            return
        logical = to_logical(self._sum, self._map)
        balancedness = balance.balancedness(balance.rank_load(self._sum, self._ep))
        if self._previous is None:
            js_mean, js_max, js_layer = float("nan"), float("nan"), -1
        else:
            js = balance.js_divergence(self._previous, logical)
            js_mean, js_max, js_layer = float(js.mean()), float(js.max()), int(self._layer_ids[int(np.argmax(js))])
        self._rows.append((self._first, self._last, self._passes, self._tokens, balancedness, js_mean, js_max, js_layer))
        self._previous = logical
        self._sum = np.zeros_like(self._sum)
        self._passes = self._tokens = 0

    def finish(self) -> DriftSeries:
        """Close the last (possibly partial) window and return the series."""
        self._close()
        self._window = -1
        cols = list(zip(*self._rows, strict=True)) if self._rows else [()] * 8
        ints = [np.asarray(c, dtype=np.int64) for c in cols[:4]]
        floats = [np.asarray(c, dtype=np.float64) for c in cols[4:7]]
        return DriftSeries(self._n, *ints, *floats, np.asarray(cols[7], dtype=np.int64))
