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
- ranks whose routers see the same tokens (TP attention: every rank of the TP group; SGLang's DP
  attention with the MoE input gathered) hold replicas of one view: the rows of the counted rank
  of each token group (its lowest rank present, ``docs/trace-format.md``, "What a rank row means")
  are read, as every count of the trace counts them, and the replicas' are not (a replica's per-rank
  file is not opened for rows when its group's counted rank is given too; a merged trace's replica
  rows are skipped). An engine answers a request from its first TP rank, the counted one;
- ids are as the trace stores them (its ``id_space``; ``-2`` marks an id outside the expert range).

Memory: the rows of the requests asked for (one request with ``request_id``), read chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from .reader import Trace, open_trace
from .schema import Data, TraceError

__all__ = ["counted_traces", "has_request_rows", "request_routes"]


def has_request_rows(trace: Trace) -> bool:
    """Whether ``trace``'s token rows are tied to their requests."""
    return trace.has(Data.TOKENS_REQUEST)


def _opened(traces: Trace | Path | str | Iterable[Trace | Path | str], stack: ExitStack) -> Iterator[Trace]:
    items = [traces] if isinstance(traces, (Trace, Path, str)) else list(traces)
    if not items:
        raise TraceError("no trace given: request_routes needs one or more per_token traces")
    for item in items:
        yield item if isinstance(item, Trace) else stack.enter_context(open_trace(item))


def counted_traces(traces: list[Trace]) -> list[Trace]:
    """The traces that hold a counted rank (:meth:`Trace.counted`) of the ranks they describe together:
    the per-rank file of a replica rank (TP attention) is left out when its token group's lowest rank
    is among ``traces``; traces without a layout are all kept."""
    lowest: dict[int, int] = {}
    for trace in traces:
        for layout in trace.layouts:
            lowest[layout.token_group] = min(lowest.get(layout.token_group, layout.rank), layout.rank)
    counted = set(lowest.values())
    return [t for t in traces if not t.layouts or any(layout.rank in counted for layout in t.layouts)]


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
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (request key, position, ids) per chunk
    shape: tuple[int, int] | None = None
    with ExitStack() as stack:
        opened = list(_opened(traces, stack))
        for trace in opened:
            if trace.mode != "per_token" or not has_request_rows(trace):
                raise TraceError(
                    f"{trace.path}: its token rows carry no request ids (mode {trace.mode!r}); record in per_token mode "
                    "through an adapter that gives the engine's batch (recorder.with_forward_pass(batch=...))"
                )
        for trace in counted_traces(opened):
            table = trace.request_table()
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
            for rows in trace.iter_tokens(chunk, counted_only=True):  # a merged trace's replica rows are skipped
                assert rows.request is not None and rows.request_position is not None
                known = rows.request >= 0
                key = np.full(len(known), -1, dtype=np.int64)
                key[known] = keys[rows.request[known]]
                take = key >= 0
                if take.any():
                    parts.append((key[take], rows.request_position[take].astype(np.int64), rows.topk_ids[take]))
                shape = tuple(rows.topk_ids.shape[1:])  # type: ignore[assignment]
    if request_id is not None and not names:
        raise TraceError(f"request {request_id!r} has no token rows in the trace(s) given")
    return _assemble(parts, names, shape)


def _assemble(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], names: dict[str, int],
              shape: tuple[int, int] | None) -> dict[str, np.ndarray]:
    """Group the rows by request, place them by position, latest row per (position, layer) wins."""
    out: dict[str, np.ndarray] = {}
    if not parts:
        return {rid: np.full((0, *(shape or (0, 0))), -1, dtype=np.int64) for rid in names}
    key = np.concatenate([p[0] for p in parts])
    position = np.concatenate([p[1] for p in parts])
    ids = np.concatenate([p[2] for p in parts])
    order = np.argsort(key, kind="stable")  # rows of one request together, in reading order
    key, position, ids = key[order], position[order], ids[order]
    bounds = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(key)]])
    by_key = {k: rid for rid, k in names.items()}
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        out[by_key[int(key[a])]] = _place(position[a:b], ids[a:b])
    for rid in names:
        out.setdefault(rid, np.full((0, *ids.shape[1:]), -1, dtype=np.int64))
    return out


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
