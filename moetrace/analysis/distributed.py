"""Analysis of many traces (per-rank files, segments of one run) as a fold of partial accumulators.

:func:`analyze_trace` streams one file. Its time-ordered part is already a
fold of additive accumulators over chunks: per-window counts
(:class:`~.drift.WindowAccumulator`), co-activation and transitions
(:class:`~.coactivation.CoactivationAccumulator`), and the row totals checked
against ``/stat``. :func:`analyze_traces` cuts every input into row ranges
(tasks), computes a :class:`Partial` of those accumulators per task, adds the
partials up in a tree, and builds the same :class:`~.report.AnalysisReport`.
The tasks run in this process, or on a ``dask.distributed`` cluster
(``client=``), where each task reads its row range with h5py on a worker.
Every count is an integer sum, so the order of the additions does not matter
and the report is exactly the single-process one.

Windows of the drift series are ``N`` consecutive distinct pass ids over all
inputs (as in a merged trace, where rows are ordered by pass id): a first,
cheap round of tasks reads only the pass-id columns, the driver fixes the
window boundaries, and each partial holds only the windows its rows touch.

Inputs must be ``per_pass`` or ``per_token`` traces of one run (the same
``run_id`` and shapes): one file per rank (as the streaming modes write
them), several segments per rank (consecutive dumps; their passes must not
overlap), or both. Dask is imported only when a ``client`` is given.
Per-rank ``stat`` traces of one run (each rank dumped alone, as a TP
engine's workers do at exit) are analysed as their merge.

Over 500 lines: the task plan, the worker-side readers and the driver-side merge of one
distributed analysis must agree on one task format; split, none of the pieces is usable alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..ids import to_logical
from ..layout import RankLayout, counted_rows
from ..placement.series import PassSeries
from ..trace.integrity import reading
from ..trace.invariants import TokenTally
from ..trace.merge import merge_traces
from ..trace.reader import PassChunk, TokenChunk, Trace, open_trace
from ..trace.safe_open import open_hdf5
from ..trace.schema import (
    MERGED_DAMAGED_ATTR,
    PASS_FIELDS,
    SAME_RUN_ATTRS,
    STREAM_GROUP,
    TOKEN_FIELDS,
    Attr,
    Data,
    TraceError,
    dataset,
)
from .coactivation import CoactivationAccumulator
from .drift import WindowAccumulator
from .source import MAX_BUCKETS, pass_block, pass_block_rows, select_layers, token_pass_block
from .summary import (
    DEFAULT_WINDOWS,
    AnalysisReport,
    analyze_trace,
    default_window_size,
    progress_bar,
)
from .timing import analyze_timing

__all__ = ["MAX_WINDOW_CELLS", "Partial", "Task", "analyze_traces", "dask_client", "make_tasks", "pass_series"]

#: Largest ``windows x layers x experts`` the reduction may hold (int64 cells, 2 GiB).
MAX_WINDOW_CELLS = 1 << 28
#: Rows per task by default: about 64 MiB of ids for a DeepSeek-sized per_token trace.
DEFAULT_TASK_ROWS = {"per_pass": 1 << 16, "per_token": 1 << 18}


@dataclasses.dataclass(frozen=True)
class Task:
    """Rows ``[start, stop)`` of one trace's streamed group (``/passes`` or ``/tokens``); ``path`` is absolute."""

    path: str
    mode: str
    start: int
    stop: int
    ranks: tuple[int, ...] | None = None  # a merged trace's counted ranks (rows of others replicate them); None: every row


@dataclasses.dataclass(frozen=True)
class _Context:
    """What every partial needs: the selected layers, the id map and the window boundaries."""

    layer_index: np.ndarray  # [L] compact indices of the selected layers
    physical_to_logical: np.ndarray  # [L, P] of the selected layers
    num_physical: int
    num_logical: int
    window_starts: np.ndarray  # [W] first pass id of each window (sorted)
    chunk_rows: int
    coactivation: bool = True  # also count co-activation and transitions (per_token)


