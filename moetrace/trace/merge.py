"""Join per-rank traces of one recording into a single trace with a rank axis.

The recorder's streaming modes write one file per rank (``-rank{r}``), each
with root attributes ``rank=r``, ``world_size`` and a shared ``run_id``.
:func:`merge_traces` checks that the inputs are exactly ranks ``0..W-1`` of
one run with identical shapes, then **copies** (no HDF5 virtual datasets, so
the result stays valid when the inputs move or are deleted) into one trace:

- root attributes of rank 0, with ``rank = -1`` (gathered), ``world_size = W``,
  the same ``run_id`` and ``merged_from`` (JSON list of the input file names);
- ``/stat/*``: each input's single rank row stacked in rank order ``[W, ...]``;
- ``/ranks/*`` and the layout root attributes: each input's parallel layout, in rank
  order (inputs must agree on the layout sizes), so that readers count each token once;
- ``/window/*`` (``stat`` mode): stacked ``[W, Wmax, ...]``, shorter windows
  padded with ``pass_id = -1`` and zero counts;
- ``/passes/*`` or ``/tokens/*``: every row of every rank, ordered by
  ``(pass_id, rank)`` (a k-way merge; each rank's pass ids must be
  non-decreasing), plus a ``rank`` column ``[N]`` (int32) naming the source rank;
- ``/timing/*`` (phase timing, any mode) the same way, and rank 0's ``timing_*`` root attributes.

Memory, by design, for ``R`` inputs whose streamed rows are ``b`` bytes each (a DeepSeek-V3
``per_pass`` row is 67 KB):

- reads: each input reads ``max(1, memory_bytes // (R * b))`` rows at a time (whole HDF5
  chunks of its widest dataset when that is at least one chunk; ``chunk_rows`` caps it), and
  holds one read: ``max(memory_bytes, R * b)`` over all inputs (default ``memory_bytes`` 64 MiB);
- the merged rows of a step are built one column at a time, in place (at most the reads
  again, for the widest column), and the reads taken whole are let go before the next ones;
- HDF5 keeps the decoded chunk being read of each streamed dataset of each input (inputs are
  opened with a chunk cache of :data:`INPUT_CHUNK_CACHE_BYTES`, about one of the writer's
  chunks; HDF5 2.0's default of 8 MiB a dataset kept whole rank files): ``R * sum(chunk bytes)``,
  one chunk per rank (about 3.5 MB a DeepSeek-V3 rank);
- a rank's pass that goes on past its read (a long pass of ``/tokens`` rows) is written
  rank after rank through further reads, never joined in memory.

So the peak is about ``2 * memory_bytes + R * sum(chunk bytes)`` above the interpreter's,
whatever the number of passes, and grows with the ranks only by one chunk a rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from ..layout import RankLayout
from .integrity import reading
from .invariants import TokenTally
from .pass_requests import check_stored_requests
from .ranks import read_layouts
from .reader import open_trace
from .request_table import append_request_tables, check_rows, shift_requests
from .safe_open import open_hdf5
from .schema import (
    MERGED_DAMAGED_ATTR,
    MERGED_RANKS_ATTR,
    SAME_RUN_ATTRS,
    STREAM_GROUP,
    Attr,
    Data,
    TraceDamageError,
    TraceError,
    TraceHeader,
    dataset,
)
from .writer import TraceWriter

__all__ = ["DEFAULT_MEMORY_BYTES", "INPUT_CHUNK_CACHE_BYTES", "merge_traces", "rank_stops"]

#: Rows in flight over all inputs of one merge, in bytes (the merged column being built is at most as much again).
DEFAULT_MEMORY_BYTES = 64 << 20
#: HDF5's chunk cache of each streamed dataset of each input: one chunk of the writer's (at most about 1 MiB).
#: HDF5 2.0 caches 8 MiB a dataset by default: every chunk of a 60-pass DeepSeek-V3 rank file, 72 times over.
INPUT_CHUNK_CACHE_BYTES = (1 << 20) + 1

_REQUEST = "request"  # the /tokens column that indexes /request_table/id
_REQUEST_POSITION = "request_position"  # and the row's position in that request
_WINDOW_FILL = {"pass_id": -1, "timestamp": 0.0, "num_tokens": 0, "physical_count": 0, "pass_phase": 0, "num_requests": -1}


def _check_inputs(paths: Sequence[Path], damaged: dict[Path, str]) -> tuple[list[Path], list[int], dict[str, object], np.ndarray, np.ndarray]:
    """Intact inputs sorted by rank, their ranks, the first one's attributes, layers and map.

    Inputs that cannot be opened because they are damaged go into ``damaged``
    (``{path: message}``); every other mismatch raises TraceError.
    """
    if not paths:
        raise TraceError("merge needs at least one per-rank trace")
    infos = []
    for path in paths:
        if path in damaged:
            continue
        try:
            with open_trace(path) as trace:
                infos.append((Path(path), trace.attrs, trace.layers, trace.physical_to_logical))
        except TraceDamageError as exc:
            damaged[path] = str(exc)
    if not infos:
        raise TraceDamageError(paths[0], f"every input is damaged, nothing to merge: {'; '.join(damaged.values())}")
    first_path, first, layers, mapping = infos[0]
    for path, attrs, lay, mp in infos:
        if attrs[Attr.MODE] == "routing":
            raise TraceError(f"{path}: a replica trace (one router's /requests); merge joins the per-rank traces of an expert recording")
        if int(attrs[Attr.RANK]) < 0:
            raise TraceError(f"{path}: already holds every rank (rank=-1); merge joins per-rank traces")
        if attrs[Attr.RUN_ID] != first[Attr.RUN_ID]:
            raise TraceError(f"{path}: run_id {attrs[Attr.RUN_ID]} differs from {first_path}'s {first[Attr.RUN_ID]}; traces of different runs cannot be merged")
        for key in SAME_RUN_ATTRS:
            if attrs.get(key) != first.get(key):
                raise TraceError(f"{path}: {key}={attrs.get(key)!r} differs from {first_path}'s {first.get(key)!r}; cannot merge")
        if not (np.array_equal(lay, layers) and np.array_equal(mp, mapping)):
            raise TraceError(f"{path}: /layers or /physical_to_logical differs from {first_path}'s; cannot merge")
    ranks = sorted(int(attrs[Attr.RANK]) for _, attrs, _, _ in infos)
    world = int(first[Attr.WORLD_SIZE])  # type: ignore[call-overload]
    complete = ranks == list(range(world))
    partial = damaged and len(set(ranks)) == len(ranks) and len(ranks) + len(damaged) == world and all(0 <= r < world for r in ranks)
    if not (complete or partial):
        raise TraceError(f"merge needs ranks 0..{world - 1} exactly once each (world_size={world}), got ranks {ranks}" + (f" and {len(damaged)} damaged input(s)" if damaged else ""))
    ordered = sorted(((p, int(a[Attr.RANK])) for p, a, _, _ in infos), key=lambda x: x[1])  # type: ignore[call-overload]
    return [p for p, _ in ordered], [r for _, r in ordered], first, layers, mapping


class _Cursor:
    """Buffered rows of one rank's streamed group, read ``chunk`` rows at a time."""

    def __init__(self, file: h5py.File, group: str, names: list[str], rank: int, chunk: int) -> None:
        self.file, self.group, self.names, self.rank, self.chunk = file, group, names, rank, chunk
        self.datasets = {n: file[dataset(group, n)] for n in names}  # open for the merge: each chunk decoded once
        self.rows = self.datasets["pass_id"].shape[0]
        self.next = 0
        self.buffer: dict[str, np.ndarray] = {n: d[0:0] for n, d in self.datasets.items()}
        self.last_pass = -(1 << 62)
        # /tokens ids added up as they are read and held to the file's /stat with the last row (a zeroed 0xFFFF word)
        self.tally = TokenTally(file.filename, file[Data.STAT_PHYSICAL_COUNT].shape) if group == Data.TOKENS and Data.STAT_PHYSICAL_COUNT in file else None
        if self.tally is not None and self.rows == 0:
            self.tally.check_file(file)

    def refill(self) -> None:
        """Read the next ``chunk`` rows when the buffer is empty."""
        if len(self.buffer["pass_id"]) or self.next >= self.rows:
            return
        stop = min(self.next + self.chunk, self.rows)
        with reading(self.file.filename, f"/{self.group} rows {self.next}..{stop - 1}"):
            rows = {n: np.asarray(d[self.next : stop]) for n, d in self.datasets.items()}
        pid = rows["pass_id"]
        if len(pid) and (pid[0] < self.last_pass or (np.diff(pid) < 0).any()):
            raise TraceError(f"{self.file.filename}: pass ids in /{self.group} are not in order; cannot merge by time")
        if _REQUEST in rows:  # indices into this file's own table, checked before the merge moves them
            check_rows(self.file, self.next, rows[_REQUEST], rows.get(_REQUEST_POSITION))
        self.buffer = rows
        self.last_pass = int(pid[-1])
        self.next = stop
        if self.tally is not None:
            self.tally.add(rows["topk_ids"], rows.get("rank"))
            if not self.more:
                self.tally.check_file(self.file)

    @property
    def more(self) -> bool:
        """Rows remain unread in the file."""
        return self.next < self.rows

    @property
    def done(self) -> bool:
        return self.next >= self.rows and not len(self.buffer["pass_id"])

    def continues(self, bound: int) -> bool:
        """Pass ``bound`` goes on in the rows not read yet: the buffer (empty or not) ends at it and so does the next row start."""
        held = self.buffer["pass_id"]
        return self.more and (not len(held) or int(held[-1]) == bound) and int(self.datasets["pass_id"][self.next]) == bound

    def take_until(self, bound: int, inclusive: bool) -> dict[str, np.ndarray]:
        """The buffered rows up to pass ``bound`` (views); a buffer taken whole lets go of its read."""
        cut = int(np.searchsorted(self.buffer["pass_id"], bound, side="right" if inclusive else "left"))
        out = {n: a[:cut] for n, a in self.buffer.items()}
        self.buffer = {n: a[cut:] if cut < len(a) else np.empty((0, *a.shape[1:]), a.dtype) for n, a in self.buffer.items()}
        return out


