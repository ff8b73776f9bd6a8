"""Audit of returned routes: does what an engine handed back for each request equal what it computed?

An engine hands a request's routed experts back with its answer (SGLang's
``return_routed_experts``, moetrace's capturer); the recorder's ``per_token``
trace of the same run holds, for every request, the ids each position was
routed to when the pass ran. :func:`audit_routes` compares the two request
by request and position by position, and names what is wrong (``FAULTS``):

======================  ==============================================================  ======
fault                   what                                                            unit
======================  ==============================================================  ======
``zero_row``            a returned row whose ids are all ``0`` (k >= 2; with k = 1:      rows
                        a ``0`` where the trace holds another expert)
``missing_layer``       ``-1`` in every slot where the trace routed the position         rows
``partial_row``         ``-1`` and ids mixed in one row                                  rows
``out_of_range``        an id below ``-1`` or ``>= num_experts``                         rows
``duplicate``           an id repeated within a row                                      rows
``shifted``             a position's rows equal the trace's rows of the position         rows
                        before or after it (an off-by-one in the token convention),
                        for at least half of the request's differing positions
``foreign``             a position's rows equal another request's rows at that           rows
                        position (routes bound to the wrong request), that request
                        explaining at least half of the positions left
``mismatch``            valid rows that differ from the trace, explained by none of      rows
                        the above
``missing_positions``   positions the trace computed (from the returned start on)       positions
                        that the answer lacks
``extra_positions``     returned positions the trace never computed for the request      positions
``unrecorded_request``  a returned request the trace has no row of                      requests
``other_weight_version`` routes whose provenance names another weight version than       requests
                        the expected one
``other_run``           routes whose provenance names another run than the trace's      requests
======================  ==============================================================  ======

A row is one (position, layer): the ``k`` ids of a token in one MoE layer. The
row checks (the first five) are :func:`moetrace.route_checks.row_faults`; a row
failing one is not compared further. Rows the trace holds as ``-1`` (a
position no pass computed: a prefix-cache hit) are not compared. Ids are
compared as sets (the order within a top-k is not compared).

Streaming and memory. The returned routes are a :class:`~moetrace.routes.RouteSet`
(what the client holds, in memory); the recorded side is a :class:`RecordedSource`
that yields one request at a time and is read twice (the second pass looks, for
each request's unexplained positions, for another request whose rows they are).
Held at once: the returned routes, one recorded request, and the returned rows
that the first pass could not explain (a subset of the returned routes).

Every check can be turned off (``checks=``), which is how the tests show that each
check is what catches its fault (a negative control per fault).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..provenance import RouteProvenance
from ..route_checks import ROW_CHECKS, row_faults
from ..routes import RoutesError, RouteSet, logical_ids
from ..trace.schema import Attr

__all__ = [
    "FAULTS",
    "AuditError",
    "AuditReport",
    "RecordedSource",
    "RequestAudit",
    "audit_routes",
    "routeset_source",
    "trace_source",
]

FAULTS: tuple[str, ...] = (
    *ROW_CHECKS, "shifted", "foreign", "mismatch", "missing_positions", "extra_positions",
    "unrecorded_request", "other_weight_version", "other_run",
)
"""Every fault the audit names, in report order (each is also a check that can be turned off)."""

_REQUEST_FAULTS = ("unrecorded_request", "other_weight_version", "other_run")
_POSITION_FAULTS = ("missing_positions", "extra_positions")


class AuditError(ValueError):
    """Inputs the audit cannot compare (different layers, top-k, expert counts); the message says what to do."""


@dataclasses.dataclass(frozen=True)
class RecordedSource:
    """The recorder's side: every request's routes as the passes computed them, one request at a time.

    Attributes:
        requests: called once per read, yields ``(request id, routes [T, L, k])`` with
            row ``p`` = position ``p`` of the request (``-1`` rows: not computed),
            logical ids, ``L`` = the MoE layers.
        num_experts: logical experts per layer.
        top_k: ``k``.
        layer_ids: the model layer id of each of the ``L`` MoE layers.
        run_id: the recording's run id (``""``: unknown; provenance runs are then not checked).
        describe: what the source is, for the report.
    """

    requests: Callable[[], Iterator[tuple[str, np.ndarray]]]
    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]
    run_id: str = ""
    describe: str = ""


def routeset_source(routeset: RouteSet, *, num_experts: int | None = None, run_id: str = "", describe: str = "routes") -> RecordedSource:
    """A :class:`RecordedSource` over a routes set (MoE layers; another engine's answers, a routes file of a trace)."""
    logical = routeset.logical()
    experts = num_experts if num_experts is not None else logical.num_experts
    if experts is None:
        raise AuditError(f"{describe}: the expert count is unknown; give num_experts")
    shapes = {arr.shape[1:] for _, arr in logical.requests.values()}
    if len(shapes) != 1:
        raise AuditError(f"{describe}: requests hold different [layers, top_k] shapes {sorted(map(list, shapes))}")
    layers, top_k = shapes.pop()
    layer_ids = tuple(logical.layer_ids) if logical.layer_ids is not None and len(logical.layer_ids) == layers else tuple(range(layers))

    def requests() -> Iterator[tuple[str, np.ndarray]]:
        for rid, (start, arr) in logical.requests.items():
            if start:
                arr = np.concatenate([np.full((start, *arr.shape[1:]), -1, dtype=arr.dtype), arr])
            yield rid, arr

    return RecordedSource(requests, int(experts), int(top_k), layer_ids, run_id, describe)


def trace_source(paths: Sequence[Path | str], group: int = 4096) -> RecordedSource:
    """A :class:`RecordedSource` over the ``per_token`` trace(s) of one run (per-rank files, consecutive dumps).

    Rows are tied to requests by the trace's request rows (:func:`moetrace.trace.token_routes.request_routes`),
    read ``group`` requests at a time (memory: the rows of one group); physical ids are mapped to
    logical ones through the trace's ``physical_to_logical``; ``-2`` (an id the engine routed outside
    the expert range) is left out of the comparison.

    Raises:
        AuditError: traces of different runs or models.
        TraceError: a trace that cannot be read, is not ``per_token`` or has no request rows.
    """
    from ..trace.reader import open_trace
    from ..trace.token_routes import has_request_rows, request_routes

    if not paths:
        raise AuditError("no trace given")
    headers = []
    request_ids: dict[str, None] = {}  # every request id of the run, first seen first (the table is small: one id per request)
    for path in paths:
        with open_trace(path) as trace:
            headers.append((str(trace.attrs.get(Attr.RUN_ID, "")), tuple(int(x) for x in trace.layers), trace.top_k,
                            trace.num_logical_experts, trace.physical_to_logical))
            if trace.mode != "per_token" or not has_request_rows(trace):
                raise AuditError(f"{path}: its token rows carry no request ids; record the run in per_token mode through an adapter that "
                                 "gives the engine's batch (request rows), or give a routes file as the recorded side")
            request_ids.update(dict.fromkeys(map(str, trace.request_table())))
    run_id, layer_ids, top_k, experts, mapping = headers[0]
    for path, (other_run, other_layers, other_k, other_experts, _) in zip(paths, headers, strict=True):
        if (other_run, other_layers, other_k, other_experts) != (run_id, layer_ids, top_k, experts):
            raise AuditError(f"{path}: another run or model than {paths[0]} (run_id, MoE layers, top_k, experts differ); give the traces of one run")
    ids = list(request_ids)

    def requests() -> Iterator[tuple[str, np.ndarray]]:
        for first in range(0, len(ids), group):
            for rid, arr in request_routes(list(paths), request_ids=ids[first : first + group]).items():
                yield rid, logical_ids(np.where(arr < -1, -1, arr), mapping)

    return RecordedSource(requests, experts, top_k, layer_ids, run_id, ", ".join(map(str, paths)))


@dataclasses.dataclass
class RequestAudit:
    """One returned request against the trace.

    Attributes:
        request: its id.
        start: first returned position; ``positions``: returned positions.
        compared: rows compared with the trace (both sides routed, no row check failed).
        matched: of those, rows equal to the trace's (same set).
        faults: fault name -> rows (positions, or 1 for a request-level fault) it holds.
        shift: ``+1`` / ``-1`` when rows are the trace's next / previous position's.
        foreign_of: the requests whose rows this one returned (``foreign``).
        provenance: what the routes say they come from (``None``: nothing recorded).
        weight_version_check: ``"match"``, ``"assumed"`` (no provenance), ``"other"``, ``"unchecked"``.
    """

    request: str
    start: int
    positions: int
    compared: int = 0
    matched: int = 0
    faults: dict[str, int] = dataclasses.field(default_factory=dict)
    shift: int = 0
    foreign_of: list[str] = dataclasses.field(default_factory=list)
    provenance: RouteProvenance | None = None
    weight_version_check: str = "unchecked"

    @property
    def ok(self) -> bool:
        return not self.faults

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request, "ok": self.ok, "start": self.start, "positions": self.positions,
            "compared_rows": self.compared, "matched_rows": self.matched, "faults": dict(self.faults),
            **({"shift": self.shift} if self.shift else {}), **({"foreign_of": self.foreign_of} if self.foreign_of else {}),
            "provenance": None if self.provenance is None else self.provenance.to_dict(),
            "weight_version": self.weight_version_check,
        }