@dataclasses.dataclass
class Partial:
    """Additive accumulators of some rows.

    Attributes:
        total: ``[L, P]`` counts of every row (checked against ``/stat``).
        first_window: index of ``window_counts[0]`` in the run's windows.
        window_counts: ``[K, L, P]`` counts per window touched.
        window_tokens: ``[K]`` tokens per window touched.
        coactivation: co-activation and transitions (``per_token`` only).
        tallies: per file, every ``/tokens`` row read (all ranks, all layers) counted for the
            comparison with that file's ``/stat`` once the partials of all its rows are added
            (:class:`~moetrace.trace.invariants.TokenTally`; ``per_token`` only).
    """

    total: np.ndarray
    first_window: int
    window_counts: np.ndarray
    window_tokens: np.ndarray
    coactivation: CoactivationAccumulator | None
    tallies: dict[str, TokenTally] = dataclasses.field(default_factory=dict)

    def merge(self, other: Partial) -> Partial:
        """The partial of both row sets (a new object; windows are aligned by index)."""
        first = min(self.first_window, other.first_window)
        end = max(self.first_window + len(self.window_tokens), other.first_window + len(other.window_tokens))
        counts = np.zeros((end - first, *self.total.shape), dtype=np.int64)
        tokens = np.zeros(end - first, dtype=np.int64)
        for part in (self, other):
            at = part.first_window - first
            counts[at : at + len(part.window_tokens)] += part.window_counts
            tokens[at : at + len(part.window_tokens)] += part.window_tokens
        co = self.coactivation
        if co is not None and other.coactivation is not None:
            co = dataclasses.replace(co)  # a fresh accumulator of the same shape, then both added
            co.merge(self.coactivation)  # type: ignore[arg-type]
            co.merge(other.coactivation)
        tallies = dict(self.tallies)
        for path, tally in other.tallies.items():
            tallies[path] = tallies[path].merge(tally) if path in tallies else tally
        return Partial(self.total + other.total, first, counts, tokens, co, tallies)


def _rows(file: h5py.File, path: str, group: str, names: Sequence[str], start: int, stop: int) -> dict[str, np.ndarray]:
    with reading(path, f"/{group} rows {start}..{stop - 1}"):
        return {n: np.asarray(file[dataset(group, n)][start:stop]) for n in names}


def task_pass_ids(task: Task) -> np.ndarray:
    """Distinct pass ids of a task's rows (sorted)."""
    with reading(task.path), open_hdf5(task.path) as f:
        return np.unique(_rows(f, task.path, STREAM_GROUP[task.mode], ["pass_id"], task.start, task.stop)["pass_id"]).astype(np.int64)


def task_partial(task: Task, ctx: _Context) -> Partial:
    """Read a task's rows with h5py, ``ctx.chunk_rows`` at a time, and fold them into a :class:`Partial`."""
    num_layers = len(ctx.layer_index)
    total = np.zeros((num_layers, ctx.num_physical), dtype=np.int64)
    co = CoactivationAccumulator(ctx.physical_to_logical, ctx.layer_index, ctx.num_logical) if task.mode == "per_token" and ctx.coactivation else None
    counts: np.ndarray | None = None
    tokens = np.zeros(0, dtype=np.int64)
    first = -1
    group = STREAM_GROUP[task.mode]
    tallies: dict[str, TokenTally] = {}
    with reading(task.path), open_hdf5(task.path) as f:
        if task.mode == "per_token" and Data.STAT_PHYSICAL_COUNT in f:
            tallies[task.path] = TokenTally(task.path, f[Data.STAT_PHYSICAL_COUNT].shape)
        for start in range(task.start, task.stop, ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, task.stop)
            rows = _rows(f, task.path, group, TOKEN_FIELDS if task.mode == "per_token" else PASS_FIELDS, start, stop)
            ranks = _rows(f, task.path, group, ["rank"], start, stop)["rank"] if dataset(group, "rank") in f else None
            if tallies:  # every row, before the counted-rank filter
                tallies[task.path].add(rows["topk_ids"], ranks)
            if task.ranks is not None and ranks is not None:
                keep = np.isin(ranks, task.ranks)
                rows = {n: a[keep] for n, a in rows.items()}
            if task.mode == "per_token":
                chunk = TokenChunk(**rows)
                block = token_pass_block(chunk, ctx.layer_index, ctx.num_physical)
                if co is not None:
                    co.add(chunk.topk_ids)
            else:
                block = pass_block(PassChunk(**rows), ctx.layer_index)
            if not len(block.pass_id):
                continue
            window = np.searchsorted(ctx.window_starts, block.pass_id, side="right") - 1  # [n], non-decreasing
            if counts is None:
                first = int(window[0])
                span = int(np.searchsorted(ctx.window_starts, _last_pass(f, task), side="right")) - first
                counts = np.zeros((span, num_layers, ctx.num_physical), dtype=np.int64)
                tokens = np.zeros(span, dtype=np.int64)
            starts = np.flatnonzero(np.concatenate([[True], window[1:] != window[:-1]]))
            at = window[starts] - first
            counts[at] += np.add.reduceat(block.physical_count, starts, axis=0)
            tokens[at] += np.add.reduceat(block.num_tokens, starts)
            total += block.physical_count.sum(axis=0)
    if counts is None:
        counts = np.zeros((0, num_layers, ctx.num_physical), dtype=np.int64)
        first = 0
    return Partial(total, first, counts, tokens, co, tallies)


