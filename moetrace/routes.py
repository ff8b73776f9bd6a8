"""Routes: which experts each token went to, as ``[..., L, k]`` integer arrays, and their files.

The vocabulary shared by divergence (:mod:`moetrace.analysis.divergence`) and
replay (:mod:`moetrace.replay`):

- a *routes* array is ``[T, L, k]`` (or ``[B, S, L, k]``) of expert ids; a
  row ``routes[..., l, :]`` is either ``k`` distinct ids in ``[0, E)`` or all
  ``-1`` (no routing: padding, a token that never went through a forward, a
  dense layer). Rows mixing ``-1`` and ids, repeated ids and ids ``>= E``
  are refused: they are the bugs replay must not hide (padding replayed as
  expert 0 or as duplicates, physical ids where logical ones belong);
- :func:`logical_ids` maps physical ids through an EPLB ``physical_to_logical``
  ``[L, P]`` map;
- a *routes file* (``save_routes`` / ``load_routes``) holds per-request routes
  in the capturer's wire format (:func:`moetrace.wire.encode_routed_experts`)
  with the model, id space, expert count and layer ids they belong to, and
  each request's provenance (run, engine rank, weight version, attempt:
  :mod:`moetrace.provenance`; files written before it load with none);
- :func:`trace_route_set` reads the same per-request routes from ``per_token``
  traces whose rows carry their requests (``moetrace routes``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .label_load import LabelError, check_labels
from .provenance import PROVENANCE_KEY, ProvenanceError, RouteProvenance, read_provenance
from .trace.reader import open_trace
from .trace.schema import Attr
from .trace.token_routes import request_routes
from .trace.writer import write_json_atomic
from .wire import CaptureError, decode_routed_experts, encode_routed_experts

__all__ = [
    "ROUTES_FORMAT",
    "RouteSet",
    "RoutesError",
    "check_routes",
    "load_routes",
    "logical_ids",
    "pad_routes",
    "routed_rows",
    "save_routes",
    "select_route_layers",
    "trace_route_set",
]

ROUTES_FORMAT = "moetrace-routes"
"""``format`` field of a routes file."""


class RoutesError(ValueError):
    """Routes that do not fit, or a routes file that cannot be read; the message says what to do."""


def routed_rows(routes: np.ndarray) -> np.ndarray:
    """``[..., L]`` bool: rows holding ids (every slot ``>= 0``); all-``-1`` rows are ``False``."""
    return np.asarray(routes >= 0).all(axis=-1)


def check_routes(routes: Any, num_experts: int | None = None, what: str = "routes") -> np.ndarray:
    """Validate a routes array ``[..., L, k]`` and return it as ``int64`` numpy.

    Raises:
        RoutesError: not an integer array of at least 2 dimensions, rows mixing
            ``-1`` with ids, ids below ``-1`` or ``>= num_experts``, or a
            repeated id within a row.
    """
    arr = np.asarray(routes.detach().cpu().numpy() if hasattr(routes, "detach") else routes)
    if arr.dtype.kind not in "iu":
        raise RoutesError(f"{what} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise RoutesError(f"{what} must be [..., layers, top_k], got shape {list(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size == 0:
        return arr
    if int(arr.min()) < -1:
        raise RoutesError(f"{what} hold ids below -1 ({int(arr.min())}); -1 is the only padding value")
    valid = arr >= 0
    full = valid.all(axis=-1)
    if (valid.any(axis=-1) & ~full).any():
        where = np.argwhere(valid.any(axis=-1) & ~full)[0].tolist()
        raise RoutesError(f"{what} row {where} mixes -1 and expert ids; a row is k ids or all -1 (no routing)")
    if num_experts is not None and int(arr.max()) >= num_experts:
        raise RoutesError(
            f"{what} hold expert id {int(arr.max())} but the model has {num_experts} experts per layer; "
            "physical ids (EPLB replicas) must be mapped to logical ones first (moetrace.routes.logical_ids)"
        )
    if arr.shape[-1] > 1:
        ordered = np.sort(arr, axis=-1)
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1) & full
        if repeated.any():
            where = np.argwhere(repeated)[0].tolist()
            raise RoutesError(f"{what} row {where} repeats an expert id ({arr[tuple(where)].tolist()}); top-k ids are distinct")
    return arr


def logical_ids(routes: Any, physical_to_logical: Any) -> np.ndarray:
    """Map physical ids ``[..., L, k]`` to logical ids through ``physical_to_logical [L, P]``; ``-1`` stays ``-1``.

    Raises:
        RoutesError: the layer count differs from the map's, or an id is outside ``[-1, P)``.
    """
    arr = np.asarray(routes, dtype=np.int64)
    mapping = np.asarray(physical_to_logical, dtype=np.int64)
    if mapping.ndim != 2 or arr.ndim < 2 or arr.shape[-2] != mapping.shape[0]:
        raise RoutesError(
            f"routes {list(arr.shape)} have {arr.shape[-2] if arr.ndim >= 2 else '?'} layers but physical_to_logical "
            f"is {list(mapping.shape)}; both must count the same layers"
        )
    if arr.size and (int(arr.min()) < -1 or int(arr.max()) >= mapping.shape[1]):
        raise RoutesError(f"physical ids must be in [-1, {mapping.shape[1]}), got [{int(arr.min())}, {int(arr.max())}]")
    layer = np.arange(mapping.shape[0]).reshape(-1, 1)
    mapped = mapping[layer, np.maximum(arr, 0)]
    return np.where(arr >= 0, mapped, -1)


def select_route_layers(routes: np.ndarray, layer_ids: Sequence[int]) -> np.ndarray:
    """Model-layer routes ``[..., L_model, k]`` (dense layers ``-1``) -> MoE-layer routes ``[..., len(layer_ids), k]``."""
    if routes.ndim < 2 or (layer_ids and max(layer_ids) >= routes.shape[-2]):
        raise RoutesError(f"routes {list(routes.shape)} have no layer {max(layer_ids)}; expected model layer ids {list(layer_ids)}")
    return routes[..., list(layer_ids), :]


def pad_routes(sequences: Sequence[Any], side: str = "right", length: int | None = None) -> np.ndarray:
    """Stack per-sequence routes ``[S_i, L, k]`` into ``[B, S, L, k]``, padding with ``-1``.

    ``side="left"`` puts the padding first, as a left-padded batch does.
    """
    if side not in ("left", "right"):
        raise RoutesError(f"side must be 'left' or 'right', got {side!r}")
    arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
    if not arrays or any(a.ndim != 3 or a.shape[1:] != arrays[0].shape[1:] for a in arrays):
        raise RoutesError("pad_routes needs one or more [S_i, L, k] arrays with the same L and k")
    width = max(a.shape[0] for a in arrays) if length is None else length
    if any(a.shape[0] > width for a in arrays):
        raise RoutesError(f"a sequence is longer than length={width}")
    out = np.full((len(arrays), width, *arrays[0].shape[1:]), -1, dtype=np.int64)
    for row, a in enumerate(arrays):
        if side == "right":
            out[row, : a.shape[0]] = a
        else:
            out[row, width - a.shape[0] :] = a
    return out


# ---------------------------------------------------------------------------- files


@dataclass
class RouteSet:
    """Per-request routes and what they belong to.

    Attributes:
        requests: request id -> ``(start, routes [n, L, k])``: positions
            ``start .. start + n - 1`` of the request.
        model: model name (may be empty).
        id_space: ``"logical"`` or ``"physical"``.
        num_experts: experts per layer in that id space (``None``: unknown).
        layer_ids: the model layer id of each of the ``L`` layers (``None``: unknown).
        physical_to_logical: ``[L, P]`` map for physical ids.
        labels: request id -> its labels (tenant, workload, session...; :mod:`moetrace.label_load`).
        provenance: request id -> where its routes come from (:mod:`moetrace.provenance`);
            a request absent here recorded none (a file written before provenance).
    """

    requests: dict[str, tuple[int, np.ndarray]]
    model: str = ""
    id_space: str = "logical"
    num_experts: int | None = None
    layer_ids: list[int] | None = None
    physical_to_logical: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    provenance: dict[str, RouteProvenance] = field(default_factory=dict)

    def logical(self) -> RouteSet:
        """The same routes in logical ids (a copy; ``self`` when already logical)."""
        if self.id_space == "logical":
            return self
        if self.physical_to_logical is None:
            raise RoutesError("these routes hold physical ids and no physical_to_logical map; save them with one")
        mapping = self.physical_to_logical
        requests = {rid: (start, logical_ids(arr, mapping)) for rid, (start, arr) in self.requests.items()}
        return RouteSet(requests, self.model, "logical", int(mapping.max()) + 1, self.layer_ids, None, dict(self.meta), dict(self.labels),
                        dict(self.provenance))


def save_routes(
    path: Path | str,
    requests: Mapping[str, Any],
    *,
    model: str = "",
    id_space: str = "logical",
    num_experts: int | None = None,
    layer_ids: Sequence[int] | None = None,
    starts: Mapping[str, int] | None = None,
    physical_to_logical: Any = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
    provenance: RouteProvenance | Mapping[str, RouteProvenance] | None = None,
    **meta: Any,
) -> Path:
    """Write per-request routes ``{request id: [n, L, k]}`` as a routes file (JSON, written atomically).

    ``labels`` maps request ids to their labels (``moetrace analyze --by label`` groups by them).
    ``provenance`` is one :class:`~moetrace.provenance.RouteProvenance` for every request
    (written once, at the top) or a mapping request id -> its own (in each request's entry).
    """
    if id_space not in ("logical", "physical"):
        raise RoutesError(f"id_space must be 'logical' or 'physical', got {id_space!r}")
    if id_space == "physical" and physical_to_logical is None:
        raise RoutesError("physical routes need their physical_to_logical map (EPLB phy2log) to be compared or replayed")
    per_request = dict(provenance) if isinstance(provenance, Mapping) else {}
    unknown = sorted(set(map(str, per_request)) - set(map(str, requests)))
    if unknown:
        raise RoutesError(f"provenance names requests that have no routes: {unknown[:5]}")
    body: dict[str, Any] = {
        "format": ROUTES_FORMAT, "version": 1, "model": model, "id_space": id_space,
        "num_experts": num_experts, "layer_ids": None if layer_ids is None else [int(x) for x in layer_ids],
        "physical_to_logical": None if physical_to_logical is None else np.asarray(physical_to_logical).tolist(),
        "meta": meta,
        "requests": {
            str(rid): {
                "start": int((starts or {}).get(rid, 0)),
                "routed_experts": encode_routed_experts(check_routes(arr, what=f"request {rid!r}")),
                **({PROVENANCE_KEY: per_request[rid].to_dict()} if rid in per_request else {}),
            }
            for rid, arr in requests.items()
        },
    }
    if isinstance(provenance, RouteProvenance):
        body[PROVENANCE_KEY] = provenance.to_dict()
    if labels:
        unknown = sorted(set(map(str, labels)) - set(map(str, requests)))
        if unknown:
            raise RoutesError(f"labels name requests that have no routes: {unknown[:5]}")
        body["labels"] = {str(rid): _labels(value, f"labels of request {rid!r}") for rid, value in labels.items() if value}
    return write_json_atomic(path, body)


def _labels(value: Any, what: str) -> dict[str, str]:
    try:
        return check_labels(value, what)
    except LabelError as exc:
        raise RoutesError(str(exc)) from None


def _decode(payload: Any, what: str, validate: bool = True) -> np.ndarray:
    try:
        arr = decode_routed_experts(payload)
        return check_routes(arr, what=what) if validate else arr.astype(np.int64)
    except CaptureError as exc:
        raise RoutesError(f"{what}: {exc}") from exc


def load_routes(path: Path | str, *, validate: bool = True) -> RouteSet:
    """Read per-request routes from a routes file, a wire payload or a ``.npy`` array.

    Accepted JSON shapes: a routes file (:func:`save_routes`); one wire payload
    ``{"data", "dtype", "shape"}`` (request ``"0"``); a mapping of request id ->
    payload, or -> ``{"routed_experts": payload, "start": s}`` (an API
    response body per request). A ``.npy`` file is one request ``"0"``.

    ``validate=False`` reads rows that :func:`check_routes` refuses (duplicates, rows mixing
    ``-1`` and ids, ids below ``-1``) as they are: what an audit of returned routes needs.

    Raises:
        RoutesError: the file is none of these (the message says which part is wrong).
    """
    source = Path(path)
    if not source.is_file():
        raise RoutesError(f"{source}: no such routes file")
    if source.suffix == ".npy":
        arr = np.load(source, allow_pickle=False)
        return RouteSet({"0": (0, check_routes(arr, what=str(source)) if validate else np.asarray(arr, dtype=np.int64))})
    try:
        body = json.loads(source.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RoutesError(
            f"{source}: neither a moetrace trace (.h5) nor a routes JSON file / wire payload / .npy array ({exc})"
        ) from None
    if not isinstance(body, dict):
        raise RoutesError(f"{source}: expected a JSON object (routes file, wire payload or request id -> payload)")
    if "data" in body and "shape" in body:
        one = _provenance(body, str(source), None)
        return RouteSet({"0": (0, _decode(body, str(source), validate))}, provenance={"0": one} if one is not None else {})
    meta: dict[str, Any] = {}
    if body.get("format") == ROUTES_FORMAT:
        entries = body.get("requests")
        meta = body
    else:
        entries = body
    if not isinstance(entries, dict) or not entries:
        raise RoutesError(f"{source}: no requests found")
    requests, provenance = _entries(entries, source, _provenance(meta, str(source), None), validate)
    mapping = meta.get("physical_to_logical")
    layer_ids = meta.get("layer_ids")
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict) or not set(labels) <= set(requests):
        raise RoutesError(f"{source}: 'labels' must map request ids of this file to their labels")
    return RouteSet(
        requests, str(meta.get("model", "") or ""), str(meta.get("id_space", "logical")),
        meta.get("num_experts"), None if layer_ids is None else [int(x) for x in layer_ids],
        None if mapping is None else np.asarray(mapping, dtype=np.int64), dict(meta.get("meta") or {}),
        {rid: _labels(value, f"{source}: labels of request {rid!r}") for rid, value in labels.items()},
        provenance,
    )


def _entries(
    entries: dict[str, Any], source: Path, default: RouteProvenance | None, validate: bool,
) -> tuple[dict[str, tuple[int, np.ndarray]], dict[str, RouteProvenance]]:
    """Each request's ``(start, routes)`` and provenance (its entry's, its payload's, else the file's)."""
    requests: dict[str, tuple[int, np.ndarray]] = {}
    provenance: dict[str, RouteProvenance] = {}
    for rid, entry in entries.items():
        payload, start = entry, 0
        if isinstance(entry, dict) and "routed_experts" in entry:
            payload, start = entry["routed_experts"], int(entry.get("start", entry.get("routed_experts_start", 0)))
        if not isinstance(payload, dict):
            raise RoutesError(f"{source}: request {rid!r} holds no wire payload ({{'data', 'dtype', 'shape'}})")
        what = f"{source}: request {rid!r}"
        requests[str(rid)] = (start, _decode(payload, what, validate))
        found = _provenance(entry, what, _provenance(payload, what, default))
        if found is not None:
            provenance[str(rid)] = found
    return requests, provenance


def _provenance(entry: Any, what: str, default: RouteProvenance | None) -> RouteProvenance | None:
    try:
        return read_provenance(entry, what, default)
    except ProvenanceError as exc:
        raise RoutesError(str(exc)) from None


def trace_route_set(traces: Sequence[Path | str], request_id: str | None = None) -> RouteSet:
    """Every request's routes (or ``request_id``'s) from ``per_token`` traces that tie rows to requests.

    Keys are the engine's own request ids; each request's routes start at position 0 and
    positions no pass computed (prefix-cache hits) are rows of ``-1``
    (:func:`moetrace.trace.token_routes.request_routes`). Ids stay in the traces' id space,
    with their ``physical_to_logical`` map when physical; ``layer_ids`` are the traces'
    MoE layers.

    Raises:
        TraceError: a trace is unreadable, not ``per_token``, without request rows, or the
            request is in none of them.
    """
    if not traces:
        raise RoutesError("no trace given: name one or more per_token traces")
    with open_trace(traces[0]) as first:
        model, id_space, layers, mapping = str(first.attrs.get(Attr.MODEL, "")), first.id_space, first.layers, first.physical_to_logical
        experts = first.num_physical_experts if id_space == "physical" else first.num_logical_experts
    requests = request_routes(list(traces), request_id)
    return RouteSet({rid: (0, routes) for rid, routes in requests.items()}, model, id_space, experts,
                    [int(x) for x in layers], mapping if id_space == "physical" else None, {"source": "trace"})
