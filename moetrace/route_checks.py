"""Row checks on routes an engine hands out: what can be told wrong from the rows alone.

A *row* is one (position, layer) of a request's routes ``[T, L, k]``: the
``k`` expert ids that token went to in that layer, or ``k`` times ``-1``
(no routing: a dense layer, a position not computed). Each check is a
boolean mask ``[T, L]`` of the rows it finds wrong; the checks are disjoint
by definition where two could describe one row, so each fault is named once:

- ``zero_row``: every id is ``0`` (``k >= 2``: a top-k never repeats an
  expert; the sign of a buffer that was never written, e.g. a fused kernel
  bypassing the capture);
- ``missing_layer``: a layer that routes (``routed_layers``) holds ``-1``
  in every slot (the layer's capture was lost);
- ``partial_row``: ``-1`` and ids mixed in one row;
- ``out_of_range``: an id below ``-1`` or ``>= num_experts`` (a physical id
  where a logical one belongs, a wrong model, garbage);
- ``duplicate``: an id repeated within the row (a row that is not all ``0``).

:class:`RowCheckCounts` adds the rows failing each check over the requests a
capturer hands out (:meth:`moetrace.capturer.RoutedExpertsCapturer.get_routed_experts`
validates each request's rows on the host, off the hot path); its
:meth:`~RowCheckCounts.snapshot` is what the exporters publish (one series
per check: bounded labels). The comparison with the recorder's trace (rows
shifted, rows of another request, ids that differ) is :mod:`moetrace.analysis.route_audit`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["ROW_CHECKS", "RowCheckCounts", "row_faults"]

ROW_CHECKS: tuple[str, ...] = ("zero_row", "missing_layer", "partial_row", "out_of_range", "duplicate")
"""The row checks, in report order."""


def row_faults(
    routes: Any,
    *,
    num_experts: int | None = None,
    routed_layers: Sequence[int] | np.ndarray | None = None,
    checks: Iterable[str] = ROW_CHECKS,
) -> dict[str, np.ndarray]:
    """Rows of ``routes [T, L, k]`` failing each check: ``{check: [T, L] bool}``.

    Args:
        routes: integer ids ``[T, L, k]`` (numpy, host).
        num_experts: experts per layer (``None``: ids above are not checked).
        routed_layers: the layers that route every position (MoE layers, as
            indices into ``L``); ``None``: ``missing_layer`` is not checked
            (dense layers legitimately read ``-1``).
        checks: the checks to run (a subset of :data:`ROW_CHECKS`).
    """
    arr = np.asarray(routes)
    if arr.ndim != 3:
        raise ValueError(f"routes must be [positions, layers, top_k], got shape {list(arr.shape)}")
    wanted = tuple(checks)
    unknown = sorted(set(wanted) - set(ROW_CHECKS))
    if unknown:
        raise ValueError(f"unknown row checks {unknown}; known: {list(ROW_CHECKS)}")
    arr = arr.astype(np.int64, copy=False)
    k = arr.shape[-1]
    padding = arr == -1
    out: dict[str, np.ndarray] = {}
    for check in wanted:
        if check == "zero_row":
            out[check] = (arr == 0).all(-1) if k >= 2 else np.zeros(arr.shape[:2], dtype=bool)
        elif check == "missing_layer":
            mask = np.zeros(arr.shape[:2], dtype=bool)
            if routed_layers is not None and len(routed_layers):
                layers = np.asarray(routed_layers, dtype=np.int64)
                mask[:, layers] = padding[:, layers].all(-1)
            out[check] = mask
        elif check == "partial_row":
            out[check] = padding.any(-1) & ~padding.all(-1)
        elif check == "out_of_range":
            bad = arr < -1
            if num_experts is not None:
                bad |= arr >= num_experts
            out[check] = bad.any(-1)
        else:  # duplicate
            ordered = np.sort(arr, axis=-1)
            repeated = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1) if k > 1 else np.zeros(arr.shape[:2], dtype=bool)
            out[check] = repeated & ~(arr == 0).all(-1)
    return out


class RowCheckCounts:
    """Counts of handed-out rows failing each row check (host integers, thread-safe).

    Attributes (in :meth:`snapshot`): ``requests`` checked, ``rows`` checked,
    ``requests_failed`` (requests with at least one failing row) and, per
    check, ``failed[check]``: rows failing it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0
        self._rows = 0
        self._requests_failed = 0
        self._failed = dict.fromkeys(ROW_CHECKS, 0)

    def add(self, faults: dict[str, np.ndarray], rows: int) -> int:
        """Add one request's :func:`row_faults` (``rows`` = its ``T * L`` rows); returns its failing rows."""
        counts = {check: int(mask.sum()) for check, mask in faults.items()}
        failing = int(np.logical_or.reduce(list(faults.values())).sum()) if faults else 0
        with self._lock:
            self._requests += 1
            self._rows += rows
            self._requests_failed += failing > 0
            for check, n in counts.items():
                self._failed[check] += n
        return failing

    def snapshot(self) -> dict[str, Any]:
        """``{"requests", "rows", "requests_failed", "failed": {check: rows}}`` so far."""
        with self._lock:
            return {"requests": self._requests, "rows": self._rows, "requests_failed": self._requests_failed, "failed": dict(self._failed)}