def _last_pass(file: h5py.File, task: Task) -> int:
    return int(file[dataset(STREAM_GROUP[task.mode], "pass_id")][task.stop - 1])


def merge_partials(a: Partial, b: Partial) -> Partial:
    """``a.merge(b)``, as a plain function (a Dask task)."""
    return a.merge(b)


def make_tasks(paths: Sequence[Path | str], task_rows: int | None = None) -> list[Task]:
    """Row-range tasks over the streamed group of every trace (``task_rows`` rows each, default by mode)."""
    tasks = []
    for path in paths:
        with open_trace(path) as trace:
            if trace.mode not in STREAM_GROUP:
                raise TraceError(f"{trace.path}: a {trace.mode!r} trace; analysing several traces needs per_pass or per_token traces "
                                 "(merge stat traces with `moetrace merge` and analyse the result)")
            rows = trace.num_rows(dataset(STREAM_GROUP[trace.mode], "pass_id"))
            step = task_rows or DEFAULT_TASK_ROWS[trace.mode]
            if step < 1:
                raise ValueError(f"task_rows must be positive, got {step}")
            path = str(trace.path.resolve())  # workers may run elsewhere: absolute paths
            keep = trace.counted_ranks() if trace.has(dataset(STREAM_GROUP[trace.mode], "rank")) else None
            ranks = tuple(sorted(keep)) if keep is not None and len(keep) < len(trace.layouts) else None
            tasks += [Task(path, trace.mode, s, min(s + step, rows), ranks) for s in range(0, rows, step)]
    return tasks


# ---------------------------------------------------------------------------- executors
Runner = Callable[[Callable[..., Any], list[Any], dict[str, Any]], list[Any]]


def _run_local(tasks: list[Task], ctx_for: Callable[[list[np.ndarray]], _Context], progress: bool | None) -> tuple[_Context, Partial | None]:
    """The tasks one after another, each partial added to the running total as it is made
    (one partial held, not one per task: a task's ``[windows, L, P]`` counts are 2.7 MB at
    DeepSeek-V3 size, per-rank files are a task each)."""
    with progress_bar(progress, 2 * len(tasks), f"analyzing {len(tasks)} row ranges") as advance:
        ids = []
        for task in tasks:
            ids.append(task_pass_ids(task))
            advance(1)
        ctx = ctx_for(ids)
        total: Partial | None = None
        for task in tasks:
            part = task_partial(task, ctx)
            total = part if total is None else total.merge(part)
            advance(1)
    return ctx, total


def _run_dask(client: Any, tasks: list[Task], ctx_for: Callable[[list[np.ndarray]], _Context]) -> tuple[_Context, Partial | None]:
    from distributed import KilledWorker

    try:
        ids = client.gather(client.map(task_pass_ids, tasks, pure=False))
        ctx = ctx_for(ids)
        shared = client.scatter(ctx, broadcast=True)
        level = client.map(task_partial, tasks, ctx=shared, pure=False)
        while len(level) > 1:  # tree reduction: pairs of partials merged on the workers
            nxt = [client.submit(merge_partials, level[i], level[i + 1], pure=False) for i in range(0, len(level) - 1, 2)]
            level = nxt + ([level[-1]] if len(level) % 2 else [])
        return ctx, (level[0].result() if level else None)
    except KilledWorker as exc:
        raise TraceError(f"a Dask worker died repeatedly while running {exc.task}: out of memory or killed? "
                         "See the worker logs; smaller tasks (task_rows) need less memory per worker") from exc


