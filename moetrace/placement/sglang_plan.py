"""A placement plan in SGLang's own format: what ``--init-expert-location`` loads.

SGLang 0.5.23 (``sglang.srt.eplb.expert_location.compute_initial_expert_location_metadata``)
reads a ``.json`` file (or a ``.pt`` or inline JSON) holding a dict and, when it has
``physical_to_logical_map``, calls ``ExpertLocationMetadata.init_by_mapping(model_config,
**document)``: so the document holds that one key and nothing else (any other key is an
unexpected keyword argument there). The map is ``[L, N]``:

- ``L`` = the model's layer count (SGLang indexes the map by model layer id, dense
  layers included; their rows are never read);
- ``N`` = physical expert slots = logical experts + ``--ep-num-redundant-experts``,
  ``N / ep_size`` contiguous slots per EP rank (rank ``r`` holds slots
  ``[r N / R, (r + 1) N / R)``, the same convention as moetrace's ``phy2log``);
- every logical expert must have at least one slot in every row (SGLang's dispatch
  picks among an expert's slots; an expert without one has nowhere to go).

With a non-trivial location SGLang switches its dispatch on (``--ep-dispatch-algorithm``
defaults to ``dynamic`` without an all-to-all backend): a token of a replicated expert
goes to replica ``row % replicas`` of the batch, the same replica on every rank.
:func:`sglang_physical_count` reproduces that rule, so the load a plan delivers can be
predicted exactly from per-token records, not only on average.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..trace.writer import write_json_atomic
from .checks import PlacementError
from .plan import log2phy_from_phy2log

__all__ = ["SGLANG_MAP_KEY", "read_sglang_plan", "rows_in_pass", "sglang_expert_location", "sglang_physical_count", "sglang_slots", "write_sglang_plan"]

SGLANG_MAP_KEY = "physical_to_logical_map"
"""The one key of SGLang's ``--init-expert-location`` document."""


def _check_rows(phy2log: np.ndarray, num_experts: int, what: str) -> None:
    for row, mapping in enumerate(phy2log):
        missing = np.setdiff1d(np.arange(num_experts), mapping)
        if missing.size or mapping.min() < 0 or mapping.max() >= num_experts:
            raise PlacementError(
                f"{what}: layer row {row} maps slots to {sorted(set(mapping.tolist()))}; SGLang needs every logical expert "
                f"0..{num_experts - 1} on at least one slot and no other id (missing {missing.tolist()})"
            )


def sglang_expert_location(phy2log: np.ndarray, layer_ids: Sequence[int], num_model_layers: int, num_experts: int) -> dict[str, list[list[int]]]:
    """SGLang's ``--init-expert-location`` document for a plan.

    Args:
        phy2log: the plan ``[len(layer_ids), N]``: logical expert of each physical slot.
        layer_ids: model layer id of each plan row.
        num_model_layers: the model's layer count ``L`` (SGLang's map has one row per model layer).
        num_experts: logical experts ``E``.

    Layers the plan does not cover get SGLang's trivial row (slot ``s`` holds expert
    ``s mod E``, what SGLang itself builds for ``--init-expert-location trivial``).

    Raises:
        PlacementError: shapes disagree, a layer id is outside the model, or a row misses an expert.
    """
    plan = np.asarray(phy2log, dtype=np.int64)
    ids = [int(x) for x in layer_ids]
    if plan.ndim != 2 or plan.shape[0] != len(ids):
        raise PlacementError(f"the plan has shape {list(plan.shape)} but names {len(ids)} layers; expected [layers, slots]")
    bad = [x for x in ids if not 0 <= x < num_model_layers]
    if bad:
        raise PlacementError(f"layer ids {bad} are outside the model's {num_model_layers} layers; pass the model's layer count")
    _check_rows(plan, num_experts, "the plan")
    full = np.tile(np.arange(plan.shape[1]) % num_experts, (num_model_layers, 1))
    full[ids] = plan
    return {SGLANG_MAP_KEY: full.tolist()}


