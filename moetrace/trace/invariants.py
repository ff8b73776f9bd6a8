"""The invariants every moetrace trace satisfies, checked when it is read.

A violated invariant raises :class:`~moetrace.trace.schema.TraceError` naming the dataset
and the figures that disagree, so a damaged trace (or an older one without checksums)
is never answered with numbers. Shapes: ``R`` rank rows (``world_size`` in a gathered or
merged trace, else 1), ``L`` MoE layers, ``P`` physical / ``E`` logical experts, ``k`` top-k,
``R_ep`` EP ranks, ``W`` window slots, ``N`` / ``M`` streamed pass / token rows.

- :func:`check_layout` (on open; shapes and a few small datasets): every dataset's shape
  against the root attributes and the rank layout, streamed columns of equal length,
  ``/layers`` distinct and non-negative, ``/physical_to_logical`` within ``[0, E)``,
  streamed rows against the ``/stat`` totals of passes and tokens.
- :func:`check_stat` (the first time ``/stat`` or ``/window`` is read): logical counts
  equal the physical counts summed through the map; each layer's assignments (experts +
  invalid ids) at most ``tokens x k``, and with padding a multiple of ``k``; the window within the totals, its pass ids
  increasing and its timestamps non-decreasing; :func:`check_pass_requests` on its slots.
- :func:`check_pass_requests` (the window, and ``/passes`` as it is iterated): each pass's request
  count against its pass phase (:data:`moetrace.pass_phase.REQUESTS_RULE`), empty window slots
  phase ``unknown`` with -1: a run of ``-1`` turned into ``0``, which HDF5's Fletcher-32 cannot
  see, breaks it.
- :class:`RowOrder` (as ``/passes`` and ``/tokens`` are iterated) and
  :func:`check_timing_rows`: pass ids non-decreasing, timestamps non-decreasing per rank.
- :class:`TokenTally` (every full read of ``/tokens``: :meth:`Trace.iter_tokens` and the row-range
  tasks of :mod:`moetrace.analysis.distributed`): the ids counted per rank, layer and slot equal
  ``/stat/physical_count`` (``-2``: ``/stat/invalid_ids``) once the last row is read, so a zeroed
  ``0xFFFF`` word of ids (two int8 or one int16 ``-1`` read as expert 0), which Fletcher-32 cannot
  see, is refused by every command that reads the rows.
- :func:`check_rows_against_stat` (``moetrace verify``; it reads every row): ``/passes``
  sums or ``/tokens`` counts per rank equal the ``/stat`` totals exactly (:func:`compare_with_stat`),
  and so do each pass phase's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..ids import to_logical
from ..pass_phase import PASS_PHASES, REQUESTS_RULE, UNKNOWN, requests_allowed
from .integrity import reading
from .schema import (
    MERGED_RANKS_ATTR,
    PADDING_IDS,
    PHASE_COUNTS,
    STREAM_GROUP,
    Attr,
    Data,
    TraceDamageError,
    dataset,
)

#: An open :class:`moetrace.trace.reader.Trace` (not imported: the reader imports this module).
OpenTrace = Any

__all__ = ["CHECK_CHUNK_BYTES", "RowOrder", "TokenTally", "check_layout", "check_pass_requests", "check_rows_against_stat", "check_stat",
           "check_timing_rows", "compare_totals", "compare_with_stat", "violation"]


def violation(path: Path | str, dataset: str, figures: str) -> TraceDamageError:
    """The error for a broken invariant: the file, the dataset, the figures, the remedy."""
    return TraceDamageError(
        path,
        f"{path}: {dataset} violates the trace's invariants: {figures}. The trace is damaged or was not written by "
        f"moetrace; run `moetrace verify {path}` to see what is intact, and dump or copy it again"
    )


def _rank_rows(trace: OpenTrace) -> int:
    attrs = trace.attrs
    if MERGED_RANKS_ATTR in attrs:
        return len(json.loads(str(attrs[MERGED_RANKS_ATTR])))
    return int(attrs[Attr.WORLD_SIZE]) if int(attrs[Attr.RANK]) < 0 else 1


def _expect(trace: OpenTrace, name: str, shape: tuple[int | None, ...]) -> None:
    """``/name`` (when present) has ``shape`` (``None``: any length on that axis)."""
    actual = trace.shape(name)
    if actual is None:
        return
    if len(actual) != len(shape) or any(e is not None and a != e for a, e in zip(actual, shape, strict=False)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise violation(trace.path, f"/{name}", f"shape {list(actual)}, but the root attributes and rank layout make it {want}")


def check_layout(trace: OpenTrace) -> None:
    """Shapes against the root attributes and rank layout; the small static datasets' values.

    Raises:
        TraceDamageError: naming the dataset and the figures.
    """
    if trace.mode == "routing":
        return
    L, P, E, k, ep = trace.num_layers, trace.num_physical_experts, trace.num_logical_experts, trace.top_k, trace.ep_size
    R = _rank_rows(trace)
    _expect(trace, "layers", (L,))
    _expect(trace, "physical_to_logical", (L, P))
    layers = trace.layers
    if len(np.unique(layers)) != len(layers) or (layers < 0).any():
        raise violation(trace.path, "/layers", f"layer ids {layers.tolist()} are not distinct non-negative model layers")
    mapping = trace.physical_to_logical
    if mapping.size and (mapping.min() < 0 or mapping.max() >= E):
        raise violation(trace.path, "/physical_to_logical", f"logical ids {int(mapping.min())}..{int(mapping.max())} outside [0, {E}) (num_logical_experts={E})")
    for name, shape in {
        "physical_count": (R, L, P), "logical_count": (R, L, E), "invalid_ids": (R, L), "padding_ids": (R, L),
        "dropped": (R, L), "send_count": (R, L, ep), "recv_count": (R, L, ep), "num_passes": (R,), "num_tokens": (R,),
        "dropped_passes": (R,),
    }.items():
        _expect(trace, dataset(Data.STAT, name), shape)
    Q = len(PASS_PHASES)
    _expect(trace, Data.STAT_PASS_PHASE_PHYSICAL_COUNT, (R, Q, L, P))
    for name in PHASE_COUNTS:
        _expect(trace, name, (R, Q))
    for name in ("pass_id", "timestamp", "num_tokens", "pass_phase", "num_requests"):
        _expect(trace, dataset(Data.WINDOW, name), (R, None))
    _expect(trace, Data.WINDOW_PHYSICAL_COUNT, (R, trace.shape(Data.WINDOW_PASS_ID)[1] if trace.has(Data.WINDOW_PASS_ID) else None, L, P))  # type: ignore[index]
    group = STREAM_GROUP.get(trace.mode)
    if group == Data.PASSES:
        n = trace.num_rows(Data.PASSES_PASS_ID)
        for name, shape in {"pass_id": (n,), "timestamp": (n,), "num_tokens": (n,), "physical_count": (n, L, P), "invalid_ids": (n, L),
                            "send_count": (n, L, ep), "recv_count": (n, L, ep), "rank": (n,), "pass_phase": (n,), "num_requests": (n,)}.items():
            _expect(trace, dataset(Data.PASSES, name), shape)
    elif group == Data.TOKENS:
        m = trace.num_rows(Data.TOKENS_TOPK_IDS)
        for name, shape in {"topk_ids": (m, L, k), "pass_id": (m,), "position": (m,), "rank": (m,), "request": (m,), "request_position": (m,), "pass_phase": (m,)}.items():
            _expect(trace, dataset(Data.TOKENS, name), shape)
        if trace.has(Data.TOKENS_REQUEST) != trace.has(Data.REQUEST_TABLE_ID) or trace.has(Data.TOKENS_REQUEST) != trace.has(Data.TOKENS_REQUEST_POSITION):
            raise violation(trace.path, f"/{Data.TOKENS_REQUEST}", f"/{Data.TOKENS_REQUEST}, /{Data.TOKENS_REQUEST_POSITION} and /{Data.REQUEST_TABLE_ID} come together, but only some are present")
    if trace.has(dataset(Data.TIMING, "pass_id")):
        n = trace.num_rows(dataset(Data.TIMING, "pass_id"))
        with_rows = [name for name in ("step_seconds", "rank") if trace.has(dataset(Data.TIMING, name))]
        for name in with_rows:
            _expect(trace, dataset(Data.TIMING, name), (n,))
    _check_row_totals(trace, group)


def _check_row_totals(trace: OpenTrace, group: str | None) -> None:
    """Streamed rows against the ``/stat`` totals: tokens rows = tokens; pass rows = passes."""
    if group is None or not trace.has(Data.STAT_NUM_TOKENS) or not trace.has(dataset(group, "pass_id")):
        return
    if group == Data.TOKENS:
        rows, total, what = trace.num_rows(Data.TOKENS_PASS_ID), int(trace._read(Data.STAT_NUM_TOKENS).sum()), f"/{Data.STAT_NUM_TOKENS}"
    else:
        rows, total, what = trace.num_rows(Data.PASSES_PASS_ID), int(trace._read(Data.STAT_NUM_PASSES).sum()), f"/{Data.STAT_NUM_PASSES}"
    if rows != total:
        raise violation(trace.path, f"/{group}", f"{rows} rows, but {what} totals {total}")


def check_stat(trace: OpenTrace) -> None:
    """``/stat`` and ``/window`` against each other and the map (see the module docstring).

    Raises:
        TraceDamageError: naming the dataset and the figures.
    """
    if not trace.has(Data.STAT_PHYSICAL_COUNT):
        return
    physical = trace._read(Data.STAT_PHYSICAL_COUNT).astype(np.int64)  # [R, L, P]
    mapping = trace.physical_to_logical
    if trace.has(Data.STAT_LOGICAL_COUNT):
        logical = trace._read(Data.STAT_LOGICAL_COUNT).astype(np.int64)
        expected = to_logical(physical, mapping) if physical.size else np.zeros_like(logical)
        if expected.shape != logical.shape or not np.array_equal(expected, logical):
            r, layer, e = np.argwhere(expected != logical)[0] if expected.shape == logical.shape else (0, 0, 0)
            raise violation(
                trace.path, f"/{Data.STAT_LOGICAL_COUNT}",
                f"rank row {r}, layer {trace.layers[layer]}, logical expert {e} holds {logical[r, layer, e]}, but /{Data.STAT_PHYSICAL_COUNT} "
                f"through /physical_to_logical sums to {expected[r, layer, e]} (totals {int(logical.sum())} vs {int(physical.sum())})",
            )
    tokens = trace._read(Data.STAT_NUM_TOKENS).astype(np.int64) if trace.has(Data.STAT_NUM_TOKENS) else None
    if tokens is not None and trace.top_k > 0:
        invalid = trace._read(Data.STAT_INVALID_IDS).astype(np.int64) if trace.has(Data.STAT_INVALID_IDS) else 0
        padding = trace._read(PADDING_IDS).astype(np.int64) if trace.has(PADDING_IDS) else 0
        routed = physical.sum(axis=2) + invalid  # [R, L]: ids that are not padding
        limit = tokens[:, None] * trace.top_k
        over = np.argwhere(routed > limit)
        if len(over):
            r, layer = over[0]
            raise violation(
                trace.path, f"/{Data.STAT_PHYSICAL_COUNT}",
                f"rank row {r}, layer {trace.layers[layer]}: {int(physical[r, layer].sum())} assignments + {int(np.broadcast_to(invalid, routed.shape)[r, layer])} invalid ids "
                f"= {int(routed[r, layer])}, more than /{Data.STAT_NUM_TOKENS} {int(tokens[r])} x top_k {trace.top_k} = {int(limit[r, 0])}",
            )
        seen = routed + padding
        if trace.has(PADDING_IDS) and (seen % trace.top_k != 0).any():  # each hook call adds tokens x top_k ids to a layer
            r, layer = np.argwhere(seen % trace.top_k != 0)[0]
            raise violation(
                trace.path, f"/{PADDING_IDS}",
                f"rank row {r}, layer {trace.layers[layer]}: assignments + invalid + padding = {int(seen[r, layer])}, not a multiple of top_k {trace.top_k}",
            )
    _check_pass_phases(trace, physical)
    if trace.has(Data.WINDOW_PASS_ID):
        _check_window(trace, physical, tokens)


def _check_pass_phases(trace: OpenTrace, physical: np.ndarray) -> None:
    """The ``/stat`` totals split by pass phase add up to the totals (counts, passes, tokens)."""
    if not trace.has(Data.STAT_PASS_PHASE_PHYSICAL_COUNT):
        return
    by_phase = trace._read(Data.STAT_PASS_PHASE_PHYSICAL_COUNT).astype(np.int64).sum(axis=1)  # [R, L, P]
    if by_phase.shape != physical.shape or not np.array_equal(by_phase, physical):
        raise violation(trace.path, f"/{Data.STAT_PASS_PHASE_PHYSICAL_COUNT}",
                        f"its pass phases add up to {int(by_phase.sum())} assignments, but /{Data.STAT_PHYSICAL_COUNT} holds {int(physical.sum())}")
    for name, total in ((Data.STAT_PASS_PHASE_NUM_PASSES, Data.STAT_NUM_PASSES), (Data.STAT_PASS_PHASE_NUM_TOKENS, Data.STAT_NUM_TOKENS)):
        if not trace.has(name) or not trace.has(total):
            continue
        split, whole = trace._read(name).astype(np.int64).sum(axis=1), trace._read(total).astype(np.int64)
        if not np.array_equal(split, whole):
            raise violation(trace.path, f"/{name}", f"its pass phases add up to {split.tolist()}, but /{total} says {whole.tolist()}")


def _check_window(trace: OpenTrace, physical: np.ndarray, tokens: np.ndarray | None) -> None:
    pass_id = trace._read(Data.WINDOW_PASS_ID).astype(np.int64)  # [R, W]
    stamp = trace._read(Data.WINDOW_TIMESTAMP).astype(np.float64)
    window_tokens = trace._read(Data.WINDOW_NUM_TOKENS).astype(np.int64)
    counts = trace._read(Data.WINDOW_PHYSICAL_COUNT)  # [R, W, L, P]
    passes = trace._read(Data.STAT_NUM_PASSES).astype(np.int64) if trace.has(Data.STAT_NUM_PASSES) else None
    for r in range(pass_id.shape[0]):
        filled = pass_id[r] >= 0
        n = int(filled.sum())
        if not filled[:n].all():
            raise violation(trace.path, f"/{Data.WINDOW_PASS_ID}", f"rank row {r}: empty slots (-1) between filled ones {pass_id[r].tolist()[:16]}")
        if (np.diff(pass_id[r, :n]) <= 0).any():
            raise violation(trace.path, f"/{Data.WINDOW_PASS_ID}", f"rank row {r}: pass ids {pass_id[r, :n].tolist()[:16]} are not increasing")
        ts = stamp[r, :n]
        if (np.diff(ts[~np.isnan(ts)]) < 0).any():
            raise violation(trace.path, f"/{Data.WINDOW_TIMESTAMP}", f"rank row {r}: timestamps go back in time ({ts.tolist()[:8]})")
        if passes is not None and n > passes[r]:
            raise violation(trace.path, f"/{Data.WINDOW_PASS_ID}", f"rank row {r}: {n} passes in the window, but /{Data.STAT_NUM_PASSES} says {int(passes[r])}")
        if tokens is not None and window_tokens[r, :n].sum() > tokens[r]:
            raise violation(trace.path, f"/{Data.WINDOW_NUM_TOKENS}", f"rank row {r}: {int(window_tokens[r, :n].sum())} tokens in the window, more than /{Data.STAT_NUM_TOKENS} {int(tokens[r])}")
        in_window = counts[r, :n].sum(axis=0, dtype=np.int64)
        if (in_window > physical[r]).any():
            layer, p = np.argwhere(in_window > physical[r])[0]
            raise violation(trace.path, f"/{Data.WINDOW_PHYSICAL_COUNT}", f"rank row {r}, layer {trace.layers[layer]}, expert slot {p}: {int(in_window[layer, p])} in the window, more than the /{Data.STAT_PHYSICAL_COUNT} total {int(physical[r, layer, p])}")
        if (counts[r, n:] != 0).any():
            raise violation(trace.path, f"/{Data.WINDOW_PHYSICAL_COUNT}", f"rank row {r}: counts in the {pass_id.shape[1] - n} empty slots")
    if trace.has(Data.WINDOW_NUM_REQUESTS):
        phase = trace._read(Data.WINDOW_PASS_PHASE) if trace.has(Data.WINDOW_PASS_PHASE) else np.zeros(pass_id.shape, np.int8)
        check_pass_requests(trace.path, Data.WINDOW_NUM_REQUESTS, phase, trace._read(Data.WINDOW_NUM_REQUESTS), pass_id)


class RowOrder:
    """Checks, chunk by chunk, that streamed rows are in pass order and (per rank) in time order."""

    def __init__(self, path: Path | str, group: str, timestamps: bool = False) -> None:
        self.path, self.group, self.timestamps = path, group, timestamps
        self.last_pass = -(1 << 62)
        self.last_stamp: dict[int, float] = {}
        self.row = 0

    def check(self, pass_id: np.ndarray, timestamp: np.ndarray | None = None, rank: np.ndarray | None = None) -> None:
        """The next rows ``pass_id [n]`` (and ``timestamp [n]``, ``rank [n]``) of the group.

        Raises:
            TraceDamageError: a pass id or timestamp goes back.
        """
        if len(pass_id):
            steps = np.diff(np.concatenate([[self.last_pass], pass_id.astype(np.int64)]))
            if (steps < 0).any():
                at = int(np.argmax(steps < 0))
                before = self.last_pass if at == 0 else int(pass_id[at - 1])
                raise violation(self.path, f"/{self.group}/pass_id", f"row {self.row + at} has pass id {int(pass_id[at])} after {before}: pass ids must not decrease")
            self.last_pass = int(pass_id[-1])
            if self.timestamps and timestamp is not None:
                ranks = np.zeros(len(pass_id), np.int64) if rank is None else rank.astype(np.int64)
                for r in np.unique(ranks):
                    ts = timestamp[ranks == r].astype(np.float64)
                    ts = ts[~np.isnan(ts)]
                    if not len(ts):
                        continue
                    previous = self.last_stamp.get(int(r), -np.inf)
                    if (np.diff(np.concatenate([[previous], ts])) < 0).any():
                        raise violation(self.path, f"/{self.group}/timestamp", f"rank {int(r)}: timestamps go back in time near row {self.row} ({ts.tolist()[:4]} after {previous})")
                    self.last_stamp[int(r)] = float(ts[-1])
        self.row += len(pass_id)


def check_request_rows(path: Path | str, row: int, request: np.ndarray, position: np.ndarray, table_size: int) -> None:
    """Token rows ``row ..`` tied to requests: ``request [n]`` within ``[-1, table_size)`` and
    ``position [n]`` >= 0 exactly where a request is named (-1 where none is).

    Raises:
        TraceDamageError: naming the first row that breaks it.
    """
    bad = (request < -1) | (request >= table_size) | ((request >= 0) != (position >= 0)) | (position < -1)
    if bad.any():
        at = int(np.argmax(bad))
        raise violation(path, f"/{Data.TOKENS_REQUEST}", f"row {row + at}: request {int(request[at])} at position {int(position[at])}, "
                        f"but /{Data.REQUEST_TABLE_ID} holds {table_size} ids (-1 and position -1: no request)")


def check_pass_requests(path: Path | str, name: str, phase: np.ndarray, requests: np.ndarray, pass_id: np.ndarray | None = None, row: int = 0) -> None:
    """Passes' request counts against their phases: ``requests`` and ``phase`` ``[n]`` (``/passes`` rows
    ``row ..``) or ``[R, W]`` (window slots, with ``pass_id [R, W]``: an empty slot, pass id -1, holds
    phase ``unknown`` and -1). ``name``: the request dataset, for the message.

    Raises:
        TraceDamageError: naming the first pass (or slot) that breaks :data:`moetrace.pass_phase.REQUESTS_RULE`.
    """
    bad = ~requests_allowed(phase, requests)
    if pass_id is not None:
        bad = np.where(pass_id < 0, (phase != UNKNOWN) | (requests != -1), bad)
    if not bad.any():
        return
    at = np.unravel_index(int(np.argmax(bad)), bad.shape)
    code = int(phase[at])
    what = PASS_PHASES[code] if 0 <= code < len(PASS_PHASES) else f"code {code} (no pass phase)"
    if pass_id is None:
        where, rule = f"row {row + int(at[0])}", REQUESTS_RULE
    else:
        where, rule = f"rank row {int(at[0])}, slot {int(at[1])} (pass id {int(pass_id[at])})", f"{REQUESTS_RULE}; an empty slot (pass id -1) unknown and -1"
    raise violation(path, f"/{name}", f"{where}: {int(requests[at])} requests in a pass of phase {what}, but {rule}")


def check_timing_rows(path: Path | str, rows: dict[str, np.ndarray]) -> None:
    """``/timing`` rows: equal lengths and pass ids non-decreasing."""
    lengths = {name: len(col) for name, col in rows.items()}
    if len(set(lengths.values())) > 1:
        raise violation(path, "/timing", f"columns of different lengths {lengths}")
    if "pass_id" in rows:
        RowOrder(path, "timing").check(rows["pass_id"])


class TokenTally:
    """``/tokens/topk_ids`` counted as the rows are read, first to last, for the comparison with ``/stat``.

    HDF5's Fletcher-32 sums 16-bit words mod 65535, so a word ``0xFFFF`` zeroed keeps its chunk's
    checksum: int8 ids ``[-1, -1]`` or one int16 ``-1`` read as expert 0. Every row adds its ids to
    ``counted [R, L, P]`` (int64, per ``/stat`` rank row, layer and slot) and its ``-2`` to ``bad [R, L]``;
    once every row has been added, :meth:`check` compares them with ``/stat/physical_count`` and
    ``/stat/invalid_ids`` exactly (``/stat`` counts exactly the passes whose rows the file holds, those
    dropped with ``on_overflow="drop"`` in neither). Additive (:meth:`merge`), so row ranges read
    apart add up too. Memory: the accumulators and one chunk of keys.
    """

    def __init__(self, path: Path | str, shape: tuple[int, int, int]) -> None:
        self.path, self.rows = path, 0
        self.counted = np.zeros(shape, np.int64)
        self.bad = np.zeros(shape[:2], np.int64)

    @classmethod
    def of(cls, trace: OpenTrace) -> TokenTally | None:
        """A tally for ``trace``'s ``/tokens`` (``None``: the trace has no rows or no ``/stat`` to hold them to)."""
        shape = trace.shape(Data.STAT_PHYSICAL_COUNT)
        if not trace.has(Data.TOKENS_TOPK_IDS) or shape is None:
            return None
        return cls(trace.path, shape)

    def add(self, ids: np.ndarray, ranks: np.ndarray | None) -> None:
        """Rows ``ids [M, L, k]`` of ``/stat`` rank rows ``ranks [M]`` (``None``: a per-rank file, row 0).

        Raises:
            TraceDamageError: an id outside ``-2..P-1`` or a rank outside the ``/stat`` rows.
        """
        R, L, P = self.counted.shape
        ranks = np.zeros(len(ids), np.int64) if ranks is None else np.asarray(ranks, np.int64)
        if len(ranks) and (ranks.min() < 0 or ranks.max() >= R):
            raise violation(self.path, f"/{Data.TOKENS_RANK}", f"ranks {int(ranks.min())}..{int(ranks.max())} outside 0..{R - 1}")
        if ids.size and (ids.max() >= P or ids.min() < -2):
            raise violation(self.path, f"/{Data.TOKENS_TOPK_IDS}", f"ids {int(ids.min())}..{int(ids.max())} outside -2..{P - 1}")
        width = P + 2  # one bin per id -2..P-1: a single bincount over every id, nothing masked
        dtype = np.int32 if R * L * width < np.iinfo(np.int32).max else np.int64
        base = (ranks.astype(dtype)[:, None, None] * L + np.arange(L, dtype=dtype)[None, :, None]) * width + 2  # [M, L, 1]
        counts = np.bincount((base + ids).ravel(), minlength=R * L * width).reshape(R, L, width)
        self.counted += counts[:, :, 2:]
        self.bad += counts[:, :, 0]
        self.rows += len(ids)

    def merge(self, other: TokenTally) -> TokenTally:
        """The tally of both row sets (a new object)."""
        out = TokenTally(self.path, self.counted.shape)  # type: ignore[arg-type]
        out.counted, out.bad, out.rows = self.counted + other.counted, self.bad + other.bad, self.rows + other.rows
        return out

    def check(self, trace: OpenTrace) -> None:
        """Every row of ``trace`` (an open :class:`Trace`) added: the tally against its ``/stat`` (:func:`compare_with_stat`).

        Raises:
            TraceDamageError: naming the dataset and the figures.
            ValueError: fewer or more rows added than the trace holds (a partial read cannot check).
        """
        self._complete(trace.num_rows(Data.TOKENS_TOPK_IDS))
        compare_with_stat(trace, Data.TOKENS, self.counted, self.bad)

    def check_file(self, file: Any) -> None:
        """The same for an open ``h5py.File`` (``merge`` moves rows without the reader)."""
        self._complete(file[Data.TOKENS_TOPK_IDS].shape[0])
        with reading(self.path, f"/{Data.STAT}"):
            stat, layers = (file[Data.STAT_PHYSICAL_COUNT][()], file[Data.STAT_INVALID_IDS][()] if Data.STAT_INVALID_IDS in file else None), file[Data.LAYERS][()]
        compare_totals(self.path, np.asarray(layers), Data.TOKENS, (self.counted, self.bad), stat)

    def _complete(self, rows: int) -> None:  # a partial read cannot check
        if self.rows != rows:
            raise ValueError(f"{self.path}: {self.rows} of {rows} /tokens rows were added; only a read of every row can be checked")