@contextlib.contextmanager
def dask_client(scheduler: str, connect_timeout: float = 30.0) -> Iterator[Any]:
    """A ``distributed.Client`` for ``--scheduler``: ``local[:N]`` or ``tcp://HOST:PORT``.

    ``local`` starts a ``LocalCluster`` of ``N`` single-threaded worker processes
    (default: one per core) for the duration; an address connects to a running
    scheduler (``dask scheduler`` / ``dask worker``, or any ``dask.distributed``
    deployment) whose workers can import moetrace and read the trace paths.

    Raises:
        ValueError: a malformed spec, Dask is not installed, or the scheduler cannot be reached.
    """
    local = re.fullmatch(r"local(?::(\d+))?", scheduler)
    if local is None and not re.fullmatch(r"(tcp|tls|ucx|inproc)://\S+", scheduler):
        raise ValueError(f"--scheduler {scheduler!r}: use local, local:N (N worker processes) or tcp://HOST:PORT")
    try:
        from distributed import Client, LocalCluster
    except ImportError as exc:
        raise ValueError(f"--scheduler needs Dask: pip install 'moetrace[dask]' ({exc})") from None
    if local is not None:
        workers = int(local.group(1) or os.cpu_count() or 1)
        if workers < 1:
            raise ValueError(f"--scheduler {scheduler!r}: needs at least 1 worker")
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            yield client
        return
    try:
        client = Client(scheduler, timeout=connect_timeout)
    except (OSError, TimeoutError) as exc:
        raise ValueError(f"cannot reach the Dask scheduler at {scheduler} ({exc}); start one (`dask scheduler`) or check the address") from None
    with client:
        yield client


# ---------------------------------------------------------------------------- the report
@dataclasses.dataclass
class _Inputs:
    """What the driver reads from every trace's attributes and ``/stat`` (small)."""

    paths: list[Path]
    ranks: dict[str, int]  # absolute path -> its rank attribute
    attrs: dict[str, object]
    mode: str
    layer_index: np.ndarray
    layer_ids: np.ndarray
    mapping: np.ndarray
    num_physical: int
    num_logical: int
    ep_size: int
    physical: np.ndarray
    logical: np.ndarray
    passes_by_rank: dict[int, int]
    num_tokens: int
    invalid_ids: int
    dropped: int
    default_window: int
    timing: dict[str, object] | None
    notes: list[str]

    def chunk_rows(self, chunk_tokens: int, chunk_passes: int) -> int:
        """Rows a task reads at once: ``chunk_tokens``, or ``chunk_passes`` bounded in bytes (:func:`~.source.pass_block_rows`)."""
        if self.mode == "per_token":
            return chunk_tokens
        return pass_block_rows(chunk_passes, int(self.attrs[Attr.NUM_LAYERS]) * self.num_physical)  # type: ignore[call-overload]


@dataclasses.dataclass
class _File:
    """One input: its identity and its ``/stat`` totals over the selected layers."""

    path: Path
    attrs: dict[str, object]
    rank: int
    layer_index: np.ndarray
    layer_ids: np.ndarray
    mapping: np.ndarray
    physical: np.ndarray  # [L, P]
    logical: np.ndarray  # [L, E]
    passes: np.ndarray  # [R] per rank row of the file
    tokens: int
    invalid_ids: int
    dropped: int
    has_timing: bool
    layouts: tuple[RankLayout, ...]


def _read_file(trace: Trace, layers: Sequence[int] | None) -> _File:
    index = select_layers(trace, layers)
    return _File(
        path=trace.path, attrs=dict(trace.attrs), rank=int(trace.attrs[Attr.RANK]), layer_index=index,
        layer_ids=np.asarray(trace.layers[index]), mapping=trace.physical_to_logical[index],
        physical=trace.physical_count()[index].astype(np.int64), logical=trace.logical_count()[index].astype(np.int64),
        passes=np.atleast_1d(trace.num_passes()), tokens=trace.tokens_served(),
        invalid_ids=int(trace.invalid_ids()[:, index].sum()), dropped=int(trace.dropped_tokens()[:, index].sum()),
        has_timing=trace.has_timing, layouts=trace.layouts,
    )


def _counted_files(files: list[_File]) -> tuple[list[bool], list[bool]]:
    """Per file: whether its counts, and its tokens, enter the run's totals. Per-rank files of ranks
    that replicate another input rank's view (TP attention) do not; without layouts every file counts."""
    if len(files) == 1 or not all(len(f.layouts) == 1 for f in files):
        return [True] * len(files), [True] * len(files)
    by_rank = {f.layouts[0].rank: f.layouts[0] for f in files}
    ranks = sorted(by_rank)
    counted = counted_rows([by_rank[r].token_group for r in ranks], ranks, [by_rank[r].pp_rank for r in ranks])
    assign = {r for r, keep in zip(ranks, counted.assignments, strict=True) if keep}
    tokens = {r for r, keep in zip(ranks, counted.tokens, strict=True) if keep}
    return [f.rank in assign for f in files], [f.rank in tokens for f in files]