def write_sglang_plan(path: Path | str, phy2log: np.ndarray, layer_ids: Sequence[int], num_model_layers: int, num_experts: int) -> Path:
    """Write :func:`sglang_expert_location` to ``path`` atomically (``.json``: SGLang picks its reader by suffix)."""
    target = Path(path)
    if target.suffix != ".json":
        raise PlacementError(f"{target}: SGLang reads --init-expert-location by suffix; name the plan file *.json")
    return write_json_atomic(target, sglang_expert_location(phy2log, layer_ids, num_model_layers, num_experts))


def read_sglang_plan(path: Path | str, num_experts: int | None = None) -> np.ndarray:
    """The ``[L, N]`` map of an ``--init-expert-location`` JSON document (checked as SGLang will use it).

    Raises:
        PlacementError: not JSON, not SGLang's document, ragged rows, or (with ``num_experts``) a missing expert.
    """
    try:
        document = json.loads(Path(path).read_text())
        mapping = np.asarray(document[SGLANG_MAP_KEY], dtype=np.int64)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise PlacementError(f"{path}: not an SGLang --init-expert-location document with {SGLANG_MAP_KEY!r} ({exc})") from None
    if mapping.ndim != 2:
        raise PlacementError(f"{path}: {SGLANG_MAP_KEY} must be [layers, slots], got shape {list(mapping.shape)}")
    if num_experts is not None:
        _check_rows(mapping, num_experts, str(path))
    return mapping


def rows_in_pass(pass_ids: np.ndarray) -> np.ndarray:
    """Batch row of each token within its pass ``[T]``, for tokens grouped by pass ``pass_ids [T]``."""
    pass_ids = np.asarray(pass_ids)
    if not len(pass_ids):
        return np.zeros(0, dtype=np.int64)
    first = np.r_[True, pass_ids[1:] != pass_ids[:-1]]
    if len(np.unique(pass_ids)) != int(first.sum()):
        raise PlacementError("tokens must be grouped by pass, in batch row order (as a per_token trace stores them)")
    return np.arange(len(pass_ids)) - np.flatnonzero(first)[np.cumsum(first) - 1]


def sglang_slots(topk_ids: np.ndarray, rows: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """The physical slot of every token copy ``[T, L, k]`` (``-1`` where the id is ``-1``) under SGLang's
    rank-invariant dynamic dispatch.

    Args:
        topk_ids: logical expert ids of every computed token ``[T, L, k]`` (``-1`` = none).
        rows: each token's batch row in its forward pass ``[T]`` (:func:`rows_in_pass`).
        phy2log: the deployed map ``[L, N]``.

    SGLang sends token row ``t`` of a pass (all its top-k slots) to replica ``t mod n`` of
    each chosen expert, its ``n`` replicas ordered by physical slot id
    (``_topk_ids_logical_to_physical_dynamic`` with ``rank_invariant``).
    """
    ids = np.asarray(topk_ids, dtype=np.int64)
    mapping = np.asarray(phy2log, dtype=np.int64)
    log2phy, logcnt = log2phy_from_phy2log(mapping, int(mapping.max()) + 1)
    rows = np.asarray(rows, dtype=np.int64)[:, None]
    slots = np.full(ids.shape, -1, dtype=np.int64)
    for layer in range(mapping.shape[0]):
        chosen = ids[:, layer]  # [T, k]
        expert = np.where(chosen >= 0, chosen, 0)
        slots[:, layer] = np.where(chosen >= 0, log2phy[layer, expert, rows % logcnt[layer, expert]], -1)
    return slots


def sglang_physical_count(topk_ids: np.ndarray, rows: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """Token copies each physical slot computes ``[L, N]`` under SGLang's rank-invariant dynamic dispatch
    (the slots of :func:`sglang_slots`, counted). Rank ``r``'s load is the sum of its ``N / R`` slots
    (:func:`moetrace.balance.rank_load`)."""
    slots = sglang_slots(topk_ids, rows, phy2log)
    num_layers, num_slots = np.asarray(phy2log).shape
    count = np.zeros((num_layers, num_slots), dtype=np.int64)
    for layer in range(num_layers):
        chosen = slots[:, layer]
        np.add.at(count[layer], chosen[chosen >= 0], 1)
    return count