@dataclasses.dataclass
class AuditReport:
    """The audit of every returned request (see the module docstring for the faults and units)."""

    requests: list[RequestAudit]
    layer_ids: tuple[int, ...]
    compared: np.ndarray  # [L] rows compared
    matched: np.ndarray  # [L] rows equal to the trace's
    layer_faults: dict[str, np.ndarray]  # row fault -> [L] rows
    recorded_only: int  # requests in the trace with no returned routes (not a fault: not every request asks)
    checks: tuple[str, ...]
    expected_weight_version: str | None = None
    run_id: str = ""
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> list[RequestAudit]:
        return [r for r in self.requests if not r.ok]

    @property
    def ok(self) -> bool:
        """Every returned request matches (and there was at least one)."""
        return bool(self.requests) and not self.failed

    def fault_totals(self) -> dict[str, dict[str, int]]:
        """Fault -> ``{"requests": n, "count": rows/positions/requests}`` over every request (faults seen only)."""
        totals: dict[str, dict[str, int]] = {}
        for req in self.requests:
            for name, count in req.faults.items():
                entry = totals.setdefault(name, {"requests": 0, "count": 0})
                entry["requests"] += 1
                entry["count"] += count
        return {name: totals[name] for name in FAULTS if name in totals}

    def to_dict(self) -> dict[str, Any]:
        """The JSON report: totals, per fault, per layer and per request."""
        assumed = sum(r.weight_version_check == "assumed" for r in self.requests)
        return {
            "ok": self.ok,
            "requests": len(self.requests),
            "requests_ok": len(self.requests) - len(self.failed),
            "requests_failed": len(self.failed),
            "recorded_only_requests": self.recorded_only,
            "compared_rows": int(self.compared.sum()),
            "matched_rows": int(self.matched.sum()),
            "faults": self.fault_totals(),
            "checks": list(self.checks),
            "expected_weight_version": self.expected_weight_version,
            "weight_version_assumed_requests": assumed,
            "run_id": self.run_id,
            "sources": dict(self.sources),
            "layers": [
                {"layer": i, "layer_id": int(lid), "compared_rows": int(self.compared[i]), "matched_rows": int(self.matched[i]),
                 "faults": {name: int(rows[i]) for name, rows in self.layer_faults.items() if rows[i]}}
                for i, lid in enumerate(self.layer_ids)
            ],
            "per_request": [r.to_dict() for r in self.requests],
        }