def _check_same_run(files: list[_File]) -> None:
    first = files[0]
    for f in files[1:]:
        if f.attrs.get(Attr.RUN_ID) != first.attrs.get(Attr.RUN_ID):
            raise TraceError(f"{f.path}: run_id {f.attrs.get(Attr.RUN_ID)} differs from {first.path}'s {first.attrs.get(Attr.RUN_ID)}; "
                             "analyse each run on its own")
        for key in SAME_RUN_ATTRS:
            if f.attrs.get(key) != first.attrs.get(key):
                raise TraceError(f"{f.path}: {key}={f.attrs.get(key)!r} differs from {first.path}'s {first.attrs.get(key)!r}; not traces of one run")
        if not (np.array_equal(f.layer_ids, first.layer_ids) and np.array_equal(f.mapping, first.mapping)):
            raise TraceError(f"{f.path}: /layers or /physical_to_logical differs from {first.path}'s; not traces of one run")
        if f.rank < 0:
            raise TraceError(f"{f.path}: already holds every rank (rank=-1); analyse it alone, or its per-rank inputs")
    if first.rank < 0 and len(files) > 1:
        raise TraceError(f"{first.path}: already holds every rank (rank=-1); analyse it alone, or its per-rank inputs")


class _RunView:
    """Per-rank traces ``0..W-1`` of one run, read as their merged trace would be (for :func:`analyze_timing`).

    ``/stat`` rows are stacked in rank order and ``/timing`` rows concatenated
    with their rank column, as :func:`~moetrace.trace.merge.merge_traces`
    writes them; the timing analysis does not depend on row order. The
    streamed groups are read file after file. Runs in the driver process.
    """

    def __init__(self, traces: list[Trace]) -> None:
        self._traces = traces
        first = traces[0]
        self.attrs = {**first.attrs, "rank": -1, "world_size": len(traces)}
        self.ep_size, self.num_layers, self.num_physical_experts = first.ep_size, first.num_layers, first.num_physical_experts
        self.has_timing = all(t.has_timing for t in traces)

    def has(self, name: str) -> bool:
        return self._traces[0].has(name)

    def timing_stat(self) -> dict[str, np.ndarray]:
        stats = [t.timing_stat() for t in self._traces]
        out = {k: np.concatenate([np.atleast_1d(s[k]) for s in stats]) for k in stats[0] if k != "histogram_edges"}
        return {**out, "histogram_edges": stats[0]["histogram_edges"]}

    def timing_rows(self) -> dict[str, np.ndarray]:
        rows = [t.timing_rows() for t in self._traces]
        return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}

    def send_count(self) -> np.ndarray:
        return np.concatenate([t.send_count() for t in self._traces])

    def iter_passes(self, chunk: int = 1024) -> Iterator[PassChunk]:
        for t in self._traces:
            yield from t.iter_passes(chunk)

    def iter_tokens(self, chunk: int = 65536) -> Iterator[TokenChunk]:
        for t in self._traces:
            yield from t.iter_tokens(chunk)


def _run_timing(paths: list[Path]) -> dict[str, object] | None:
    """The timing section of per-rank traces ``0..W-1`` (sorted by rank), as for their merged trace."""
    with contextlib.ExitStack() as stack:
        view = _RunView([stack.enter_context(open_trace(p)) for p in paths])
        return analyze_timing(view)  # type: ignore[arg-type]