def compare_with_stat(trace: OpenTrace, group: str, counted: np.ndarray, bad: np.ndarray) -> None:
    """The streamed rows of ``group`` added up, ``counted [R, L, P]`` and invalid ids ``bad [R, L]``,
    against ``trace``'s ``/stat/physical_count`` and ``/stat/invalid_ids`` (:func:`compare_totals`)."""
    invalid = trace._read(Data.STAT_INVALID_IDS) if trace.has(Data.STAT_INVALID_IDS) else None
    compare_totals(trace.path, trace.layers, group, (counted, bad), (trace._read(Data.STAT_PHYSICAL_COUNT), invalid))


def compare_totals(path: Path | str, layers: np.ndarray, group: str, rows: tuple[np.ndarray, np.ndarray],
                   stat: tuple[np.ndarray, np.ndarray | None]) -> None:
    """Rows added up ``(counted [R, L, P], bad [R, L])`` against ``/stat`` ``(physical_count, invalid_ids or None)``, exactly.

    Raises:
        TraceDamageError: naming the dataset and the first figures that differ.
    """
    (counted, bad), (physical, invalid) = rows, stat
    if not np.array_equal(counted, physical):
        r, layer, p = np.argwhere(counted != physical)[0]
        raise violation(path, f"/{Data.STAT_PHYSICAL_COUNT}", f"rank row {r}, layer {layers[layer]}, expert slot {p}: total {int(physical[r, layer, p])}, but the /{group} rows add up to {int(counted[r, layer, p])}")
    if invalid is not None and not np.array_equal(bad, invalid):
        r, layer = np.argwhere(bad != invalid)[0]
        raise violation(path, f"/{Data.STAT_INVALID_IDS}", f"rank row {r}, layer {layers[layer]}: total {int(invalid[r, layer])}, but the /{group} rows hold {int(bad[r, layer])}")