def _sets(arr: np.ndarray) -> np.ndarray:
    """Rows as sorted int64 ids (compared and hashed as sets, whatever dtype each side came in)."""
    return np.sort(arr.astype(np.int64, copy=False), axis=-1)


def _moe_rows(arr: np.ndarray, layer_ids: Sequence[int], what: str) -> np.ndarray:
    """``[n, L_moe, k]`` from returned routes over the MoE layers or over every model layer."""
    layers = arr.shape[1]
    if layers == len(layer_ids):
        return arr
    if layers > max(layer_ids):
        return arr[:, list(layer_ids)]
    raise AuditError(
        f"{what}: the routes hold {layers} layers; the trace has {len(layer_ids)} MoE layers (model layer ids "
        f"{list(layer_ids)}): give routes over the MoE layers or over every model layer"
    )


class _Audit:
    """State of one audit: per-layer counters, per-request results, probes for the second pass."""

    def __init__(self, recorded: RecordedSource, checks: tuple[str, ...]) -> None:
        self.recorded, self.checks = recorded, checks
        layers = len(recorded.layer_ids)
        self.compared = np.zeros(layers, dtype=np.int64)
        self.matched = np.zeros(layers, dtype=np.int64)
        self.layer_faults = {name: np.zeros(layers, dtype=np.int64) for name in (*ROW_CHECKS, "shifted", "foreign", "mismatch")}
        # request -> (unexplained positions [u], returned rows there [u, L, k] (sets), their differing layers [u, L])
        self.unexplained: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def prepare(self, logical: RouteSet, weight_version: str | None) -> tuple[dict[str, RequestAudit], dict[str, np.ndarray]]:
        """Each returned request's result (with its provenance checks) and its MoE-layer rows."""
        recorded = self.recorded
        results: dict[str, RequestAudit] = {}
        prepared: dict[str, np.ndarray] = {}
        for rid, (start, arr) in logical.requests.items():
            if arr.ndim != 3 or arr.shape[-1] != recorded.top_k:
                raise AuditError(f"returned request {rid!r} has routes {list(arr.shape)}; the trace routes top-{recorded.top_k}")
            prepared[rid] = _moe_rows(arr, recorded.layer_ids, f"returned request {rid!r}")
            provenance = logical.provenance.get(rid)
            result = results[rid] = RequestAudit(rid, start, arr.shape[0], provenance=provenance)
            if weight_version is not None:
                got = provenance.weight_version if provenance is not None else ""
                result.weight_version_check = "assumed" if not got else "match" if got == weight_version else "other"
                if result.weight_version_check == "other":
                    self.add(result, "other_weight_version", 1)
            if provenance is not None and provenance.run_id and recorded.run_id and provenance.run_id != recorded.run_id:
                self.add(result, "other_run", 1)
        return results, prepared

    def on(self, check: str) -> bool:
        return check in self.checks

    def add(self, result: RequestAudit, name: str, rows: int, per_layer: np.ndarray | None = None) -> None:
        if rows and self.on(name):
            result.faults[name] = result.faults.get(name, 0) + int(rows)
            if per_layer is not None:
                self.layer_faults[name] += per_layer

    def compare(self, result: RequestAudit, returned: np.ndarray, recorded: np.ndarray) -> None:
        """Compare returned rows (positions ``start ..``) with the request's recorded rows (positions ``0 ..``)."""
        start, n = result.start, returned.shape[0]
        computed = (recorded >= 0).all(-1)  # [T, L] rows the trace routed
        computed_pos = computed.any(-1)
        hi = min(start + n, recorded.shape[0])
        overlap = max(hi - start, 0)
        self.add(result, "extra_positions", n - overlap)
        self.add(result, "missing_positions", int(computed_pos[start + n :].sum()))
        if overlap == 0:
            return
        a, b = returned[:overlap], recorded[start:hi]
        routed_b = computed[start:hi]
        row_checks = tuple(c for c in ROW_CHECKS if self.on(c))
        structural = row_faults(a, num_experts=self.recorded.num_experts, routed_layers=range(a.shape[1]), checks=row_checks)
        if "missing_layer" in structural:
            structural["missing_layer"] &= routed_b
        bad = np.zeros(routed_b.shape, dtype=bool)
        for name, mask in structural.items():
            self.add(result, name, int(mask.sum()), mask.sum(0))
            bad |= mask
        sa, sb = _sets(a), _sets(b)
        compared = routed_b & ~bad & (a >= 0).all(-1)
        equal = (sa == sb).all(-1)
        same = compared & equal
        result.compared += int(compared.sum())
        result.matched += int(same.sum())
        self.compared += compared.sum(0)
        self.matched += same.sum(0)
        differ = compared & ~equal  # [u, L]
        if self.recorded.top_k == 1 and self.on("zero_row"):
            zero = differ & (a == 0).all(-1)
            self.add(result, "zero_row", int(zero.sum()), zero.sum(0))
            differ &= ~zero
        positions = np.flatnonzero(differ.any(-1))
        if positions.size == 0:
            return
        if self.on("shifted"):
            positions, differ = self._shift(result, sa, _sets(recorded), compared, differ, positions)
        if positions.size:
            self.unexplained[result.request] = (positions + start, sa[positions], differ[positions])

    def _shift(self, result: RequestAudit, sa: np.ndarray, s_rec: np.ndarray, compared: np.ndarray, differ: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Name ``shifted`` the differing positions whose compared rows all equal the trace's next/previous position's."""
        start = result.start
        best, best_hits = 0, np.zeros(0, dtype=np.int64)
        for shift in (1, -1):
            src = positions + start - shift  # returned p holds recorded p - shift
            ok = (src >= 0) & (src < s_rec.shape[0])
            hits = positions[ok]
            if hits.size:
                neighbour = s_rec[src[ok]]
                same = ((sa[hits] == neighbour).all(-1) | ~compared[hits]).all(-1)
                hits = hits[same]
            if hits.size > best_hits.size:
                best, best_hits = shift, hits
        if best_hits.size == 0 or 2 * best_hits.size < positions.size:
            return positions, differ  # a shift explains at most a minority: chance equalities of skewed routing, not a shift
        result.shift = best
        rows = differ[best_hits]
        self.add(result, "shifted", int(rows.sum()), rows.sum(0))
        differ = differ.copy()
        differ[best_hits] = False
        return np.flatnonzero(differ.any(-1)), differ

    def foreign_pass(self, results: dict[str, RequestAudit]) -> None:
        """Second read of the trace: unexplained rows that are another request's rows at the same positions."""
        if not self.unexplained:
            return
        found: dict[str, dict[str, np.ndarray]] = {rid: {} for rid in self.unexplained}  # request -> other -> [u] explained
        if self.on("foreign"):
            # (position, returned row) -> the unexplained rows holding it: one lookup per recorded row, O(rows) in all
            index: dict[tuple[int, bytes], list[tuple[str, int]]] = {}
            for rid, (positions, sa, _differ) in self.unexplained.items():
                for i, (position, row) in enumerate(zip(positions.tolist(), sa, strict=True)):
                    index.setdefault((position, row.tobytes()), []).append((rid, i))
            wanted = np.unique(np.fromiter((p for p, _ in index), dtype=np.int64, count=len(index)))
            for other, rows in self.recorded.requests():
                s_other = _sets(rows)
                for position in wanted[wanted < s_other.shape[0]].tolist():
                    for rid, i in index.get((position, s_other[position].tobytes()), ()):
                        if rid != other:
                            hits = found[rid].setdefault(other, np.zeros(self.unexplained[rid][0].size, dtype=bool))
                            hits[i] = True
        for rid, (positions, _sa, differ) in self.unexplained.items():
            result = results[rid]
            left = np.ones(positions.size, dtype=bool)
            for other, hit in sorted(found[rid].items(), key=lambda item: -int(item[1].sum())):
                take = hit & left
                if 2 * int(take.sum()) >= positions.size:  # another request's rows: most of what is unexplained, not a chance equality
                    result.foreign_of.append(other)
                    rows = differ[take]
                    self.add(result, "foreign", int(rows.sum()), rows.sum(0))
                    left &= ~take
            rows = differ[left]
            self.add(result, "mismatch", int(rows.sum()), rows.sum(0))


def audit_routes(
    returned: RouteSet,
    recorded: RecordedSource,
    *,
    weight_version: str | None = None,
    checks: Iterable[str] = FAULTS,
) -> AuditReport:
    """Audit ``returned`` routes against the ``recorded`` ones (see the module docstring).

    Args:
        returned: the routes the engine handed back, per request (logical or physical
            ids with their map; over the MoE layers or every model layer).
        recorded: the recorder's routes of the same run (:class:`RecordedSource`).
        weight_version: the weight version the routes must come from (``None``: not checked).
        checks: the faults to look for (default: all of :data:`FAULTS`).

    Raises:
        AuditError: routes of another top-k, expert count or layer layout.
    """
    checks = tuple(checks)
    unknown = sorted(set(checks) - set(FAULTS))
    if unknown:
        raise AuditError(f"unknown checks {unknown}; known: {list(FAULTS)}")
    try:
        logical = returned.logical()
    except RoutesError as exc:
        raise AuditError(str(exc)) from None
    if logical.num_experts is not None and logical.num_experts != recorded.num_experts:
        raise AuditError(f"the returned routes are for {logical.num_experts} experts, the trace's model has {recorded.num_experts}")
    audit = _Audit(recorded, checks)
    results, prepared = audit.prepare(logical, weight_version)
    recorded_only = 0
    seen: set[str] = set()
    for rid, rows in recorded.requests():
        if rows.ndim != 3 or rows.shape[1:] != (len(recorded.layer_ids), recorded.top_k):
            raise AuditError(f"recorded request {rid!r} has routes {list(rows.shape)}, not [T, {len(recorded.layer_ids)}, {recorded.top_k}]")
        if rid in seen:
            raise AuditError(f"{recorded.describe}: request {rid!r} appears twice; group a request's rows under one id")
        seen.add(rid)
        if rid not in prepared:
            recorded_only += 1
            continue
        audit.compare(results[rid], prepared[rid], rows)
    for rid in prepared.keys() - seen:
        audit.add(results[rid], "unrecorded_request", 1)
    audit.foreign_pass(results)
    return AuditReport(
        requests=list(results.values()), layer_ids=recorded.layer_ids, compared=audit.compared, matched=audit.matched,
        layer_faults={name: rows for name, rows in audit.layer_faults.items() if name in checks},
        recorded_only=recorded_only, checks=checks, expected_weight_version=weight_version, run_id=recorded.run_id,
        sources={"recorded": recorded.describe},
    )
