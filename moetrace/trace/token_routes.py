"""Every request's routes from a ``per_token`` trace alone: ``[T, L, k]`` per engine request id.

A ``per_token`` trace recorded with the engine's batches (:class:`moetrace.batch.PassBatch`)
ties each token row to its request and position (``/tokens/request``,
``/tokens/request_position``, ``/request_table/id``). :func:`request_routes` turns the rows
back into per-request routes, the shape the engine returns with a response (SGLang's
``return_routed_experts``, vLLM's routed experts, moetrace's capturer):

- ``T`` is one past the highest position any pass computed for the request; positions no
  pass computed (a prefix-cache hit, a chunk recorded in another trace) are rows of ``-1``;
- a position computed more than once (preemption and recomputation, the stages of a pipeline
  that each route some layers) keeps, per layer, the latest row that routed that layer, in the
  order given (traces in order, rows in pass order);
- ranks whose routers see the same tokens (one token group: TP attention's TP group, SGLang's DP
  attention with the MoE input gathered over it) hold replicas of one view: a request's rows are
  read from the lowest rank of the group that holds rows of that request. Under TP attention every
  rank labels every row, so that is the counted rank (``docs/trace-format.md``, "What a rank row
  means"), the one an engine answers from; with a gathered MoE input each rank labels its own
  requests' rows only, so each request comes from its own rank. A replica's per-rank file whose
  requests a lower rank of its group holds is not read for rows; in a merged trace the rows are
  chosen by their ``rank`` column;
- ids are as the trace stores them (its ``id_space``; ``-2`` marks an id outside the expert range).

Memory: the rows of the requests asked for (one request with ``request_id``), read chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from .reader import TokenChunk, Trace, open_trace
from .schema import Data, TraceError

__all__ = ["has_request_rows", "request_routes"]


def has_request_rows(trace: Trace) -> bool:
    """Whether ``trace``'s token rows are tied to their requests."""
    return trace.has(Data.TOKENS_REQUEST)


def _opened(traces: Trace | Path | str | Iterable[Trace | Path | str], stack: ExitStack) -> Iterator[Trace]:
    items = [traces] if isinstance(traces, (Trace, Path, str)) else list(traces)
    if not items:
        raise TraceError("no trace given: request_routes needs one or more per_token traces")
    for item in items:
        yield item if isinstance(item, Trace) else stack.enter_context(open_trace(item))


def _skipped(traces: list[Trace], tables: list[np.ndarray]) -> list[bool]:
    """Which per-rank traces hold no request that a lower rank of their token group does not hold too:
    none of their rows would be read (a TP-attention replica's file), so they are not read at all."""
    ids = [set(map(str, table)) for table in tables]
    single = [len(trace.layouts) == 1 and not trace.has(Data.TOKENS_RANK) for trace in traces]  # a per-rank file
    held: dict[int, list[tuple[int, set[str]]]] = {}  # token group -> [(rank, its request ids)]
    for trace, mine, one in zip(traces, ids, single, strict=True):
        if one:
            held.setdefault(trace.layouts[0].token_group, []).append((trace.layouts[0].rank, mine))
    skip = []
    for trace, mine, one in zip(traces, ids, single, strict=True):
        if not one:
            skip.append(False)
            continue
        layout = trace.layouts[0]
        skip.append(mine <= set().union(*(others for rank, others in held[layout.token_group] if rank < layout.rank)))
    return skip


def _sources(trace: Trace, rows: TokenChunk) -> tuple[np.ndarray, np.ndarray]:
    """``(rank [M], token group [M])`` of the rows ``rows`` of ``trace`` (0, 0 without a layout)."""
    layouts, count = trace.layouts, len(rows.pass_id)
    if not layouts:
        return np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
    if rows.rank is None:
        return np.full(count, layouts[0].rank, dtype=np.int64), np.full(count, layouts[0].token_group, dtype=np.int64)
    rank = rows.rank.astype(np.int64)
    ranks = np.array([layout.rank for layout in layouts], dtype=np.int64)
    groups = np.array([layout.token_group for layout in layouts], dtype=np.int64)
    order = np.argsort(ranks)
    return rank, groups[order][np.searchsorted(ranks[order], rank)]