def _row_bytes(file: h5py.File, group: str, names: list[str]) -> int:
    """Bytes of one row over the datasets ``names`` of ``group``."""
    return sum(int(np.prod(file[dataset(group, n)].shape[1:], dtype=np.int64)) * file[dataset(group, n)].dtype.itemsize for n in names)


def _merge_stream(files: list[h5py.File], ranks: list[int], group: str, writer: TraceWriter, budget: tuple[int, int],
                  advance: Callable[[int], None], shift: Mapping[int, int] | None = None) -> None:
    """k-way merge of ``group``; ``budget`` = (bytes in flight over all inputs, rows per read cap);
    ``shift``: per rank, what its ``request`` column's indices move by (its table's offset in the merged table)."""
    names = sorted(files[0][group].keys())
    for f in files[1:]:
        if sorted(f[group].keys()) != names or any(f[dataset(group, n)].shape[1:] != files[0][dataset(group, n)].shape[1:] for n in names):
            raise TraceError(f"{f.filename}: /{group} datasets differ in names or shapes from {files[0].filename}'s; cannot merge")
    memory_bytes, chunk_rows = budget
    chunk = max(1, min(chunk_rows, memory_bytes // len(files) // max(1, _row_bytes(files[0], group, names))))
    widest = max(names, key=lambda n: _row_bytes(files[0], group, [n]))
    stored = files[0][dataset(group, widest)].chunks  # reads of whole HDF5 chunks of the widest rows decode each once
    if stored and chunk >= stored[0]:
        chunk -= chunk % stored[0]
    cursors = [_Cursor(f, group, names, rank, chunk) for rank, f in zip(ranks, files, strict=True)]
    for name in names:
        ds = files[0][dataset(group, name)]
        writer.ensure_empty(dataset(group, name), ds.shape[1:], ds.dtype)
    writer.ensure_empty(dataset(group, "rank"), (), np.dtype(np.int32))
    while True:
        for c in cursors:
            c.refill()
        live = [c for c in cursors if not c.done]
        if not live:
            return
        # Every rank has read up to `bound`: the rows before it are all here, and those of `bound`
        # too unless a rank's pass `bound` goes on in its next read (a long pass of /tokens rows).
        bound = min(int(c.buffer["pass_id"][-1]) for c in live)
        unfinished = any(c.continues(bound) for c in live)
        _write_rows(writer, group, names, [(c.rank, c.take_until(bound, inclusive=not unfinished)) for c in live], shift, advance)
        if unfinished:  # pass `bound` rank after rank, each streamed through its reads
            for c in live:
                while True:
                    _write_rows(writer, group, names, [(c.rank, c.take_until(bound, inclusive=True))], shift, advance)
                    if not c.continues(bound):
                        break
                    c.refill()


def _write_rows(writer: TraceWriter, group: str, names: list[str], parts: list[tuple[int, dict[str, np.ndarray]]],
                shift: Mapping[int, int] | None, advance: Callable[[int], None]) -> None:
    """Append ``parts`` (per rank, rows ordered by pass id) ordered by ``(pass_id, rank)``, with their ``rank`` column."""
    rows = sum(len(p["pass_id"]) for _, p in parts)
    if not rows:
        return
    if shift:
        parts = [(rank, {**part, _REQUEST: shift_requests(part[_REQUEST], shift[rank])}) for rank, part in parts]
    for name, column in _interleave(parts, names):
        writer.append(dataset(group, name), column)
        del column  # before the next column is built
    advance(rows)


def _interleave(parts: list[tuple[int, dict[str, np.ndarray]]], names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """The rows of ``parts`` (per rank, each ordered by pass id) ordered by ``(pass_id, rank)``, one column at a time.

    Each column ``[n, ...]`` is built in place from the parts (one copy of that column,
    not a join and a reordering: two), so a step holds its inputs' reads plus one column;
    the last column is ``rank`` ``[n]`` (int32).
    """
    pid = np.concatenate([p["pass_id"] for _, p in parts])
    order = np.argsort(pid, kind="stable")  # ties keep rank order
    where = np.empty(len(pid), dtype=np.int64)  # the merged position of each part row, in part order
    where[order] = np.arange(len(pid))
    bounds = np.cumsum([0, *(len(p["pass_id"]) for _, p in parts)])
    for name in names:
        first = parts[0][1][name]
        column = np.empty((len(pid), *first.shape[1:]), dtype=first.dtype)
        for (_, part), lo, hi in zip(parts, bounds[:-1], bounds[1:], strict=True):
            column[where[lo:hi]] = part[name]
        yield name, column
        del column
    yield "rank", np.repeat(np.array([r for r, _ in parts], dtype=np.int32), np.diff(bounds))[order]


def _stack_static(files: list[h5py.File], group: str, writer: TraceWriter) -> None:
    """``/stat`` (and ``/window``) rows of every rank, stacked on axis 0 in rank order."""
    if group not in files[0]:
        return
    for name in sorted(files[0][group].keys()):
        key = dataset(group, name)
        for f in files:
            if key not in f or f[key].shape[2:] != files[0][key].shape[2:] or f[key].shape[0] != 1:
                raise TraceError(f"{f.filename}: /{key} is missing or shaped differently from {files[0].filename}'s; cannot merge")
        widths = [f[key].shape[1] if f[key].ndim > 1 else 0 for f in files]
        for f in files:
            with reading(f.filename, f"/{key}"):
                rows = np.asarray(f[key][()])
            if group == "window" and rows.shape[1] < max(widths):
                pad = np.full((1, max(widths) - rows.shape[1], *rows.shape[2:]), _WINDOW_FILL[name], dtype=rows.dtype)
                rows = np.concatenate([rows, pad], axis=1)
            elif group != "window" and f[key].shape != files[0][key].shape:
                raise TraceError(f"{f.filename}: /{key} has shape {f[key].shape}, {files[0].filename} has {files[0][key].shape}; cannot merge")
            writer.append(key, rows)


def rank_stops(paths: Sequence[Path | str]) -> list[str]:
    """One line per input that ``moetrace recover`` rebuilt: which rank stopped where and what it lost."""
    notes = []
    for path in paths:
        with reading(path, "root attributes"), open_hdf5(path) as f:  # the attributes only: merge has validated its inputs
            attrs = dict(f.attrs)
        if not attrs.get(Attr.RECOVERED):
            continue
        lost = json.loads(str(attrs.get(Attr.RECOVERED_LOST, "{}")) or "{}")
        notes.append(
            f"rank {attrs[Attr.RANK]} stopped: recovered up to pass {attrs[Attr.RECOVERED_LAST_PASS]} "
            f"(last segment closed at unix {float(attrs[Attr.RECOVERED_LAST_SEGMENT_UNIX]):.3f}); lost {lost.get('lost', 'unknown')}"  # type: ignore[arg-type]
        )
    return notes


def merge_traces(paths: Sequence[Path | str], out: Path | str, chunk_rows: int = 65536, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 progress: Callable[[int, int], None] | None = None) -> Path:
    """Merge per-rank traces of one run into ``out`` (copying; see the module docstring).

    ``memory_bytes`` bounds the rows in flight over all inputs, ``chunk_rows`` the rows of one
    read; ``progress(done, total)`` is called with the streamed rows copied so far.

    A damaged input (a checksum, HDF5 structure or invariant fails, found when it is
    opened or while its rows are copied) is left out and the others are merged: the
    result then names the damaged inputs in ``merged_damaged`` and its ranks in
    ``merged_ranks`` (``/stat`` rows follow that list); check those attributes, as
    ``moetrace merge`` does, before treating it as the whole run.

    Raises:
        TraceError: an input is unreadable for another reason, from another run, of
            another shape or mode, ranks are missing or repeated, or every input is damaged.
        TraceWriteError: ``out`` could not be written (nothing is left under that name).
    """
    inputs = [Path(p) for p in paths]
    damaged: dict[Path, str] = {}
    while True:
        ordered, ranks, attrs, layers, mapping = _check_inputs(inputs, damaged)
        try:
            return _write_merged(ordered, ranks, attrs, layers, mapping, Path(out), (memory_bytes, chunk_rows), damaged, progress)
        except TraceDamageError as exc:
            culprit = next((p for p in ordered if str(exc.path) == str(p)), None)
            if culprit is None:
                raise
            damaged[culprit] = str(exc)


def _write_merged(ordered: list[Path], ranks: list[int], attrs: dict[str, object], layers: np.ndarray, mapping: np.ndarray, out: Path,
                  budget: tuple[int, int], damaged: dict[Path, str], progress: Callable[[int, int], None] | None) -> Path:
    layouts: list[RankLayout] = []
    for path in ordered:
        with reading(path, "/ranks"), open_hdf5(path) as f:
            layouts.extend(read_layouts(f))
    header = TraceHeader.of_attrs(attrs, layers, mapping, rank=-1, world_size=int(attrs[Attr.WORLD_SIZE]),  # type: ignore[call-overload]
                                  layouts=tuple(layouts) if len(layouts) == len(ordered) else ())
    files = [open_hdf5(p, rdcc_nbytes=INPUT_CHUNK_CACHE_BYTES, rdcc_w0=1.0) for p in ordered]
    try:
        for f in files:  # request counts the window restack and the pass stream move unchecked otherwise
            check_stored_requests(f)
        with TraceWriter(out, header) as writer:
            _stack_static(files, "stat", writer)
            _stack_static(files, "window", writer)
            group = STREAM_GROUP.get(header.mode)
            groups = [g for g in (group, Data.TIMING) if g is not None and g in files[0]]
            total = sum(f[dataset(g, "pass_id")].shape[0] for g in groups for f in files)
            done = [0]

            def advance(rows: int) -> None:
                done[0] += rows
                if progress is not None:
                    progress(done[0], total)

            shift = append_request_tables(files, writer)
            for g in groups:
                _merge_stream(files, ranks, g, writer, budget, advance, shift=dict(zip(ranks, shift, strict=True)) if g == Data.TOKENS and shift else None)
            for key, value in files[0].attrs.items():
                if key.startswith(Attr.TIMING_PREFIX):
                    writer.set_attr(key, value)
            writer.set_attr(Attr.MERGED_FROM, json.dumps([p.name for p in ordered]))
            if damaged:
                writer.set_attr(MERGED_RANKS_ATTR, json.dumps(ranks))
                writer.set_attr(MERGED_DAMAGED_ATTR, json.dumps([f"{p.name}: {why}" for p, why in damaged.items()]))
            stops = rank_stops(ordered)
            if stops:
                writer.set_attr(Attr.RECOVERED_RANKS, json.dumps(stops))
            return writer.commit()
    finally:
        for f in files:
            f.close()