def _read_inputs(paths: Sequence[Path | str], layers: Sequence[int] | None, timing: bool = True) -> _Inputs:
    if not paths:
        raise TraceError("no traces to analyse")
    seen: dict[Path, Path | str] = {}
    for path in paths:
        if Path(path).resolve() in seen:
            raise TraceError(f"{path}: given twice (as {seen[Path(path).resolve()]})")
        seen[Path(path).resolve()] = path
    files, timing_section, default_window = [], None, 0
    for path in paths:
        with open_trace(path) as trace:
            files.append(_read_file(trace, layers))
            if len(paths) == 1:  # exactly what analyze_trace reports for it
                timing_section = analyze_timing(trace) if timing else None
                default_window = default_window_size(trace, trace.num_rows(dataset(STREAM_GROUP.get(trace.mode, Data.TOKENS), "pass_id")))
    files.sort(key=lambda f: (f.rank, str(f.path)))  # the report does not depend on the order given
    _check_same_run(files)
    first = files[0]
    passes_by_rank: dict[int, int] = {}  # segments of a rank add up; a merged file has one row per rank
    for f in files:
        for r, n in enumerate(f.passes):
            key = f.rank if f.rank >= 0 else r
            passes_by_rank[key] = passes_by_rank.get(key, 0) + int(n)
    notes = []
    ranks = sorted({f.rank for f in files})
    world = int(first.attrs.get(Attr.WORLD_SIZE, 1))
    if len(files) > 1 and world > 1 and ranks != list(range(world)):
        notes.append(f"ranks {sorted(set(range(world)) - set(ranks))} of {world} are not among the inputs")
    if timing and len(files) > 1 and any(f.has_timing for f in files):
        if all(f.has_timing for f in files) and [f.rank for f in files] == list(range(world)):
            timing_section = _run_timing([f.path for f in files])
        else:
            notes.append("phase timing is analysed across one file per rank 0..W-1, all timed; "
                         "for these inputs `moetrace merge` them (or recover the segments) and analyse the result")
    attrs = dict(first.attrs)
    if len(ranks) > 1:
        attrs[Attr.RANK] = -1
    num_passes = max(passes_by_rank.values(), default=0)
    count_assign, count_tokens = _counted_files(files)
    counted = [f for f, keep in zip(files, count_assign, strict=True) if keep]
    if len(counted) < len(files):
        notes.append(f"ranks {sorted({f.rank for f in files} - {f.rank for f in counted})} replicate the routing of ranks "
                     f"{sorted({f.rank for f in counted})} (TP attention): their views are not added")
    return _Inputs(
        paths=[f.path for f in counted], ranks={str(f.path.resolve()): f.rank for f in files}, attrs=attrs, mode=str(first.attrs[Attr.MODE]),
        layer_index=first.layer_index, layer_ids=first.layer_ids, mapping=first.mapping,
        num_physical=int(first.attrs[Attr.NUM_PHYSICAL_EXPERTS]), num_logical=int(first.attrs[Attr.NUM_LOGICAL_EXPERTS]),
        ep_size=int(first.attrs[Attr.EP_SIZE]), physical=sum(f.physical for f in counted), logical=sum(f.logical for f in counted),
        passes_by_rank=passes_by_rank, num_tokens=sum(f.tokens for f, keep in zip(files, count_tokens, strict=True) if keep),
        invalid_ids=sum(f.invalid_ids for f in counted), dropped=sum(f.dropped for f in counted),
        default_window=default_window or max(1, math.ceil(num_passes / DEFAULT_WINDOWS)),
        timing=timing_section, notes=notes,
    )


def _check_segments(tasks: list[Task], ids: list[np.ndarray], ranks: dict[str, int]) -> None:
    """Files of one rank must hold disjoint pass ranges (consecutive segments, not the same one twice)."""
    spans: dict[str, tuple[int, int]] = {}
    for task, pids in zip(tasks, ids, strict=True):
        if len(pids):
            lo, hi = spans.get(task.path, (int(pids[0]), int(pids[-1])))
            spans[task.path] = (min(lo, int(pids[0])), max(hi, int(pids[-1])))
    by_rank: dict[int, list[tuple[int, int, str]]] = {}
    for path, (lo, hi) in spans.items():
        by_rank.setdefault(ranks[path], []).append((lo, hi, path))
    for rank, files in by_rank.items():
        files.sort()
        for (lo_a, hi_a, a), (lo_b, hi_b, b) in itertools.pairwise(files):
            if lo_b <= hi_a:
                raise TraceError(f"{a} and {b} are both rank {rank} and hold overlapping passes "
                                 f"({lo_a}..{hi_a} and {lo_b}..{hi_b}): the same segment twice?")


@dataclasses.dataclass
class _Folded:
    """The reduced partial of every row of the inputs, and the windows it is counted in."""

    distinct: np.ndarray  # [n] sorted distinct pass ids of all inputs
    per_window: int
    total: Partial | None

    def windows(self) -> Iterator[np.ndarray]:
        """The pass ids of each window of ``total`` (``total.window_counts[w]`` counts window ``w``)."""
        if self.total is not None:
            for w in range(len(self.total.window_tokens)):
                index = self.total.first_window + w
                yield self.distinct[index * self.per_window : (index + 1) * self.per_window]