#: Bytes of streamed rows :func:`check_rows_against_stat` reads at once (a 72-rank DeepSeek-V3 ``per_pass``
#: trace is 67 KB a row: a fixed row count would hold gigabytes).
CHECK_CHUNK_BYTES = 32 << 20


def check_rows_against_stat(trace: OpenTrace, chunk_bytes: int = CHECK_CHUNK_BYTES,
                            progress: Callable[[int], None] | None = None) -> None:
    """Every streamed row, summed per rank, against the ``/stat`` totals (exact), and each pass phase's.

    Reads ``chunk_bytes`` of rows at a time (at least one row); ``progress(rows)`` after each read.
    ``/tokens`` rows are added up by :meth:`Trace.iter_tokens` itself (:class:`TokenTally`).

    Raises:
        TraceDamageError: naming the dataset and the figures.
    """
    group = STREAM_GROUP.get(trace.mode)
    if group is None or not trace.has(Data.STAT_PHYSICAL_COUNT) or not trace.has(dataset(group, "pass_id")):
        return
    R, L, P = trace.shape(Data.STAT_PHYSICAL_COUNT)
    phases = _PhaseSums(trace, group)
    multi = trace.has(dataset(group, "rank"))
    at = 0
    advance = progress if progress is not None else (lambda rows: None)
    if group == Data.PASSES:
        counted, bad = np.zeros((R, L, P), np.int64), np.zeros((R, L), np.int64)
        for part in trace.iter_passes(max(1, chunk_bytes // (L * P * 8))):  # int64 sums of [rows, L, P]
            n = len(part.pass_id)
            ranks = trace._slice(dataset(group, "rank"), at, n).astype(np.int64) if multi else np.zeros(n, np.int64)
            if n and (ranks.min() < 0 or ranks.max() >= R):
                raise violation(trace.path, f"/{group}/rank", f"ranks {int(ranks.min())}..{int(ranks.max())} outside 0..{R - 1}")
            at += n
            for r in np.unique(ranks):
                mine = ranks == r
                counted[r] += part.physical_count[mine].sum(axis=0, dtype=np.int64)
                bad[r] += part.invalid_ids[mine].sum(axis=0, dtype=np.int64)
                phases.add_passes(r, part.pass_phase, mine, part.physical_count)
            advance(n)
        compare_with_stat(trace, group, counted, bad)
    else:
        for part in trace.iter_tokens(max(1, chunk_bytes // (L * trace.top_k * 8 * 4))):  # ids, keys, rows as int64
            n = len(part.pass_id)
            if phases.rows is not None:  # the rank column was checked by iter_tokens' tally
                ranks = trace._slice(dataset(group, "rank"), at, n).astype(np.int64) if multi else np.zeros(n, np.int64)
                phases.add_tokens(ranks, part.pass_phase, part.topk_ids.astype(np.int64))
            at += n
            advance(n)
    phases.check()


class _PhaseSums:
    """The streamed rows of each pass phase, summed per rank ``[R, Q, L, P]``, against ``/stat/pass_phase_physical_count``
    (nothing when the trace records no pass phases)."""

    def __init__(self, trace: OpenTrace, group: str) -> None:
        self.trace, self.group = trace, group
        name = Data.STAT_PASS_PHASE_PHYSICAL_COUNT
        self.total = trace._read(name).astype(np.int64) if trace.has(name) else None
        self.rows = np.zeros_like(self.total) if self.total is not None else None

    def add_passes(self, rank: int, pass_phase: np.ndarray | None, mine: np.ndarray, counts: np.ndarray) -> None:
        """``/passes`` rows ``mine`` of rank ``rank``: their counts ``[n, L, P]`` into their phases."""
        if self.rows is not None and pass_phase is not None:
            np.add.at(self.rows[rank], pass_phase[mine].astype(np.int64), counts[mine].astype(np.int64))

    def add_tokens(self, ranks: np.ndarray, pass_phase: np.ndarray | None, ids: np.ndarray) -> None:
        """``/tokens`` rows: ids ``[M, L, k]`` of ranks ``[M]`` into their phases."""
        if self.rows is None or pass_phase is None:
            return
        _, Q, L, P = self.rows.shape
        key = ((ranks[:, None, None] * Q + pass_phase.astype(np.int64)[:, None, None]) * L + np.arange(L)[None, :, None]) * P + ids
        self.rows += np.bincount(key[ids >= 0], minlength=self.rows.size).reshape(self.rows.shape)

    def check(self) -> None:
        if self.rows is None or np.array_equal(self.rows, self.total):
            return
        r, q, layer, p = np.argwhere(self.rows != self.total)[0]
        raise violation(self.trace.path, f"/{Data.STAT_PASS_PHASE_PHYSICAL_COUNT}", f"rank row {r}, pass phase {PASS_PHASES[q]}, layer {self.trace.layers[layer]}, "
                        f"expert slot {p}: total {int(self.total[r, q, layer, p])}, but the /{self.group} rows of that phase add up to {int(self.rows[r, q, layer, p])}")
