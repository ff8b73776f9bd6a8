"""Routing divergence: do two runs send the same tokens to the same experts?

The library form works on in-memory routes (for RL loops)::

    from moetrace.analysis.divergence import route_divergence
    d = route_divergence(rollout_routes, training_routes)     # [T, L, k] each, logical ids, -1 = none
    d.set_agreement            # [L] share of tokens whose top-k set is identical
    d.tokens_any_differ        # share of tokens with at least one differing layer

and :func:`diff_sources` aligns two files (``moetrace diff A B``): two
``per_token`` traces by ``(pass, rank, position)``, or two per-request routes
files / wire payloads (:mod:`moetrace.routes`) by ``(request, position)``.

Definitions (one each; docs/divergence.md). A ``(token, layer)`` pair is
*compared* when both sides hold ``k`` ids for it (``-1`` rows — padding,
dense layers, positions without routes — are left out and counted apart).
Per layer: **set agreement** = share of compared tokens with the same top-k
set; **order agreement** = share with the same id in every slot; **Jaccard**
= mean ``|A ∩ B| / |A ∪ B|``; **divergent experts** = for each expert, the
compared tokens whose two sets disagree about it (in A only: *dropped*, in B
only: *added*). Overall: **router agreement** = share of compared pairs with
the same set; **tokens_any_differ** = share of tokens (with at least one
compared layer) whose set differs in at least one layer; **differing layers
histogram** ``[L + 1]`` = tokens by how many of their layers differ (the R3
paper's "routers per token that differ").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..replay_audit import ReplayAuditReport
from ..routes import RoutesError, RouteSet, check_routes, load_routes, logical_ids, routed_rows
from ..trace.schema import Attr, Data

__all__ = [
    "DivergenceAccumulator",
    "DivergenceError",
    "RouteDivergence",
    "diff_sources",
    "replay_audit",
    "route_divergence",
]


class DivergenceError(ValueError):
    """Two sets of routes that cannot be compared; the message says why and what to do."""


@dataclasses.dataclass
class RouteDivergence:
    """Divergence of routes B against routes A over ``L`` layers (arrays indexed by layer).

    Attributes:
        num_layers, top_k: ``L`` and ``k``.
        tokens: tokens with at least one compared layer.
        layer_tokens: ``[L]`` compared tokens per layer (0 for a dense layer).
        set_agreement, order_agreement, jaccard: ``[L]`` (NaN where nothing was compared).
        dropped, added: ``[L, E]`` per expert, compared tokens with the expert in A only / in B only.
        router_agreement: share of compared ``(token, layer)`` pairs with the same set.
        tokens_any_differ: share of ``tokens`` with at least one differing layer.
        differing_layers: ``[L + 1]`` tokens by number of differing layers.
        layer_ids: model layer id of each layer, when known.
        alignment: how the two sides were matched (counts of unmatched rows etc.).
        same_set_rows: ``[L]`` compared rows with the same set (the agreement's numerator).
        only_a_rows: ``[L]`` aligned rows routed in A whose B row is ``-1``.
    """

    num_layers: int
    top_k: int
    tokens: int
    layer_tokens: np.ndarray
    set_agreement: np.ndarray
    order_agreement: np.ndarray
    jaccard: np.ndarray
    dropped: np.ndarray
    added: np.ndarray
    router_agreement: float
    tokens_any_differ: float
    differing_layers: np.ndarray
    layer_ids: list[int] | None = None
    alignment: dict[str, Any] = dataclasses.field(default_factory=dict)
    same_set_rows: np.ndarray | None = None
    only_a_rows: np.ndarray | None = None

    def top_divergent(self, layer: int, n: int = 5) -> list[dict[str, int]]:
        """The ``n`` experts of ``layer`` most often in one set and not the other (ties: lower id first)."""
        total = self.dropped[layer] + self.added[layer]
        order = np.lexsort((np.arange(total.size), -total))
        return [
            {"expert": int(e), "tokens": int(total[e]), "dropped": int(self.dropped[layer, e]), "added": int(self.added[layer, e])}
            for e in order[:n] if total[e] > 0
        ]

    def to_dict(self, top: int = 5) -> dict[str, Any]:
        """Plain JSON-ready figures (NaN as ``None``)."""

        def num(x: float) -> float | None:
            return None if math.isnan(x) else float(x)

        layers = []
        for layer in range(self.num_layers):
            layers.append({
                "layer": layer,
                "layer_id": None if self.layer_ids is None else int(self.layer_ids[layer]),
                "tokens": int(self.layer_tokens[layer]),
                "set_agreement": num(self.set_agreement[layer]),
                "order_agreement": num(self.order_agreement[layer]),
                "jaccard": num(self.jaccard[layer]),
                "top_divergent_experts": self.top_divergent(layer, top),
            })
        return {
            "num_layers": self.num_layers,
            "top_k": self.top_k,
            "tokens": self.tokens,
            "router_agreement": num(self.router_agreement),
            "tokens_any_differ": num(self.tokens_any_differ),
            "differing_layers_histogram": self.differing_layers.astype(int).tolist(),
            "layers": layers,
            "alignment": self.alignment,
        }


class DivergenceAccumulator:
    """Additive divergence counts over chunks of aligned routes ``[T, L, k]`` (logical ids, ``-1`` = none)."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int | None = None) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        experts = num_experts or 1
        self.layer_tokens = np.zeros(num_layers, dtype=np.int64)
        self.same_set = np.zeros(num_layers, dtype=np.int64)
        self.same_order = np.zeros(num_layers, dtype=np.int64)
        self.jaccard_sum = np.zeros(num_layers, dtype=np.float64)
        self.dropped = np.zeros((num_layers, experts), dtype=np.int64)
        self.added = np.zeros((num_layers, experts), dtype=np.int64)
        self.differing = np.zeros(num_layers + 1, dtype=np.int64)
        self.only_a = np.zeros(num_layers, dtype=np.int64)

    def _grow(self, experts: int) -> None:
        if experts > self.dropped.shape[1]:
            pad = ((0, 0), (0, experts - self.dropped.shape[1]))
            self.dropped, self.added = np.pad(self.dropped, pad), np.pad(self.added, pad)

    def _per_expert(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``[L, E]`` counts of ``ids [T, L, k]`` where ``mask [T, L, k]``."""
        experts = self.dropped.shape[1]
        layer = np.broadcast_to(np.arange(self.num_layers).reshape(1, -1, 1), ids.shape)
        flat = (layer * experts + ids)[mask]
        return np.bincount(flat, minlength=self.num_layers * experts).reshape(self.num_layers, experts)

    def update(self, a: np.ndarray, b: np.ndarray) -> None:
        """Add aligned rows ``a``, ``b`` (``[T, L, k]``, same shape, checked with :func:`check_routes`)."""
        if a.shape != b.shape or a.ndim != 3 or a.shape[1:] != (self.num_layers, self.top_k):
            raise DivergenceError(f"aligned routes must both be [T, {self.num_layers}, {self.top_k}], got {list(a.shape)} and {list(b.shape)}")
        if a.size == 0:
            return
        self._grow(int(max(a.max(), b.max())) + 1)
        in_a_rows = routed_rows(a)
        both = in_a_rows & routed_rows(b)  # [T, L]
        self.only_a += (in_a_rows & ~both).sum(0)
        in_b = (a[..., :, None] == b[..., None, :]).any(-1)  # [T, L, k]: a's slot id also in b
        in_a = (b[..., :, None] == a[..., None, :]).any(-1)
        inter = in_b.sum(-1)
        same_set = both & (inter == self.top_k)
        self.layer_tokens += both.sum(0)
        self.same_set += same_set.sum(0)
        self.same_order += (both & (a == b).all(-1)).sum(0)
        self.jaccard_sum += np.where(both, inter / (2 * self.top_k - inter), 0.0).sum(0)
        self.dropped += self._per_expert(a, ~in_b & both[..., None])
        self.added += self._per_expert(b, ~in_a & both[..., None])
        counted = both.any(-1)
        differ = (both & ~same_set).sum(-1)
        self.differing += np.bincount(differ[counted], minlength=self.num_layers + 1)

    def result(self, layer_ids: list[int] | None = None, alignment: dict[str, Any] | None = None) -> RouteDivergence:
        """The figures so far."""
        with np.errstate(invalid="ignore", divide="ignore"):
            seen = self.layer_tokens.astype(np.float64)
            pairs = float(self.layer_tokens.sum())
            tokens = int(self.differing.sum())
            return RouteDivergence(
                num_layers=self.num_layers, top_k=self.top_k, tokens=tokens, layer_tokens=self.layer_tokens.copy(),
                set_agreement=self.same_set / seen, order_agreement=self.same_order / seen, jaccard=self.jaccard_sum / seen,
                dropped=self.dropped.copy(), added=self.added.copy(),
                router_agreement=float(self.same_set.sum()) / pairs if pairs else math.nan,
                tokens_any_differ=float(self.differing[1:].sum()) / tokens if tokens else math.nan,
                differing_layers=self.differing.copy(), layer_ids=layer_ids, alignment=dict(alignment or {}),
                same_set_rows=self.same_set.copy(), only_a_rows=self.only_a.copy(),
            )


def route_divergence(a: Any, b: Any, *, num_experts: int | None = None, layer_ids: list[int] | None = None) -> RouteDivergence:
    """Divergence of routes ``b`` against ``a``: ``[T, L, k]`` (or ``[B, S, L, k]``) arrays of logical ids, ``-1`` = none.

    Torch tensors and numpy arrays are accepted (read on the host).

    Raises:
        DivergenceError: different shapes, or invalid routes (see :func:`moetrace.routes.check_routes`).
    """
    try:
        ra, rb = check_routes(a, num_experts, "routes A"), check_routes(b, num_experts, "routes B")
    except RoutesError as exc:
        raise DivergenceError(str(exc)) from None
    if ra.shape != rb.shape:
        raise DivergenceError(
            f"routes A {list(ra.shape)} and B {list(rb.shape)} differ in shape; align them first (same tokens, "
            "layers and top_k; pad missing positions with -1)"
        )
    if layer_ids is not None and len(layer_ids) != ra.shape[-2]:
        raise DivergenceError(f"layer_ids names {len(layer_ids)} layers but the routes have {ra.shape[-2]}")
    acc = DivergenceAccumulator(ra.shape[-2], ra.shape[-1], num_experts)
    acc.update(ra.reshape(-1, *ra.shape[-2:]), rb.reshape(-1, *rb.shape[-2:]))
    return acc.result(layer_ids)


# ---------------------------------------------------------------------------- files


def _is_trace(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(8) == b"\x89HDF\r\n\x1a\n"


def _check_same(what: str, a: Any, b: Any, hint: str) -> None:
    if a != b:
        raise DivergenceError(f"the two inputs have different {what} ({a!r} vs {b!r}); {hint}")


def _trace_keys(trace: Any, chunk: int) -> np.ndarray:
    """One int64 key per ``/tokens`` row: pass id, rank (merged traces) and position.

    Read through :meth:`Trace.iter_tokens`, so every row is also held to ``/stat`` before any is
    compared (the ids are then read again, only the matched rows).
    """
    parts = [(c.pass_id.astype(np.int64), c.position.astype(np.int64)) for c in trace.iter_tokens(chunk)]
    pass_id = np.concatenate([np.zeros(0, np.int64), *(p for p, _ in parts)])
    position = np.concatenate([np.zeros(0, np.int64), *(q for _, q in parts)])
    rank = trace.read_tokens("rank").astype(np.int64) if trace.has(Data.TOKENS_RANK) else np.zeros_like(pass_id)
    return (pass_id << 40) | (rank << 32) | position


def _diff_traces(path_a: Path, path_b: Path, ignore_model: bool, chunk: int) -> RouteDivergence:
    from ..trace.reader import open_trace

    with open_trace(path_a) as ta, open_trace(path_b) as tb:
        for trace in (ta, tb):
            if trace.mode != "per_token":
                raise DivergenceError(f"{trace.path}: mode {trace.mode!r} has no per-token routes; record with mode='per_token'")
        if not ignore_model:
            _check_same("models", ta.attrs.get(Attr.MODEL, ""), tb.attrs.get(Attr.MODEL, ""), "compare runs of one model, or pass --ignore-model if they are the same model under two names")
        _check_same("top_k", ta.top_k, tb.top_k, "routes of different top-k cannot be compared")
        _check_same("MoE layers (model layer ids)", ta.layers.tolist(), tb.layers.tolist(), "the traces come from different models or layer layouts")
        _check_same("logical expert counts (id spaces)", ta.num_logical_experts, tb.num_logical_experts, "the traces come from different models")
        keys_a, keys_b = _trace_keys(ta, chunk), _trace_keys(tb, chunk)
        for trace, keys in ((ta, keys_a), (tb, keys_b)):
            if np.unique(keys).size != keys.size:
                raise DivergenceError(f"{trace.path}: (pass, rank, position) repeats; a merged trace needs its rank column")
        _, ia, ib = np.intersect1d(keys_a, keys_b, assume_unique=True, return_indices=True)
        if ia.size == 0:
            raise DivergenceError(
                "no token of one trace has the same (pass, position) in the other; record both runs with the same "
                "batches and passes, or compare per-request routes files instead"
            )
        maps = (ta.physical_to_logical, tb.physical_to_logical)
        acc = DivergenceAccumulator(ta.num_layers, ta.top_k, ta.num_logical_experts)
        for start in range(0, ia.size, chunk):
            rows = []
            for trace, idx, mapping in ((ta, ia, maps[0]), (tb, ib, maps[1])):
                sel = idx[start : start + chunk]
                lo, hi = int(sel.min()), int(sel.max()) + 1
                block = trace.read_tokens("topk_ids", lo, hi - lo).astype(np.int64)[sel - lo]
                block = np.where(block < -1, -1, block)  # -2 marks an invalid id: not routable, left out
                rows.append(logical_ids(block, mapping))
            acc.update(rows[0], rows[1])
        alignment = {
            "by": "pass and position", "matched_tokens": int(ia.size),
            "only_in_a": int(keys_a.size - ia.size), "only_in_b": int(keys_b.size - ib.size),
        }
        return acc.result(ta.layers.tolist(), alignment)


def _load_set(path: Path) -> RouteSet:
    try:
        return load_routes(path).logical()
    except RoutesError as exc:
        raise DivergenceError(str(exc)) from None


def _aligned_requests(sa: RouteSet, sb: RouteSet) -> Iterator[tuple[np.ndarray, np.ndarray, int, int]]:
    """``(a rows, b rows, only in a, only in b)`` per request in both sets, over their common positions."""
    for rid in sorted(set(sa.requests) & set(sb.requests)):
        (start_a, ra), (start_b, rb) = sa.requests[rid], sb.requests[rid]
        lo, hi = max(start_a, start_b), min(start_a + len(ra), start_b + len(rb))
        hi = max(hi, lo)
        yield ra[lo - start_a : hi - start_a], rb[lo - start_b : hi - start_b], len(ra) - (hi - lo), len(rb) - (hi - lo)


def _diff_route_sets(path_a: Path, path_b: Path, ignore_model: bool) -> RouteDivergence:
    sa, sb = _load_set(path_a), _load_set(path_b)
    if not ignore_model and sa.model and sb.model:
        _check_same("models", sa.model, sb.model, "compare runs of one model, or pass --ignore-model if they are the same model under two names")
    if sa.layer_ids is not None and sb.layer_ids is not None:
        _check_same("layer ids", sa.layer_ids, sb.layer_ids, "the routes come from different models or layer layouts")
    if sa.num_experts is not None and sb.num_experts is not None:
        _check_same("expert counts (id spaces)", sa.num_experts, sb.num_experts, "the routes come from different models")
    shape_a = {arr.shape[1:] for _, arr in sa.requests.values()}
    shape_b = {arr.shape[1:] for _, arr in sb.requests.values()}
    if len(shape_a | shape_b) != 1:
        raise DivergenceError(
            f"per-token shapes [layers, top_k] differ: {sorted(map(list, shape_a))} in {path_a} vs {sorted(map(list, shape_b))} in "
            f"{path_b}; both must hold the same layers (model layers with -1 for dense ones, or MoE layers only) and top_k"
        )
    num_layers, top_k = shape_a.pop()
    common = set(sa.requests) & set(sb.requests)
    if not common:
        raise DivergenceError(f"no request id is in both inputs ({sorted(sa.requests)[:5]}... vs {sorted(sb.requests)[:5]}...)")
    experts = max(x for x in (sa.num_experts, sb.num_experts, 1) if x is not None)
    acc = DivergenceAccumulator(num_layers, top_k, experts)
    only_a = only_b = matched = 0
    for ra, rb, left_a, left_b in _aligned_requests(sa, sb):
        acc.update(ra, rb)
        matched, only_a, only_b = matched + len(ra), only_a + left_a, only_b + left_b
    alignment = {
        "by": "request and position", "requests": len(common), "matched_tokens": matched,
        "only_in_a": only_a + sum(len(sa.requests[r][1]) for r in set(sa.requests) - common),
        "only_in_b": only_b + sum(len(sb.requests[r][1]) for r in set(sb.requests) - common),
        "requests_only_in_a": len(set(sa.requests) - common), "requests_only_in_b": len(set(sb.requests) - common),
    }
    return acc.result(sa.layer_ids or sb.layer_ids, alignment)


def diff_sources(path_a: Path | str, path_b: Path | str, *, ignore_model: bool = False, chunk: int = 65536) -> RouteDivergence:
    """Divergence of ``path_b``'s routes against ``path_a``'s.

    Two ``per_token`` traces are aligned by ``(pass, rank, position)``; two
    routes files / wire payloads / ``.npy`` arrays by ``(request id, position)``.
    Physical ids are mapped to logical ones with each side's map.

    Raises:
        DivergenceError: a trace and a routes file, different models, layers,
            top-k or expert counts, or nothing in common.
        TraceError: a trace that cannot be read.
    """
    a, b = Path(path_a), Path(path_b)
    for path in (a, b):
        if not path.is_file():
            raise DivergenceError(f"{path}: no such file")
    kinds = (_is_trace(a), _is_trace(b))
    if kinds == (True, True):
        return _diff_traces(a, b, ignore_model, chunk)
    if kinds == (False, False):
        return _diff_route_sets(a, b, ignore_model)
    raise DivergenceError(
        "one input is a trace and the other a routes file; compare two per_token traces (aligned by pass and "
        "position) or two per-request routes files (aligned by request and position)"
    )


def replay_audit(result: RouteDivergence) -> ReplayAuditReport:
    """Read a diff of A = the routes a replay requested against B = the routes the replayed run used as a replay audit.

    Requested rows are the rows routed in A (aligned with B); matched ones have the
    same set in B. A layer routed in A with no routes at all in B is *unreached*.
    Positions of A missing from B (``alignment["only_in_a"]``) are in ``extra``.
    """
    if result.same_set_rows is None or result.only_a_rows is None:
        raise DivergenceError("this divergence result carries no row counts; compute it with route_divergence or diff_sources")
    names = [str(i) if result.layer_ids is None else f"{i} (model {result.layer_ids[i]})" for i in range(result.num_layers)]
    requested = result.layer_tokens + result.only_a_rows
    unreached = tuple(name for name, seen, asked in zip(names, result.layer_tokens, requested, strict=True) if asked and not seen)
    extra = {"positions_only_in_requested": int(result.alignment.get("only_in_a", 0))}
    return ReplayAuditReport(tuple(names), requested.astype(np.int64), result.same_set_rows.astype(np.int64), unreached, extra=extra)