def _fold(inputs: _Inputs, tasks: list[Task], per_window: Callable[[int], int], chunk_rows: int, client: Any,
          progress: bool | None, coactivation: bool = True) -> _Folded:
    """Run the tasks (in this process or on ``client``) and add their partials up.

    ``per_window(n)`` gives the passes per window once the ``n`` distinct pass ids are known.
    """
    folded = _Folded(np.zeros(0, dtype=np.int64), 1, None)

    def context(ids: list[np.ndarray]) -> _Context:
        _check_segments(tasks, ids, inputs.ranks)
        folded.distinct = np.unique(np.concatenate([np.zeros(0, np.int64), *ids]))
        folded.per_window = n = per_window(len(folded.distinct))
        windows = math.ceil(len(folded.distinct) / n)
        cells = windows * len(inputs.layer_index) * inputs.num_physical
        if cells > MAX_WINDOW_CELLS:
            raise ValueError(f"{windows} windows x {len(inputs.layer_index)} layers x {inputs.num_physical} experts is too many "
                             f"to reduce (> {MAX_WINDOW_CELLS} counts); pass a larger window (at least "
                             f"{math.ceil(len(folded.distinct) * len(inputs.layer_index) * inputs.num_physical / MAX_WINDOW_CELLS)} passes)")
        return _Context(inputs.layer_index, inputs.mapping, inputs.num_physical, inputs.num_logical,
                        folded.distinct[::n].copy(), chunk_rows, coactivation)

    _, folded.total = _run_local(tasks, context, progress) if client is None else _run_dask(client, tasks, context)
    for path, tally in (folded.total.tallies if folded.total is not None else {}).items():
        with open_trace(path) as trace:  # every row of the file added: held to its /stat, as Trace.iter_tokens does
            tally.check(trace)
    return folded


