"""Streaming access to a trace's time-ordered data, in bounded memory.

Every mode is turned into the same thing: consecutive blocks of per-pass
counts (:class:`PassBlock`), read a chunk at a time:

- ``stat``: rows of ``/window`` (the last ``W`` passes), summed over the counted
  rank rows (:meth:`Trace.counted`: each token once under TP attention),
  sliced straight from HDF5;
- ``per_pass``: rows of ``/passes`` via :meth:`Trace.iter_passes`;
- ``per_token``: rows of ``/tokens`` via :meth:`Trace.iter_tokens`, counted
  per pass with one ``bincount`` per chunk.

A pass may span two blocks (or, in a merged trace, several rows with the same
pass id, one per rank); consumers group consecutive equal pass ids. A pass
phase code (``phase``, :data:`moetrace.pass_phase.PASS_PHASES`) keeps only the
passes of that phase, in every mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from ..ids import to_logical
from ..placement.series import PassSeries
from ..trace.integrity import reading
from ..trace.reader import PassChunk, TokenChunk, Trace
from ..trace.safe_open import open_hdf5
from ..trace.schema import Data, TraceError

__all__ = [
    "MAX_BUCKETS",
    "PASS_BLOCK_BYTES",
    "PassBlock",
    "count_records",
    "iter_pass_blocks",
    "load_series",
    "pass_block",
    "pass_block_rows",
    "select_layers",
    "token_pass_block",
]


@dataclasses.dataclass(frozen=True)
class PassBlock:
    """Per-pass counts for ``n`` consecutive rows.

    Attributes:
        pass_id: ``[n]`` pass ids (non-decreasing within a trace).
        num_tokens: ``[n]`` tokens of each row.
        physical_count: ``[n, L, P]`` token copies per selected layer and physical expert.
    """

    pass_id: np.ndarray
    num_tokens: np.ndarray
    physical_count: np.ndarray


def select_layers(trace: Trace, layers: Sequence[int] | None) -> np.ndarray:
    """Compact indices ``[L_sel]`` of the requested model layer ids (all when ``None``).

    Raises:
        TraceError: a requested layer is not in the trace's ``/layers``.
    """
    model_layers = [int(x) for x in trace.layers]
    if layers is None:
        return np.arange(len(model_layers))
    missing = [x for x in layers if x not in model_layers]
    if missing:
        raise TraceError(f"{trace.path}: layers {missing} are not MoE layers of this trace (it has {model_layers})")
    if not layers:
        raise TraceError(f"{trace.path}: no layers selected")
    return np.array(sorted({model_layers.index(x) for x in layers}), dtype=np.int64)


def count_records(trace: Trace) -> tuple[str, int]:
    """``(unit, count)`` of the time-ordered records a full read visits."""
    if trace.mode == "per_token":
        return "tokens", trace.num_rows(Data.TOKENS_TOPK_IDS)
    if trace.mode == "per_pass":
        return "passes", trace.num_rows(Data.PASSES_PASS_ID)
    shape = trace.shape(Data.WINDOW_PASS_ID)
    return "passes", int(shape[1]) if shape else 0


def token_pass_block(chunk: TokenChunk, layer_index: np.ndarray, num_physical: int) -> PassBlock:
    """Count a chunk of ``/tokens`` rows per pass: ``[n_passes_in_chunk, L_sel, P]``.

    Ids below 0 (``-1`` no routing, ``-2`` invalid) are not counted.
    """
    ids = chunk.topk_ids[:, layer_index, :]
    rows, num_layers, _ = ids.shape
    if rows == 0:
        return PassBlock(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, num_layers, num_physical), np.int64))
    starts = np.flatnonzero(np.concatenate([[True], chunk.pass_id[1:] != chunk.pass_id[:-1]]))
    segment = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, rows)))
    bins = len(starts) * num_layers * num_physical
    dtype = np.int32 if bins < np.iinfo(np.int32).max else np.int64
    base = ((segment[:, None] * num_layers + np.arange(num_layers)[None, :]) * num_physical).astype(dtype)  # [M, L]
    key = base[:, :, None] + ids.astype(dtype)
    key[ids < 0] = bins  # one spare bin collects the ids that are not counted
    counts = np.bincount(key.ravel(), minlength=bins + 1)[:bins]
    return PassBlock(
        pass_id=chunk.pass_id[starts].astype(np.int64),
        num_tokens=np.diff(np.append(starts, rows)).astype(np.int64),
        physical_count=counts.reshape(len(starts), num_layers, num_physical),
    )


def pass_block(chunk: PassChunk, layer_index: np.ndarray) -> PassBlock:
    """The selected layers of a chunk of ``/passes`` rows: ``[n, L_sel, P]`` counts."""
    return PassBlock(
        pass_id=chunk.pass_id.astype(np.int64),
        num_tokens=chunk.num_tokens.astype(np.int64),
        physical_count=chunk.physical_count[:, layer_index].astype(np.int64),
    )


def _window_blocks(trace: Trace, layer_index: np.ndarray, chunk: int, phase: int | None = None) -> Iterator[PassBlock]:
    if not trace.has(Data.WINDOW_PASS_ID):
        return
    trace.check_invariants()
    counted = trace.counted()  # rank rows that replicate another's view are not added (TP attention)
    with reading(trace.path, "/window"), open_hdf5(trace.path) as f:
        pass_ids, tokens, counts = f[Data.WINDOW_PASS_ID], f[Data.WINDOW_NUM_TOKENS], f[Data.WINDOW_PHYSICAL_COUNT]
        phases = f[Data.WINDOW_PASS_PHASE] if Data.WINDOW_PASS_PHASE in f else None
        for start in range(0, pass_ids.shape[1], chunk):
            with reading(trace.path, f"/window slots {start}..{start + chunk - 1}"):
                pid = np.asarray(pass_ids[:, start : start + chunk])
                tok = np.asarray(tokens[:, start : start + chunk])
                cnt = np.asarray(counts[:, start : start + chunk])
                ph = np.asarray(phases[:, start : start + chunk]) if phases is not None else np.zeros(pid.shape, np.int8)
            if phase is not None:  # a (rank, slot) of another pass phase is left out
                pid = np.where(ph == phase, pid, -1)
                cnt = cnt * (ph == phase)[:, :, None, None]
            filled = pid.max(axis=0) >= 0  # a row is a pass when any rank filled it
            yield PassBlock(
                pass_id=pid.max(axis=0)[filled],
                num_tokens=np.where(pid >= 0, tok, 0)[counted.tokens].sum(axis=0)[filled],
                physical_count=cnt[counted.assignments].sum(axis=0, dtype=np.int64)[filled][:, layer_index],
            )


#: Bytes of pass counts read at once, as int64 cells (a DeepSeek-V3 ``per_pass`` row is 58 x 288 cells:
#: 1,024 rows would be 137 MB, and a 72-rank merged ``stat`` trace's window slot holds 72 such rows).
PASS_BLOCK_BYTES = 32 << 20


def pass_block_rows(chunk_passes: int, row_cells: int) -> int:
    """Rows of ``row_cells`` counts each to read at once: ``chunk_passes``, fewer when they would pass
    :data:`PASS_BLOCK_BYTES` as int64 (at least one)."""
    return max(1, min(chunk_passes, PASS_BLOCK_BYTES // (8 * max(1, row_cells))))


def iter_pass_blocks(trace: Trace, layer_index: np.ndarray, chunk_passes: int = 1024, phase: int | None = None) -> Iterator[PassBlock]:
    """Per-pass counts of a ``stat`` (window) or ``per_pass`` trace, in blocks of ``chunk_passes`` rows
    or :data:`PASS_BLOCK_BYTES`, whichever is fewer (only the passes of pass phase code ``phase`` when given)."""
    cells = trace.num_layers * trace.num_physical_experts
    if trace.mode == "per_pass":
        for part in trace.iter_passes(pass_block_rows(chunk_passes, cells), counted_only=True, phase=phase):
            yield pass_block(part, layer_index)
    elif trace.mode == "stat":
        ranks = trace.shape(Data.WINDOW_PHYSICAL_COUNT)[0] if trace.has(Data.WINDOW_PHYSICAL_COUNT) else 1
        yield from _window_blocks(trace, layer_index, pass_block_rows(chunk_passes, ranks * cells), phase)
    else:
        raise TraceError(f"{trace.path}: iter_pass_blocks reads stat or per_pass traces; use token_pass_block for per_token")


#: Buckets a series keeps at most when no bucket size is imposed (neighbours are merged beyond it).
MAX_BUCKETS = 4096


def _time_ordered_blocks(trace: Trace, layer_index: np.ndarray, phase: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(pass_id [m], physical [m, L, P])`` blocks in time order, for any time-ordered trace."""
    if trace.mode == "per_token":
        for chunk in trace.iter_tokens(counted_only=True, phase=phase):
            block = token_pass_block(chunk, layer_index, trace.num_physical_experts)
            yield block.pass_id, block.physical_count
    else:
        for block in iter_pass_blocks(trace, layer_index, phase=phase):
            yield block.pass_id, block.physical_count