def request_routes(traces: Trace | Path | str | Iterable[Trace | Path | str], request_id: str | None = None,
                   chunk: int = 65536, *, request_ids: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """Per-request routes ``{request id: [T, L, k] int64}`` from ``per_token`` traces.

    Args:
        traces: one trace (open or a path) or several (the per-rank files of one run, or
            consecutive dumps); rows are combined in the order given.
        request_id: only this engine request id (its rows alone are held in memory).
        chunk: token rows read at a time.
        request_ids: only these requests (those of them with rows; a group at a time keeps
            memory bounded: ``moetrace audit`` reads a run's requests in groups).

    Raises:
        TraceError: a trace is not ``per_token``, or its rows carry no requests (recorded
            without the engine's batch, or before request rows existed); ``request_id`` is
            in none of them.
    """
    names: dict[str, int] = {}
    parts: list[tuple[np.ndarray, ...]] = []  # (request key, position, ids, rank, token group) per chunk
    shape: tuple[int, int] | None = None
    with ExitStack() as stack:
        opened = list(_opened(traces, stack))
        for trace in opened:
            if trace.mode != "per_token" or not has_request_rows(trace):
                raise TraceError(
                    f"{trace.path}: its token rows carry no request ids (mode {trace.mode!r}); record in per_token mode "
                    "through an adapter that gives the engine's batch (recorder.with_forward_pass(batch=...))"
                )
        tables = [trace.request_table() for trace in opened]
        for trace, table, skip in zip(opened, tables, _skipped(opened, tables), strict=True):
            if skip:
                continue
            if request_ids is not None:
                wanted = set(request_ids)
                keys = np.fromiter((names.setdefault(t, len(names)) if t in wanted else -1 for t in map(str, table)),
                                   dtype=np.int64, count=len(table))
            elif request_id is None:
                keys = np.fromiter((names.setdefault(str(t), len(names)) for t in table), dtype=np.int64, count=len(table))
            else:
                keys = np.where(table == request_id, 0, -1).astype(np.int64)
                if (keys == 0).any():
                    names.setdefault(request_id, 0)
            for rows in trace.iter_tokens(chunk):
                assert rows.request is not None and rows.request_position is not None
                known = rows.request >= 0
                key = np.full(len(known), -1, dtype=np.int64)
                key[known] = keys[rows.request[known]]
                take = key >= 0
                if take.any():
                    rank, group = _sources(trace, rows)
                    parts.append((key[take], rows.request_position[take].astype(np.int64), rows.topk_ids[take], rank[take], group[take]))
                shape = tuple(rows.topk_ids.shape[1:])  # type: ignore[assignment]
    if request_id is not None and not names:
        raise TraceError(f"request {request_id!r} has no token rows in the trace(s) given")
    return _assemble(parts, names, shape)


def _assemble(parts: list[tuple[np.ndarray, ...]], names: dict[str, int], shape: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """Group the rows by request, keep each token group's lowest rank holding the request, place them by
    position, latest row per (position, layer) wins."""
    out: dict[str, np.ndarray] = {}
    if not parts:
        return {rid: np.full((0, *(shape or (0, 0))), -1, dtype=np.int64) for rid in names}
    key, position, ids, rank, group = (np.concatenate([p[i] for p in parts]) for i in range(5))
    order = np.argsort(key, kind="stable")  # rows of one request together, in reading order
    key, position, ids, rank, group = key[order], position[order], ids[order], rank[order], group[order]
    bounds = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(key)]])
    by_key = {k: rid for rid, k in names.items()}
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        keep = _lowest_rank_rows(rank[a:b], group[a:b])
        out[by_key[int(key[a])]] = _place(position[a:b][keep], ids[a:b][keep])
    for rid in names:
        out.setdefault(rid, np.full((0, *ids.shape[1:]), -1, dtype=np.int64))
    return out


def _lowest_rank_rows(rank: np.ndarray, group: np.ndarray) -> slice | np.ndarray:
    """Rows of one request ``[n]`` that come from the lowest rank of their token group holding it."""
    if rank.min() == rank.max():
        return slice(None)
    keep = np.zeros(len(rank), dtype=bool)
    for g in np.unique(group):
        mine = group == g
        keep |= mine & (rank == rank[mine].min())
    return keep


def _place(position: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[T, L, k]``: each layer's latest routed row at each position (``-1`` where none)."""
    routes = np.full((int(position.max()) + 1, *ids.shape[1:]), -1, dtype=np.int64)
    routed = ids[:, :, 0] != -1  # [n, L]: rows of a layer the pass did not route stay out
    for layer in range(ids.shape[1]):
        rows = np.flatnonzero(routed[:, layer])
        if not len(rows):
            continue
        # the last row of each position: unique over the reversed order finds it first
        _, first = np.unique(position[rows][::-1], return_index=True)
        last = rows[len(rows) - 1 - first]
        routes[position[last], layer] = ids[last, layer]
    return routes
