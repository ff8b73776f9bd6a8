"""Reading a placement file: moetrace's plan (``moetrace placement --out``) or SGLang's ``--init-expert-location``.

Both hold a ``phy2log`` map, logical expert of each physical slot: moetrace's one row per
planned MoE layer (their model layer ids under ``layers``), SGLang's one row per model layer
(:mod:`.sglang_plan`). :func:`read_placement_file` returns the rows of the layers asked for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .checks import PlacementError
from .sglang_plan import SGLANG_MAP_KEY, read_sglang_plan

__all__ = ["read_placement_file"]


def _rows_of(path: Path, mapping: np.ndarray, planned: Sequence[int], layer_ids: Sequence[int]) -> np.ndarray:
    missing = [layer for layer in layer_ids if layer not in planned]
    if missing:
        raise PlacementError(f"{path}: has no row for model layers {missing} (it places layers {list(planned)}); "
                             "plan those layers or select the planned ones with --layers")
    return mapping[[list(planned).index(layer) for layer in layer_ids]]


def read_placement_file(path: Path | str, layer_ids: Sequence[int], num_experts: int | None = None) -> np.ndarray:
    """``phy2log [len(layer_ids), N]``: the rows of model layers ``layer_ids`` of a placement file.

    Args:
        path: a moetrace plan (JSON with ``phy2log`` and ``layers``) or an SGLang
            ``--init-expert-location`` document (``physical_to_logical_map``, one row per model layer).
        layer_ids: the model layer ids wanted, in order.
        num_experts: when given, every row must hold each logical expert ``0..E-1`` at least once.

    Raises:
        PlacementError: unreadable, neither format, or a layer without a row (names the file and the fix).
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlacementError(f"{path}: not a readable JSON placement file ({exc}); give a plan from `moetrace placement --out` or an SGLang --init-expert-location .json") from None
    if isinstance(document, dict) and SGLANG_MAP_KEY in document:
        mapping = read_sglang_plan(path, num_experts)
        return _rows_of(path, mapping, range(mapping.shape[0]), layer_ids)
    if not isinstance(document, dict) or "phy2log" not in document or "layers" not in document:
        raise PlacementError(f"{path}: holds neither phy2log with layers (moetrace placement --out) nor {SGLANG_MAP_KEY!r} (SGLang); "
                             "give one of those files")
    try:
        mapping = np.asarray(document["phy2log"], dtype=np.int64)
        planned = [int(x) for x in document["layers"]]
    except (TypeError, ValueError) as exc:
        raise PlacementError(f"{path}: phy2log must be a [layers, slots] list of integers ({exc})") from None
    if mapping.ndim != 2 or mapping.shape[0] != len(planned):
        raise PlacementError(f"{path}: phy2log has shape {list(mapping.shape)} but the file lists {len(planned)} layers; the file was edited or damaged")
    if num_experts is not None:
        for row, layer in zip(mapping, planned, strict=True):
            if row.min() < 0 or row.max() >= num_experts or np.setdiff1d(np.arange(num_experts), row).size:
                raise PlacementError(f"{path}: layer {layer} does not place every logical expert 0..{num_experts - 1} on a slot; "
                                     "plan for the trace's experts")
    return _rows_of(path, mapping, planned, layer_ids)