def load_series(trace: Trace, layer_index: np.ndarray, bucket: int | None = None, phase: int | None = None) -> PassSeries:
    """Read a trace's passes in time order as buckets of ``bucket`` passes (only the passes of pass
    phase code ``phase`` when given: a prefill-only or decode-only series).

    Rows with the same pass id (a pass split over chunks, or one row per rank
    in a merged trace) are one pass. With ``bucket=None`` the bucket size
    starts at 1 and doubles whenever more than :data:`MAX_BUCKETS` buckets
    would be kept, so memory stays bounded for any trace length.

    Raises:
        TraceError: the trace holds no time-ordered passes (a ``stat`` trace
        without a window) or fewer than two.
    """
    size = 1 if bucket is None else int(bucket)
    if size <= 0:
        raise ValueError(f"bucket must be positive, got {bucket!r}")
    num_layers, num_physical = len(layer_index), trace.num_physical_experts
    done_counts: list[np.ndarray] = []
    done_passes: list[int] = []
    done_first: list[int] = []
    current = np.zeros((num_layers, num_physical), dtype=np.int64)
    in_bucket = 0
    first = last = None
    for pass_id, counts in _time_ordered_blocks(trace, layer_index, phase):
        for pid, row in zip(pass_id.tolist(), counts, strict=True):
            if pid != last:
                if in_bucket == size:
                    done_counts.append(current)
                    done_passes.append(in_bucket)
                    done_first.append(first)
                    current, in_bucket = np.zeros_like(current), 0
                    if bucket is None and len(done_counts) >= 2 * MAX_BUCKETS:
                        done_counts = [a + b for a, b in zip(done_counts[::2], done_counts[1::2], strict=True)]
                        done_passes = [a + b for a, b in zip(done_passes[::2], done_passes[1::2], strict=True)]
                        done_first = done_first[::2]
                        size *= 2
                if in_bucket == 0:
                    first = pid
                in_bucket += 1
                last = pid
            current += row
    if in_bucket:
        done_counts.append(current)
        done_passes.append(in_bucket)
        done_first.append(first)
    total = sum(done_passes)
    if total < 2:
        what = "a stat trace without a /window" if trace.mode == "stat" and total == 0 else f"{total} pass(es)"
        raise TraceError(
            f"{trace.path}: hold-out and backtest need time-ordered passes, and this trace holds {what}; "
            "record with mode='per_pass' or 'per_token' (or a stat window) over more passes"
        )
    physical = np.stack(done_counts)
    mapping = trace.physical_to_logical[layer_index]
    return PassSeries(
        bucket=size,
        passes=np.asarray(done_passes, dtype=np.int64),
        first_pass=np.asarray(done_first, dtype=np.int64),
        logical=to_logical(physical, mapping).astype(np.float64),
        physical=physical,
        physical_to_logical=mapping,
    )
