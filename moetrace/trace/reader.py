"""Read moetrace HDF5 traces with typed accessors.

``open_trace(path)`` checks that the file is a complete moetrace trace of a
schema version this library understands, and raises :class:`TraceError`
naming the file and the problem otherwise. Large datasets are read in chunks
(``iter_passes``, ``iter_tokens``) so memory stays bounded.

Over 500 lines: one class answers every read of one open file (attributes, layout, ``/stat``,
``/window``, timing, streamed rows with their rank and pass-phase filters), each through the
same integrity boundary and invariants; the totals by pass phase are :mod:`.pass_phases`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from ..layout import CountedRows, RankLayout
from . import integrity, invariants
from .files import parse_temporary, process_alive
from .integrity import reading
from .ranks import counted_of, read_layouts
from .request_table import read_request_table
from .safe_open import open_hdf5
from .schema import (
    COMPLETE_ATTR,
    PADDING_IDS,
    REQUIRED_ATTRS,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    TOKEN_REQUEST_FIELDS,
    Attr,
    Data,
    TraceDamageError,
    TraceError,
    dataset,
)

__all__ = ["PassChunk", "TokenChunk", "Trace", "Window", "open_trace"]


@dataclasses.dataclass(frozen=True)
class Window:
    """The ``stat`` mode's time-ordered window, oldest pass first.

    Attributes:
        pass_id: ``[R, W]`` pass ids (``-1`` marks rows a rank did not fill).
        timestamp: ``[R, W]`` unix seconds at pass end.
        num_tokens: ``[R, W]`` tokens in each pass.
        physical_count: ``[R, W, L, P]`` per-pass counts.
        pass_phase: ``[R, W]`` pass phase codes (:data:`moetrace.pass_phase.PASS_PHASES`; 0 unknown).
        num_requests: ``[R, W]`` requests in each pass (-1 unknown).
    """

    pass_id: np.ndarray
    timestamp: np.ndarray
    num_tokens: np.ndarray
    physical_count: np.ndarray
    pass_phase: np.ndarray
    num_requests: np.ndarray


@dataclasses.dataclass(frozen=True)
class PassChunk:
    """Consecutive rows of ``/passes`` (``N`` passes)."""

    pass_id: np.ndarray  # [N]
    timestamp: np.ndarray  # [N]
    num_tokens: np.ndarray  # [N]
    physical_count: np.ndarray  # [N, L, P]
    invalid_ids: np.ndarray  # [N, L]
    send_count: np.ndarray  # [N, L, R]
    recv_count: np.ndarray  # [N, L, R]
    pass_phase: np.ndarray | None = None  # [N] pass phase codes (0 unknown: also every row of a trace without them)
    num_requests: np.ndarray | None = None  # [N] requests in the pass (-1 unknown)


@dataclasses.dataclass(frozen=True)
class TokenChunk:
    """Consecutive rows of ``/tokens`` (``M`` tokens)."""

    topk_ids: np.ndarray  # [M, L, k] physical ids, -1 = no routing
    pass_id: np.ndarray  # [M]
    position: np.ndarray  # [M] index of the token in its pass
    pass_phase: np.ndarray | None = None  # [M] pass phase code of the token's pass (0 unknown)
    request: np.ndarray | None = None  # [M] int32 index into Trace.request_table() (-1: none); None: the trace has no request rows
    request_position: np.ndarray | None = None  # [M] int32 position of the token in its request (-1: none)
    rank: np.ndarray | None = None  # [M] int32 source rank of each row of a merged trace; None: a per-rank file


def _check_filters(file: h5py.File, path: Path) -> None:
    """Make sure every dataset's compression filter can be decoded here.

    Filters outside HDF5/h5py (zstd, blosc2: ``compression="zstd"``) come from
    ``hdf5plugin``, imported here when a trace needs it and it is installed.

    Raises:
        TraceError: a filter is missing, naming it and the package to install.
    """
    missing: dict[int, str] = {}

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            plist = obj.id.get_create_plist()
            for i in range(plist.get_nfilters()):
                code, _, _, filter_name = plist.get_filter(i)
                if not h5py.h5z.filter_avail(code):
                    missing.setdefault(code, f"/{name} uses filter {code} ({filter_name.decode(errors='replace')})")

    file.visititems(visit)
    if not missing:
        return
    try:
        import hdf5plugin  # noqa: F401  (registers its filters with HDF5)
    except ImportError:
        raise TraceError(f"{path}: {'; '.join(missing.values())}, which this installation cannot decode; install hdf5plugin (pip install 'moetrace[compression]')") from None
    still = [text for code, text in missing.items() if not h5py.h5z.filter_avail(code)]
    if still:
        raise TraceError(f"{path}: {'; '.join(still)}, which neither HDF5 nor hdf5plugin provides here")


def _unfinished_hint(path: Path) -> str:
    """For a writer's temporary file: whose it is and what to do instead."""
    parsed = parse_temporary(path)
    if parsed is None:
        return ""
    target, host, pid = parsed
    alive = process_alive(pid, host)
    state = {True: "is still running", False: "is no longer running", None: f"ran on host {host}"}[alive]
    what = f"the unfinished temporary of {target!r}, written by process {pid}, which {state}"
    if alive:
        return f"; this is {what}: wait for it to finish"
    return f"; this is {what}: its complete segments can be gathered with `moetrace recover {path.parent}`"