def analyze_traces(
    paths: Sequence[Path | str],
    *,
    layers: Sequence[int] | None = None,
    window: int | None = None,
    top: int = 5,
    progress: bool | None = False,
    chunk_tokens: int = 32768,
    chunk_passes: int = 1024,
    task_rows: int | None = None,
    client: Any = None,
) -> AnalysisReport:
    """Analyse the traces of one run as one: what :func:`analyze_trace` gives for their merged trace.

    Args:
        paths: ``per_pass`` or ``per_token`` traces of one run (per-rank files, segments), or the
            per-rank ``stat`` traces of one run (analysed as their merge).
        layers, window, top: as for :func:`~.report.analyze_trace`.
        progress: a progress bar over the tasks on stderr (in-process runs only).
        chunk_tokens, chunk_passes: rows a task reads at once (bound its memory).
        task_rows: rows per task (default 2^18 tokens or 2^16 passes).
        client: a ``distributed.Client``: run the tasks on its cluster; ``None``: in this process.

    Raises:
        TraceError: an input is unreadable, not a streaming trace (or all per-rank ``stat`` traces), or not of the same run.
        ValueError: ``window`` or ``top`` is not positive.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of passes, got {window}")
    if top < 1:
        raise ValueError(f"top must be positive, got {top}")
    modes = set()
    for path in paths:
        with open_trace(path) as trace:
            modes.add(trace.mode)
    if modes == {"stat"}:  # stat traces are one small window each: nothing to distribute
        if len(paths) == 1:
            return analyze_trace(paths[0], layers=layers, window=window, top=top, progress=progress)
        return _analyze_stat_ranks(paths, layers=layers, window=window, top=top, progress=progress)
    inputs = _read_inputs(paths, layers)
    fold = _fold(inputs, make_tasks(inputs.paths, task_rows), lambda _: window or inputs.default_window,
                 inputs.chunk_rows(chunk_tokens, chunk_passes), client, progress)
    distinct, total, passes_per_window = fold.distinct, fold.total, fold.per_window
    drift = WindowAccumulator(passes_per_window, inputs.mapping, inputs.ep_size, inputs.layer_ids)
    coactivation = None
    if total is not None:
        for w, members in enumerate(fold.windows()):
            drift.add_window(int(members[0]), int(members[-1]), len(members), int(total.window_tokens[w]), total.window_counts[w])
        coactivation = total.coactivation
    series = drift.finish()
    notes = list(inputs.notes)
    if inputs.mode == "per_token" and coactivation is None:
        coactivation = CoactivationAccumulator(inputs.mapping, inputs.layer_index, inputs.num_logical)
    if inputs.mode != "per_token":
        notes.append("co-activation and cross-layer transitions need a per_token trace")
    if len(distinct) and not np.array_equal(drift.total, inputs.physical):
        notes.append(f"/{STREAM_GROUP[inputs.mode]} does not add up to /stat totals; the trace may have been edited or partly written")
    if not len(distinct):
        notes.append("no time-ordered data (empty window or stream): no drift series")
    return AnalysisReport(
        path=inputs.paths[0],
        attrs=inputs.attrs,
        layer_ids=inputs.layer_ids,
        physical_count=inputs.physical,
        logical_count=inputs.logical,
        ep_size=inputs.ep_size,
        num_passes=max(inputs.passes_by_rank.values(), default=0),
        num_tokens=inputs.num_tokens,
        invalid_ids=inputs.invalid_ids,
        dropped=inputs.dropped,
        top=top,
        coactivation=coactivation,
        drift=series if len(series) else None,
        notes=notes,
        timing=inputs.timing,
    )


def _analyze_stat_ranks(paths: Sequence[Path | str], **options: Any) -> AnalysisReport:
    """Per-rank ``stat`` traces of one run (each rank's own dump, as a TP engine's workers write at exit):
    :func:`analyze_trace` of their merge, which :func:`~moetrace.trace.merge.merge_traces` writes
    into a temporary directory (its ``/stat`` rows and windows are what a gathered dump holds).

    Raises:
        TraceError: the inputs are not the ranks of one run, or one is damaged (named).
    """
    with tempfile.TemporaryDirectory(prefix="moetrace-analyze-") as tmp:
        merged = merge_traces(paths, Path(tmp) / "merged.h5")
        with open_trace(merged) as trace:
            damaged = trace.attrs.get(MERGED_DAMAGED_ATTR)
        if damaged:
            raise TraceError(f"damaged per-rank stat traces: {damaged}; analyse the intact ones with `moetrace merge` and `analyze`")
        report = analyze_trace(merged, **options)
    return dataclasses.replace(report, path=Path(paths[0]), notes=[f"read as the merge of {len(paths)} per-rank stat traces", *report.notes])


def pass_series(
    paths: Sequence[Path | str],
    *,
    layers: Sequence[int] | None = None,
    bucket: int | None = None,
    task_rows: int | None = None,
    chunk_tokens: int = 32768,
    chunk_passes: int = 1024,
    client: Any = None,
) -> PassSeries:
    """:func:`~moetrace.analysis.source.load_series` of the run's merged trace, from the same partials (``moetrace placement``).

    ``bucket=None`` picks the bucket size ``load_series`` ends with: the
    smallest power of two that keeps fewer than ``2 * MAX_BUCKETS`` completed
    buckets.

    Raises:
        TraceError: as for :func:`analyze_traces`, or fewer than two passes.
        ValueError: ``bucket`` is not positive.
    """
    if bucket is not None and bucket <= 0:
        raise ValueError(f"bucket must be positive, got {bucket!r}")

    def size(distinct: int) -> int:
        if bucket is not None:
            return int(bucket)
        passes = 1
        while distinct - 1 >= 2 * MAX_BUCKETS * passes:
            passes *= 2
        return passes

    inputs = _read_inputs(paths, layers, timing=False)
    fold = _fold(inputs, make_tasks(inputs.paths, task_rows), size, inputs.chunk_rows(chunk_tokens, chunk_passes),
                 client, progress=False, coactivation=False)
    members = list(fold.windows())
    if fold.total is None or sum(len(m) for m in members) < 2:
        raise TraceError(f"{', '.join(map(str, inputs.paths))}: hold-out and backtest need time-ordered passes, and these traces hold "
                         f"{sum(len(m) for m in members)} pass(es); record over more passes")
    physical = fold.total.window_counts
    return PassSeries(
        bucket=fold.per_window,
        passes=np.asarray([len(m) for m in members], dtype=np.int64),
        first_pass=np.asarray([m[0] for m in members], dtype=np.int64),
        logical=to_logical(physical, inputs.mapping).astype(np.float64),
        physical=physical,
        physical_to_logical=inputs.mapping,
    )
