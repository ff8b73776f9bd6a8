"""Fault injector: plant one kind of fault in the returned routes of a random subset of requests.

The bugs RL users meet in returned routes, planted as they happen, so that an audit
(:mod:`moetrace.analysis.route_audit`) can be shown to catch each one, in every
request that has it and in no other::

    bad, affected = inject_faults(returned, "shifted", rng=np.random.default_rng(7), fraction=0.3,
                                  num_experts=8, routed_layers=[0, 2, 3])

Kinds (one per call; each is the audit's fault of the same name):

- ``zero_row``: the request's rows from a random position on are all ``0`` in every
  routed layer (a capture a fused kernel bypassed);
- ``missing_layer``: one routed layer reads ``-1`` at every position;
- ``partial_row``: one slot of one row is ``-1``;
- ``out_of_range``: one id of one row is ``>= num_experts``;
- ``duplicate``: one row repeats one of its non-zero ids;
- ``shifted``: row ``p`` holds the rows of position ``p - 1`` (off by one position);
- ``foreign``: the rows are another request's (the same start, at least as long, not equal);
- ``missing_positions``: the last positions are cut off;
- ``extra_positions``: rows are appended past the request's last computed position;
- ``unrecorded_request``: the request is returned under an id nothing computed;
- ``other_weight_version`` / ``other_run``: the provenance names another weight version / run.

Only requests where the fault changes something are eligible (a one-position request
cannot be shifted); ``affected`` maps each request changed to its id in the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..provenance import RouteProvenance
from ..routes import RouteSet

__all__ = ["INJECTABLE", "inject_faults"]

INJECTABLE: tuple[str, ...] = (
    "zero_row", "missing_layer", "partial_row", "out_of_range", "duplicate", "shifted", "foreign",
    "missing_positions", "extra_positions", "unrecorded_request", "other_weight_version", "other_run",
)


def _differs(a: np.ndarray, b: np.ndarray, layers: np.ndarray) -> bool:
    return bool((np.sort(a[:, layers], -1) != np.sort(b[:, layers], -1)).any())


def _donors(routes: dict[str, tuple[int, np.ndarray]], rid: str, layers: np.ndarray) -> list[str]:
    start, arr = routes[rid]
    return [other for other, (s, o) in routes.items()
            if other != rid and s == start and o.shape[0] >= arr.shape[0] and _differs(o[: arr.shape[0]], arr, layers)]


def _eligible(kind: str, routes: dict[str, tuple[int, np.ndarray]], rid: str, layers: np.ndarray) -> bool:
    arr = routes[rid][1]
    n, k = arr.shape[0], arr.shape[-1]
    if n == 0 or not (arr[:, layers] >= 0).all():
        return False
    if kind in ("zero_row", "partial_row", "duplicate"):
        return k >= 2
    if kind == "shifted":
        return n >= 2 and _differs(arr[1:], arr[:-1], layers)
    if kind == "foreign":
        return bool(_donors(routes, rid, layers))
    if kind == "missing_positions":
        return n >= 2
    return True


def _plant(kind: str, routes: dict[str, tuple[int, np.ndarray]], rid: str, layers: np.ndarray, num_experts: int,
           rng: np.random.Generator) -> np.ndarray:
    arr = routes[rid][1].copy()
    n, k = arr.shape[0], arr.shape[-1]
    p, layer, slot = int(rng.integers(n)), int(rng.choice(layers)), int(rng.integers(k))
    if kind == "zero_row":
        arr[p:, layers] = 0
    elif kind == "missing_layer":
        arr[:, layer] = -1
    elif kind == "partial_row":
        arr[p, layer, slot] = -1
    elif kind == "out_of_range":
        arr[p, layer, slot] = num_experts + int(rng.integers(num_experts))
    elif kind == "duplicate":
        row = arr[p, layer]
        source = int(np.flatnonzero(row != 0)[0])
        arr[p, layer, (source + 1 + int(rng.integers(k - 1))) % k] = row[source]
    elif kind == "shifted":
        arr[1:] = routes[rid][1][:-1]
    elif kind == "foreign":
        donor = routes[str(rng.choice(_donors(routes, rid, layers)))][1]
        arr = donor[:n].copy()
    elif kind == "missing_positions":
        arr = arr[: n - int(rng.integers(1, n))]
    elif kind == "extra_positions":
        arr = np.concatenate([arr, arr[-1:].repeat(int(rng.integers(1, 4)), axis=0)])
    return arr


def inject_faults(
    returned: RouteSet,
    kind: str,
    *,
    rng: np.random.Generator,
    fraction: float = 0.3,
    num_experts: int,
    routed_layers: Sequence[int],
) -> tuple[RouteSet, dict[str, str]]:
    """A copy of ``returned`` with fault ``kind`` planted in a random share ``fraction`` of the eligible requests.

    Args:
        returned: honest returned routes (logical ids).
        kind: one of :data:`INJECTABLE`.
        rng: the random generator (seed it: the subset, positions and layers come from it).
        fraction: share of eligible requests to change (at least one).
        num_experts: experts per layer (for ``out_of_range``).
        routed_layers: indices of the routed (MoE) layers in the routes' layer axis.

    Returns:
        ``(faulty routes, affected)``: ``affected`` maps each changed request's id to its id
        in the faulty routes (the same id but for ``unrecorded_request``).

    Raises:
        ValueError: an unknown kind, or no request where the fault would change anything.
    """
    if kind not in INJECTABLE:
        raise ValueError(f"unknown fault kind {kind!r}; injectable: {list(INJECTABLE)}")
    layers = np.asarray(routed_layers, dtype=np.int64)
    routes = dict(returned.requests)
    eligible = [rid for rid in routes if _eligible(kind, routes, rid, layers)]
    if not eligible:
        raise ValueError(f"no request of these routes can hold fault {kind!r}")
    count = max(1, round(fraction * len(eligible)))
    chosen = sorted(str(x) for x in rng.choice(eligible, size=min(count, len(eligible)), replace=False))
    out, provenance = dict(routes), dict(returned.provenance)
    affected: dict[str, str] = {}
    for rid in chosen:
        start = routes[rid][0]
        if kind == "unrecorded_request":
            new = f"{rid}-unrecorded"
            out[new] = out.pop(rid)
            if rid in provenance:
                provenance[new] = provenance.pop(rid)
            affected[rid] = new
            continue
        if kind in ("other_weight_version", "other_run"):
            old = provenance.get(rid, RouteProvenance())
            provenance[rid] = (old.replace(weight_version=f"{old.weight_version}-other") if kind == "other_weight_version"
                               else old.replace(run_id=f"{old.run_id}-other"))
        else:
            out[rid] = (start, _plant(kind, routes, rid, layers, num_experts, rng))
        affected[rid] = rid
    faulty = RouteSet(out, returned.model, returned.id_space, returned.num_experts, returned.layer_ids,
                      returned.physical_to_logical, dict(returned.meta), dict(returned.labels), provenance)
    return faulty, affected