class Trace:
    """An open moetrace trace. Use as a context manager or call :meth:`close`.

    Opening checks the schema, the trace's checksums (:mod:`.integrity`: digests now,
    each chunk's Fletcher-32 as it is read) and its layout invariants
    (:mod:`.invariants`); the ``/stat`` and ``/window`` invariants are checked the first
    time either is read. Every HDF5 failure becomes a :class:`TraceError`.

    Attributes:
        verified: the trace carries checksums (``False``: written before them; readable,
            but nothing proves it unchanged).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceError(f"{self.path}: no such file")
        if parse_temporary(self.path) is not None:  # never committed, whole or not: `recover` sweeps it
            raise TraceError(f"{self.path}: not a trace{_unfinished_hint(self.path)}")
        try:
            self._file = open_hdf5(self.path)
        except Exception as exc:
            if not (integrity.from_hdf5(exc) or isinstance(exc, OSError)):
                raise
            raise TraceDamageError(self.path, f"{self.path}: not an HDF5 file or truncated, or its superblock is damaged ({' '.join(str(exc).split())}){_unfinished_hint(self.path)}") from exc
        self._stat_checked = False
        try:
            with reading(self.path):
                self._attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in self._file.attrs.items()}
                self._validate()
        except BaseException:
            self._file.close()
            raise

    def _validate(self) -> None:
        attrs = self._attrs
        if attrs.get(Attr.SCHEMA) != SCHEMA_NAME:
            raise TraceError(f"{self.path}: not a moetrace trace (root attribute schema={attrs.get(Attr.SCHEMA)!r})")
        version = int(attrs.get(Attr.SCHEMA_VERSION, -1))  # type: ignore[call-overload]
        if version > SCHEMA_VERSION:
            raise TraceError(
                f"{self.path}: schema version {version} is newer than this moetrace understands "
                f"({SCHEMA_VERSION}); upgrade moetrace"
            )
        if version < 1:
            raise TraceError(f"{self.path}: invalid schema version {version}")
        missing = [k for k in REQUIRED_ATTRS if k not in attrs]
        if missing:
            raise TraceError(f"{self.path}: missing root attributes {missing}")
        if not bool(attrs.get(COMPLETE_ATTR, False)):
            raise TraceError(f"{self.path}: trace is incomplete (its writer did not finish){_unfinished_hint(self.path)}")
        for name in ("layers", "physical_to_logical"):
            if name not in self._file:
                raise TraceError(f"{self.path}: missing dataset /{name}")
        _check_filters(self._file, self.path)
        self.verified = integrity.is_sealed(self._file)
        if self.verified:
            problems = integrity.check_seal(self._file, self.path)
            if problems:
                name, problem = next(iter(problems.items()))
                others = f" (and {len(problems) - 1} more objects)" if len(problems) > 1 else ""
                raise TraceDamageError(self.path, integrity.damage_message(self.path, "the root" if name == "/" else name, problem + others))
        invariants.check_layout(self)

    # -- context manager ----------------------------------------------------------
    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    # -- attributes -----------------------------------------------------------------
    @property
    def attrs(self) -> dict[str, object]:
        """Root attributes as plain Python values."""
        return dict(self._attrs)

    def _int(self, key: str) -> int:
        return int(self._attrs[key])  # type: ignore[call-overload]

    @property
    def mode(self) -> str:
        return str(self._attrs[Attr.MODE])

    @property
    def id_space(self) -> str:
        return str(self._attrs[Attr.ID_SPACE])

    @property
    def num_layers(self) -> int:
        return self._int(Attr.NUM_LAYERS)

    @property
    def num_physical_experts(self) -> int:
        return self._int(Attr.NUM_PHYSICAL_EXPERTS)

    @property
    def num_logical_experts(self) -> int:
        return self._int(Attr.NUM_LOGICAL_EXPERTS)

    @property
    def top_k(self) -> int:
        return self._int(Attr.TOP_K)

    @property
    def ep_size(self) -> int:
        return self._int(Attr.EP_SIZE)

    @property
    def run_id(self) -> str:
        return str(self._attrs[Attr.RUN_ID])

    @property
    def layers(self) -> np.ndarray:
        """Model layer index of each MoE layer ``[L]``."""
        return self._read("layers")

    @property
    def physical_to_logical(self) -> np.ndarray:
        """Map ``[L, P]`` from physical slot to logical expert."""
        return self._read("physical_to_logical")

    # -- parallel layout -------------------------------------------------------------
    @property
    def layouts(self) -> tuple[RankLayout, ...]:
        """The parallel layout of each ``/stat`` rank row, row order (``()`` for traces written without one)."""
        if not hasattr(self, "_layouts"):
            with reading(self.path, "/ranks"):
                self._layouts = read_layouts(self._file)
        return self._layouts

    def counted(self) -> CountedRows:
        """Which ``/stat`` rank rows the totals count: one view per group of ranks that route the same
        tokens (TP attention replicas count once), every row when ranks hold their own tokens or the
        trace has no layout. See ``docs/trace-format.md``, "What a rank row means"."""
        rows = self.shape(Data.STAT_NUM_TOKENS)
        return counted_of(self.layouts, rows[0] if rows else len(self.layouts))

    def counted_ranks(self) -> set[int] | None:
        """Global ranks whose streamed rows (``rank`` column of a merged trace) are counted; ``None``: all."""
        layouts = self.layouts
        if not layouts:
            return None
        mask = self.counted().assignments
        return {layout.rank for layout, keep in zip(layouts, mask, strict=True) if keep}

    def tokens_served(self) -> int:
        """Tokens the engine computed: ``/stat/num_tokens`` over the counted rows (each token once)."""
        return int(self.num_tokens()[self.counted().tokens].sum())

    def has(self, name: str) -> bool:
        """Whether dataset or group ``name`` exists (e.g. ``"tokens/topk_ids"``)."""
        with reading(self.path, f"/{name}"):
            return name in self._file

    def _read(self, name: str) -> np.ndarray:
        if not self.has(name):
            raise TraceError(f"{self.path}: has no /{name} (mode {self.mode!r})")
        with reading(self.path, f"/{name}"):
            data = np.asarray(self._file[name][()])
        if name in (Data.TOKENS_REQUEST, Data.TOKENS_REQUEST_POSITION) and self.has(Data.REQUEST_TABLE_ID):
            # Fletcher-32 sums 16-bit words mod 65535, so a run of -1 (0xFFFF) zeroed keeps its checksum:
            # a whole column read checks the request-row invariant, as iter_tokens does chunk by chunk.
            other = Data.TOKENS_REQUEST_POSITION if name == Data.TOKENS_REQUEST else Data.TOKENS_REQUEST
            with reading(self.path, f"/{other}"):
                pair = np.asarray(self._file[other][()])
            request, position = (data, pair) if name == Data.TOKENS_REQUEST else (pair, data)
            invariants.check_request_rows(self.path, 0, request, position, self.shape(Data.REQUEST_TABLE_ID)[0])  # type: ignore[index]
        return data

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of dataset ``name`` (``None`` when absent); reads no data."""
        with reading(self.path, f"/{name}"):
            return tuple(self._file[name].shape) if name in self._file else None

    def num_rows(self, name: str) -> int:
        """Rows along axis 0 of a streamed dataset (0 when absent)."""
        shape = self.shape(name)
        return int(shape[0]) if shape else 0

    def check_invariants(self) -> None:
        """Check the ``/stat`` and ``/window`` invariants (once; the stat and window accessors call it first).

        Raises:
            TraceError: naming the dataset and the figures that disagree.
        """
        if not self._stat_checked:
            self._stat_checked = True
            try:
                invariants.check_stat(self)
            except BaseException:
                self._stat_checked = False
                raise

    # -- stat -------------------------------------------------------------------------
    def physical_count(self, per_rank: bool = False) -> np.ndarray:
        """Total counts per physical expert: ``[L, P]`` over the counted rank rows (:meth:`counted`), or every row's view ``[R, L, P]``."""
        self.check_invariants()
        counts = self._read(Data.STAT_PHYSICAL_COUNT)
        return counts if per_rank else counts[self.counted().assignments].sum(axis=0)

    def logical_count(self, per_rank: bool = False) -> np.ndarray:
        """Total counts per logical expert: ``[L, E]`` over the counted rank rows, or every row's view ``[R, L, E]``."""
        self.check_invariants()
        counts = self._read(Data.STAT_LOGICAL_COUNT)
        return counts if per_rank else counts[self.counted().assignments].sum(axis=0)

    def invalid_ids(self) -> np.ndarray:
        """Out-of-range ids seen per rank and layer ``[R, L]``."""
        self.check_invariants()
        return self._read(Data.STAT_INVALID_IDS)

    def send_count(self) -> np.ndarray:
        """Token copies each rank sent to each EP rank ``[R, L, R_ep]``."""
        return self._read(Data.STAT_SEND_COUNT)

    def recv_count(self) -> np.ndarray:
        """Token copies each rank received from each EP rank ``[R, L, R_ep]``."""
        return self._read(Data.STAT_RECV_COUNT)

    def dispatch_matrix(self) -> np.ndarray:
        """Token copies sent from each EP rank to each EP rank ``[L, R_src, R_dst]`` (from ``/stat/send_count``).

        Needs one counted rank row per EP rank (ranks that dispatch their own tokens: DP
        attention, the reference EP runtime). Rows without a layout are taken as EP ranks
        in row order.

        Raises:
            TraceError: the rows are not one per EP rank (e.g. TP attention, where the
                experts' outputs are all-reduced and no tokens are exchanged).
        """
        send = self.send_count()
        rows = np.flatnonzero(self.counted().assignments)
        sources = [self.layouts[i].ep_rank for i in rows] if self.layouts else list(rows)
        if sorted(sources) != list(range(self.ep_size)):
            raise TraceError(f"{self.path}: its counted rank rows are EP ranks {sorted(sources)}, not one per EP rank 0..{self.ep_size - 1}; "
                             "a source x destination matrix needs every EP rank's own dispatch (TP attention exchanges no tokens)")
        matrix = np.zeros((send.shape[1], self.ep_size, self.ep_size), dtype=send.dtype)
        for row, source in zip(rows, sources, strict=True):
            matrix[:, source, :] = send[row]
        return matrix

    def dropped_tokens(self) -> np.ndarray:
        """Token copies dropped over capacity per rank and layer ``[R, L]``."""
        return self._read(Data.STAT_DROPPED)

    def num_passes(self) -> np.ndarray:
        """Forward passes recorded per rank ``[R]``."""
        self.check_invariants()
        return self._read(Data.STAT_NUM_PASSES)

    def padding_ids(self) -> np.ndarray | None:
        """Padding ids (-1) seen per rank and layer ``[R, L]``; ``None`` in traces that predate them."""
        return self._read(PADDING_IDS) if self.has(PADDING_IDS) else None

    def dropped_passes(self) -> np.ndarray:
        """Streaming passes dropped whole per rank ``[R]`` (``on_overflow="drop"``; zeros when absent)."""
        if not self.has(Data.STAT_DROPPED_PASSES):
            return np.zeros(self.num_passes().shape, dtype=np.int64)
        return self._read(Data.STAT_DROPPED_PASSES)

    def num_tokens(self) -> np.ndarray:
        """Tokens recorded per rank row ``[R]`` (each row's own view; :meth:`tokens_served` counts each token once)."""
        self.check_invariants()
        return self._read(Data.STAT_NUM_TOKENS)

    def window(self) -> Window:
        """The ``stat`` mode's time-ordered window (oldest first)."""
        self.check_invariants()
        pass_id = self._read(Data.WINDOW_PASS_ID)
        return Window(
            pass_id=pass_id,
            timestamp=self._read(Data.WINDOW_TIMESTAMP),
            num_tokens=self._read(Data.WINDOW_NUM_TOKENS),
            physical_count=self._read(Data.WINDOW_PHYSICAL_COUNT),
            pass_phase=self._read(Data.WINDOW_PASS_PHASE) if self.has(Data.WINDOW_PASS_PHASE) else np.zeros(pass_id.shape, np.int8),
            num_requests=self._read(Data.WINDOW_NUM_REQUESTS) if self.has(Data.WINDOW_NUM_REQUESTS) else np.full(pass_id.shape, -1, np.int32),
        )

    # -- timing (schema v2) ------------------------------------------------------------
    @property
    def has_timing(self) -> bool:
        """Whether the trace holds phase timing (recorded with ``RecorderConfig(timing=True)``)."""
        return Attr.TIMING_PHASES in self._attrs

    def timing_stat(self) -> dict[str, np.ndarray]:
        """Timing aggregates per rank: ``phase_seconds_sum [R, L, F]``, ``phase_histogram [R, L, F, B]``, ... (see docs/trace-format.md)."""
        if not self.has_timing:
            raise TraceError(f"{self.path}: holds no phase timing (record with RecorderConfig(timing=True))")
        names = ("phase_seconds_sum", "phase_seconds_max", "phase_count", "phase_histogram", "step_seconds_sum",
                 "step_seconds_max", "step_count", "step_histogram", "peak_memory_bytes", "timing_dropped_passes")
        out = {name: self._read(dataset(Data.STAT, name)) for name in names}
        out["histogram_edges"] = np.asarray(self._attrs[Attr.TIMING_HISTOGRAM_EDGES])
        return out

    def timing_rows(self) -> dict[str, np.ndarray]:
        """Every ``/timing`` row (one per pass and rank), with a ``rank [N]`` column even in a per-rank file."""
        if not self.has_timing:
            raise TraceError(f"{self.path}: holds no phase timing (record with RecorderConfig(timing=True))")
        with reading(self.path, "/timing"):
            names = list(self._file[Data.TIMING]) if self.has(Data.TIMING) else []
        rows = {name: self._read(dataset(Data.TIMING, name)) for name in names}
        invariants.check_timing_rows(self.path, rows)
        if "rank" not in rows:
            rank = max(self._int(Attr.RANK), 0)
            rows["rank"] = np.full(len(rows.get("pass_id", ())), rank, dtype=np.int32)
        return rows

    # -- streamed -----------------------------------------------------------------------
    def iter_passes(self, chunk: int = 1024, counted_only: bool = False, phase: int | None = None) -> Iterator[PassChunk]:
        """``/passes`` in chunks of at most ``chunk`` passes (bounded memory).

        ``counted_only``: in a merged trace, skip the rows of ranks whose view replicates
        another rank's (see :meth:`counted_ranks`), so that totals count each token once.
        ``phase``: only the passes of this pass phase code (:data:`moetrace.pass_phase.PASS_PHASES`).
        """
        names = ("pass_id", "timestamp", "num_tokens", "physical_count", "invalid_ids", "send_count", "recv_count")
        order = invariants.RowOrder(self.path, "passes", timestamps=True)
        merged = self.has(dataset(Data.PASSES, "rank"))
        for start in range(0, self.num_rows(Data.PASSES_PASS_ID), chunk):
            ranks = self._slice(dataset(Data.PASSES, "rank"), start, chunk) if merged else None
            keep = self._counted_mask(ranks) if counted_only else None
            rows = {n: self._slice(dataset(Data.PASSES, n), start, chunk) for n in names}
            order.check(rows["pass_id"], rows["timestamp"], ranks)
            n = len(rows["pass_id"])
            rows["pass_phase"] = self._slice_or(Data.PASSES_PASS_PHASE, start, n, 0, np.int8)
            rows["num_requests"] = self._slice_or(Data.PASSES_NUM_REQUESTS, start, n, -1, np.int32)
            invariants.check_pass_requests(self.path, Data.PASSES_NUM_REQUESTS, rows["pass_phase"], rows["num_requests"], row=start)
            keep = _keep_phase(keep, rows["pass_phase"], phase)
            if keep is not None:
                rows = {n: a[keep] for n, a in rows.items()}
            if len(rows["pass_id"]):
                yield PassChunk(**rows)

    def iter_tokens(self, chunk: int = 65536, counted_only: bool = False, phase: int | None = None) -> Iterator[TokenChunk]:
        """``/tokens`` in chunks of at most ``chunk`` tokens (bounded memory); ``counted_only`` and ``phase`` as for :meth:`iter_passes`.

        Every row read (before the filters) is added up per rank, layer and slot
        (:class:`~moetrace.trace.invariants.TokenTally`); with the last row, before the last chunk is
        yielded, the sums are held to ``/stat`` exactly, as ``moetrace verify`` does. A caller that stops
        early has read part of the rows, which cannot be checked: use :meth:`read_tokens` for a range.

        Raises:
            TraceDamageError: the rows do not add up to ``/stat`` (e.g. ``-1`` ids zeroed into expert 0).
        """
        order = invariants.RowOrder(self.path, "tokens")
        requests = self.shape(Data.REQUEST_TABLE_ID)
        names = ("topk_ids", "pass_id", "position", *(TOKEN_REQUEST_FIELDS if requests is not None else ()))
        tally, total = invariants.TokenTally.of(self), self.num_rows(Data.TOKENS_TOPK_IDS)
        if tally is not None and total == 0:
            tally.check(self)
        merged = self.has(Data.TOKENS_RANK)
        for start in range(0, total, chunk):
            ranks = self._slice(Data.TOKENS_RANK, start, chunk) if merged else None
            keep = self._counted_mask(ranks) if counted_only else None
            rows = {n: self._slice(dataset(Data.TOKENS, n), start, chunk) for n in names}
            if ranks is not None:
                rows["rank"] = ranks
            order.check(rows["pass_id"])
            if tally is not None:
                tally.add(rows["topk_ids"], ranks)
                if start + chunk >= total:
                    tally.check(self)
            if requests is not None:
                invariants.check_request_rows(self.path, start, rows["request"], rows["request_position"], requests[0])
            rows["pass_phase"] = self._slice_or(Data.TOKENS_PASS_PHASE, start, len(rows["pass_id"]), 0, np.int8)
            keep = _keep_phase(keep, rows["pass_phase"], phase)
            if keep is not None:
                rows = {n: a[keep] for n, a in rows.items()}
            if len(rows["pass_id"]):
                yield TokenChunk(**rows)

    def _slice_or(self, name: str, start: int, count: int, fill: int, dtype: type) -> np.ndarray:
        """Rows of an optional column (``count`` rows of ``fill`` in traces written without it)."""
        return self._slice(name, start, count) if self.has(name) else np.full(count, fill, dtype=dtype)

    def _counted_mask(self, ranks: np.ndarray | None) -> np.ndarray | None:
        """Which rows of a merged stream, of ranks ``ranks [n]`` (``None``: a per-rank file), come from
        counted ranks; ``None`` when every row counts."""
        keep = self.counted_ranks()
        if keep is None or ranks is None or len(keep) == len(self.layouts):
            return None
        return np.isin(ranks, sorted(keep))

    def request_table(self) -> np.ndarray:
        """``[Q]`` the engine request ids that ``/tokens/request`` indexes (``str``); one id may sit at
        several indices (once per joined segment or merged rank): group by the id. Empty without request rows."""
        return read_request_table(self._file) if self.has(Data.REQUEST_TABLE_ID) else np.zeros(0, dtype=object)

    def read_tokens(self, column: str, start: int = 0, count: int | None = None) -> np.ndarray:
        """Rows ``start .. start + count - 1`` (default: to the end) of ``/tokens/<column>``
        (``topk_ids``, ``pass_id``, ``position``, ``request``, ``request_position``, or ``rank`` in merged traces)."""
        name = dataset(Data.TOKENS, column)
        return self._slice(name, start, self.num_rows(name) - start if count is None else count)

    def _slice(self, name: str, start: int, count: int) -> np.ndarray:
        if not self.has(name):
            raise TraceError(f"{self.path}: has no /{name} (mode {self.mode!r})")
        with reading(self.path, f"/{name}"):
            return np.asarray(self._file[name][start : start + count])


def _keep_phase(keep: np.ndarray | None, pass_phase: np.ndarray, phase: int | None) -> np.ndarray | None:
    """``keep`` (or all rows) narrowed to the rows of pass phase ``phase`` (``None``: unchanged)."""
    if phase is None:
        return keep
    match = pass_phase == phase
    return match if keep is None else keep & match


def open_trace(path: Path | str) -> Trace:
    """Open and validate a moetrace trace.

    Raises:
        TraceError: the file is missing, not HDF5, not a moetrace trace,
            incomplete, of a newer schema version, damaged (a checksum or an
            invariant fails), naming the object, the damage and the remedy.
    """
    return Trace(path)
