"""``ReplicaRecorder``: request→replica decisions and their outcomes.

Same lifecycle as the expert recorder (``start_record`` / ``stop_record`` /
``dump_record`` / ``snapshot``). A router calls the hooks::

    rec.on_arrival(rid, input_tokens, session=sid)
    rec.on_decision(rid, replica, "cache_aware", "prefix_match", candidates)
    rec.on_start(rid)            # the replica began its prefill (queue wait ends)
    rec.on_first_token(rid)
    rec.on_finish(rid, output_tokens, cached_tokens)
    rec.on_migration(sid, source, target)

Every hook takes ``t=`` (seconds on the recorder's clock; default
``time.monotonic()``, the same clock in every process of a machine), is
thread-safe (one lock) and does a constant amount of work. Requests in flight
are held in a dict; a finished request becomes one row that waits in a staging
list of ``chunk_rows`` rows, which a background thread appends to a hidden
segment file next to the dumps. Memory is bounded by the requests in flight
plus two chunks, however many requests pass. Live counters (decisions by
replica/policy/reason, hit/miss/regret tokens, queue length and running
requests per replica, wait and TTFT histograms per replica) back
:meth:`ReplicaRecorder.snapshot` for the exporters.

Over 500 lines: the ReplicaRecorder's lifecycle, its bounded row buffers and the builder of
its ``/requests`` columns share one record layout.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..trace.replica_requests import ReplicaHeader, replica_attrs
from ..trace.schema import CANDIDATE_FIELDS, MIGRATION_FIELDS, REQUEST_FIELDS, Data, dataset
from ..trace.stream import BackgroundTraceWriter, StreamJob
from ..trace.writer import TraceWriter, check_writable_dir

__all__ = [
    "LATENCY_BUCKETS",
    "POLICIES",
    "REASONS",
    "Candidate",
    "ReplicaRecorder",
    "ReplicaSnapshot",
    "ReplicaStateError",
]

#: Policy codes stored in ``/requests/policy`` (``external``: a router we only observe).
POLICIES = ("round_robin", "random", "shortest_queue", "cache_aware", "session_sticky", "constrained_locality", "kv_cost", "external")
#: Reason codes stored in ``/requests/reason``: the rule that decided.
REASONS = (
    "round_robin",  # next in turn
    "random",  # uniform draw
    "shortest_queue",  # fewest requests waiting + running
    "prefix_match",  # cache_aware: best prefix match rate above the threshold
    "smallest_cache",  # cache_aware: match rate at or below the threshold -> replica with the smallest cache
    "imbalance_fallback",  # cache_aware: load imbalance past both thresholds -> shortest queue
    "session_owner",  # session_sticky: the session's replica
    "new_session",  # session_sticky: no owner yet -> shortest queue
    "session_migrated",  # session_sticky: owner overloaded -> shortest queue, session moves
    "min_est_ttft",  # constrained_locality: smallest queue wait + prefill of the uncached part
    "min_kv_cost",  # kv_cost: smallest overlap-weighted prefill blocks + decode blocks
    "other",  # an external router's decision
)
#: Upper bounds (s) of the wait and TTFT histogram buckets (Prometheus ``le``; +Inf implied).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)


class ReplicaStateError(RuntimeError):
    """A hook or lifecycle call that does not fit the recorder's state; the message says what to do."""


class Candidate(NamedTuple):
    """One replica's signals at decision time (a tuple: cheap to build and to store).

    ``est_wait`` / ``est_ttft`` are the router's estimates in seconds and
    ``score`` its policy score (``nan`` when the policy has none).
    """

    replica: int
    queue: int = 0
    running: int = 0
    inflight_tokens: int = 0
    match_blocks: int = 0
    match_tokens: int = 0
    session_owner: bool = False
    est_wait: float = math.nan
    est_ttft: float = math.nan
    score: float = math.nan


@dataclasses.dataclass(frozen=True)
class ReplicaSnapshot:
    """Host copy of the live counters (cumulative since ``start_record``).

    Attributes:
        decisions: ``[R, P, Q]`` decisions by replica, policy (:data:`POLICIES`), reason (:data:`REASONS`).
        hit_tokens, miss_tokens, regret_tokens: ``[R]`` prompt tokens served from / missing the
            prefix cache (as the replica counted), and best-candidate overlap minus chosen overlap.
        queue_length, running: ``[R]`` requests routed but not started / started but not finished.
        wait_buckets, ttft_buckets: ``[R, len(LATENCY_BUCKETS) + 1]`` non-cumulative bucket counts.
        wait_sum, ttft_sum: ``[R]`` sums (s) for the histograms.
        migrations: sessions moved between replicas.
    """

    timestamp: float
    recording: bool
    num_replicas: int
    decisions: np.ndarray
    hit_tokens: np.ndarray
    miss_tokens: np.ndarray
    regret_tokens: np.ndarray
    queue_length: np.ndarray
    running: np.ndarray
    wait_buckets: np.ndarray
    wait_sum: np.ndarray
    ttft_buckets: np.ndarray
    ttft_sum: np.ndarray
    migrations: int
    finished: int


class _Segment:
    """A hidden trace file fed by a :class:`BackgroundTraceWriter` (one thread); at most ``max_pending`` chunks wait (back-pressure).

    It is the writer's sink: each job builds ``{dataset: rows}`` columns, appended in submission order.
    """

    def __init__(self, writer: TraceWriter, max_pending: int = 2) -> None:
        self.writer = writer
        self._background = BackgroundTraceWriter(self, max_pending=max_pending, name="moetrace-replicas-writer")

    @property
    def error(self) -> BaseException | None:
        """The first write error, if any (later chunks are skipped)."""
        return self._background.error

    def write(self, columns: dict[str, np.ndarray] | None) -> None:
        for name, rows in (columns or {}).items():
            self.writer.append(name, rows)

    def rotate(self) -> None:
        """Never asked for: ``dump_record`` replaces the whole segment."""

    def submit(self, build: Callable[[], dict[str, np.ndarray]]) -> None:
        self._background.submit(StreamJob(event=None, build=build))  # no pooled buffer to release

    def drain(self) -> None:
        self._background.drain()

    def close(self) -> None:
        self._background.close()


# Index of each field in a pending record (a list: cheaper than an object).
_ID, _SEQ, _SESSION, _ARR, _DEC, _START, _FIRST, _FIN, _REP, _POL, _REA, _IN, _CACHED, _OUT, _PRED, _BEST, _CANDS = range(17)
_NAN = math.nan


class ReplicaRecorder:
    """Records which replica each request goes to, and why; see the module docstring.

    Args:
        num_replicas: replicas behind the router (sizes the counters; replica ids ``0..R-1``).
        output_dir: where dumps (and the hidden streaming segment) go.
        block_size: prefix-cache block size in tokens (stored for readers; 0 = unknown).
        chunk_rows: finished requests staged before one background append.
        clock: time source of the hooks' default ``t``; ``clock_name`` labels it in the trace.
        engine, model: stored as root attributes.
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        output_dir: str | Path = ".",
        block_size: int = 0,
        chunk_rows: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        clock_name: str = "monotonic",
        engine: str = "",
        model: str = "",
    ) -> None:
        if not isinstance(num_replicas, int) or num_replicas <= 0:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        self.num_replicas = num_replicas
        self.output_dir = Path(output_dir)
        self.block_size = block_size
        self.chunk_rows = chunk_rows
        self.clock, self.clock_name = clock, clock_name
        self.engine, self.model = engine, model
        self._lock = threading.Lock()
        self._recording = False
        self._started = False
        self._segment: _Segment | None = None
        self.last_dump_path: Path | None = None
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        r = self.num_replicas
        nb = len(LATENCY_BUCKETS) + 1
        self._pending: dict[str, list] = {}
        self._rows: list[list] = []
        self._migrations: list[tuple] = []
        self._seq = 0
        self._cand_rows = 0  # candidate rows written to the current segment
        self._decisions = np.zeros((r, len(POLICIES), len(REASONS)), np.int64)
        self._hit = [0] * r
        self._miss = [0] * r
        self._regret = [0] * r
        self._queue = [0] * r
        self._running = [0] * r
        self._wait_buckets = np.zeros((r, nb), np.int64)
        self._ttft_buckets = np.zeros((r, nb), np.int64)
        self._wait_sum = [0.0] * r
        self._ttft_sum = [0.0] * r
        self._num_migrations = 0
        self._finished = 0
        self._policy_code = {p: i for i, p in enumerate(POLICIES)}
        self._reason_code = {q: i for i, q in enumerate(REASONS)}

    @property
    def recording(self) -> bool:
        return self._recording

    @property
    def in_flight(self) -> int:
        """Requests that arrived and have not finished."""
        return len(self._pending)

    # ------------------------------------------------------------------ lifecycle
    def start_record(self) -> None:
        """Start (or resume) recording; opens the streaming segment."""
        with self._lock:
            if self._recording:
                return
            if self._segment is None:
                self._open_segment()
            self._recording = self._started = True

    def stop_record(self) -> None:
        """Stop recording; hooks become no-ops. What was recorded stays for :meth:`dump_record`."""
        with self._lock:
            self._recording = False

    def reset(self) -> None:
        """Forget everything recorded (the segment is discarded)."""
        with self._lock:
            self._close_segment(discard=True)
            self._reset_state()
            self._started = self._recording  # still recording: a dump of what follows is valid
            if self._recording:
                self._open_segment()

    def _open_segment(self) -> None:
        directory = check_writable_dir(self.output_dir)
        path = directory / f".moetrace-replicas-segment-{os.getpid()}-{uuid.uuid4().hex[:8]}.h5"
        self._segment = _Segment(TraceWriter(path, ReplicaHeader.make(self.engine, self.model)))
        self._cand_rows = 0

    def _close_segment(self, discard: bool) -> TraceWriter | None:
        segment, self._segment = self._segment, None
        if segment is None:
            return None
        segment.close()
        if discard:
            segment.writer.abort()
            return None
        return segment.writer

    # ------------------------------------------------------------------ hooks
    def on_arrival(self, request_id: str, input_tokens: int, *, session: str | None = None, t: float | None = None) -> None:
        """A request reached the router."""
        if not self._recording:
            return
        t = self.clock() if t is None else t
        with self._lock:
            if request_id in self._pending:
                raise ReplicaStateError(f"request id {request_id!r} arrived twice while in flight; request ids must be unique")
            self._pending[request_id] = [request_id, self._seq, session or "", t, _NAN, _NAN, _NAN, _NAN, -1, -1, -1,
                                         int(input_tokens), -1, -1, -1, -1, ()]
            self._seq += 1

    def on_decision(self, request_id: str, replica: int, policy: str, reason: str, candidates: Sequence[Candidate] = (),
                    t: float | None = None) -> None:
        """The router chose ``replica`` for ``request_id`` by ``reason``; ``candidates``: every replica's signals."""
        if not self._recording:
            return
        t = self.clock() if t is None else t
        with self._lock:
            rec = self._record(request_id, "on_decision")
            if not 0 <= replica < self.num_replicas:
                raise ReplicaStateError(f"replica {replica} is outside [0, num_replicas={self.num_replicas})")
            pol = self._policy_code.get(policy)
            rea = self._reason_code.get(reason)
            if pol is None or rea is None:
                raise ReplicaStateError(f"policy {policy!r} / reason {reason!r} unknown; use one of {POLICIES} / {REASONS}")
            predicted = best = 0
            for c in candidates:
                if c[0] == replica:
                    predicted = c[5]
                if c[5] > best:
                    best = c[5]
            rec[_DEC], rec[_REP], rec[_POL], rec[_REA], rec[_PRED], rec[_BEST], rec[_CANDS] = t, replica, pol, rea, predicted, best, tuple(candidates)
            self._decisions[replica, pol, rea] += 1
            self._regret[replica] += best - predicted
            self._queue[replica] += 1

    def on_start(self, request_id: str, t: float | None = None) -> None:
        """The chosen replica started the request's prefill (its queue wait ends)."""
        if not self._recording:
            return
        t = self.clock() if t is None else t
        with self._lock:
            rec = self._record(request_id, "on_start")
            if rec[_REP] < 0 or rec[_START] == rec[_START]:
                return
            rec[_START] = t
            r = rec[_REP]
            self._queue[r] -= 1
            self._running[r] += 1
            wait = t - rec[_ARR]
            self._wait_buckets[r, bisect.bisect_left(LATENCY_BUCKETS, wait)] += 1
            self._wait_sum[r] += wait

    def on_first_token(self, request_id: str, t: float | None = None) -> None:
        """The request's first output token is out."""
        if not self._recording:
            return
        t = self.clock() if t is None else t
        with self._lock:
            rec = self._record(request_id, "on_first_token")
            if rec[_FIRST] == rec[_FIRST] or rec[_REP] < 0:
                return
            rec[_FIRST] = t
            ttft = t - rec[_ARR]
            r = rec[_REP]
            self._ttft_buckets[r, bisect.bisect_left(LATENCY_BUCKETS, ttft)] += 1
            self._ttft_sum[r] += ttft

    def on_finish(self, request_id: str, output_tokens: int, cached_tokens: int, t: float | None = None) -> None:
        """The request finished with ``output_tokens``; the replica served ``cached_tokens`` of its prompt from cache."""
        if not self._recording:
            return
        t = self.clock() if t is None else t
        with self._lock:
            rec = self._pending.pop(request_id, None)
            if rec is None:
                raise ReplicaStateError(f"on_finish for request {request_id!r}, which is not in flight; call on_arrival first")
            rec[_FIN], rec[_OUT], rec[_CACHED] = t, int(output_tokens), int(cached_tokens)
            r = rec[_REP]
            if r >= 0:
                if rec[_START] == rec[_START]:
                    self._running[r] -= 1
                else:
                    self._queue[r] -= 1
                self._hit[r] += rec[_CACHED]
                self._miss[r] += rec[_IN] - rec[_CACHED]
            self._finished += 1
            self._rows.append(rec)
            if len(self._rows) >= self.chunk_rows:
                self._flush()

    def on_migration(self, session: str, source: int, target: int, t: float | None = None) -> None:
        """Session ``session`` moved from replica ``source`` to ``target``."""
        if not self._recording:
            return
        t = self.clock() if t is None else t
        with self._lock:
            self._migrations.append((t, session, source, target))
            self._num_migrations += 1

    def _record(self, request_id: str, hook: str) -> list:
        rec = self._pending.get(request_id)
        if rec is None:
            raise ReplicaStateError(f"{hook} for request {request_id!r}, which is not in flight; call on_arrival first")
        return rec

    # ------------------------------------------------------------------ streaming
    def _flush(self, include_pending: bool = False) -> None:
        """Hand staged rows (and migrations) to the background writer (lock held)."""
        rows, self._rows = self._rows, []
        if include_pending:
            rows = rows + list(self._pending.values())
        migrations, self._migrations = self._migrations, []
        if not rows and not migrations:
            return
        first = self._cand_rows
        self._cand_rows += sum(len(r[_CANDS]) for r in rows)
        assert self._segment is not None
        self._segment.submit(lambda: _build_columns(rows, migrations, first))

    # ------------------------------------------------------------------ dump
    def dump_record(self, path: str | Path | None = None) -> Path:
        """Write a replica trace atomically: the requests since the previous dump.

        Requests still in flight are included with ``finished = 0`` (their
        missing times ``nan``) and stay in flight: a later dump has them again,
        finished. Returns the path.
        """
        with self._lock:
            if not self._started or self._segment is None:
                raise ReplicaStateError("nothing recorded yet: call start_record() before dump_record()")
            target = Path(path) if path is not None else self.output_dir / f"moetrace-replicas-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.h5"
            if target.suffix != ".h5":
                target = target.with_name(target.name + ".h5")
            self._flush(include_pending=True)
            segment = self._segment
            segment.drain()
            if segment.error is not None:
                raise ReplicaStateError(f"the background trace writer failed ({segment.error}); call reset() and record again") from segment.error
            source = segment.writer
            for group, fields in ((Data.REQUESTS, REQUEST_FIELDS), (Data.REQUESTS_CANDIDATES, CANDIDATE_FIELDS), (Data.REQUESTS_MIGRATIONS, MIGRATION_FIELDS)):
                for name, dtype in fields.items():
                    source.ensure_empty(dataset(group, name), (), dtype)
            source.flush()
            writer = TraceWriter(target, ReplicaHeader.make(self.engine, self.model))
            try:
                writer.copy_group(source, Data.REQUESTS)
                for key, value in replica_attrs(list(POLICIES), list(REASONS), self.num_replicas, self.block_size, self.clock_name).items():
                    writer.set_attr(key, value)
                written = writer.commit()
            except BaseException:
                writer.abort()
                raise
            self._close_segment(discard=True)
            self._open_segment()
            self.last_dump_path = written
            return written

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> ReplicaSnapshot:
        """Copies of the live counters (cheap; never waits for the writer)."""
        with self._lock:
            return ReplicaSnapshot(
                timestamp=time.time(), recording=self._recording, num_replicas=self.num_replicas,
                decisions=self._decisions.copy(), hit_tokens=np.array(self._hit), miss_tokens=np.array(self._miss),
                regret_tokens=np.array(self._regret), queue_length=np.array(self._queue), running=np.array(self._running),
                wait_buckets=self._wait_buckets.copy(), wait_sum=np.array(self._wait_sum),
                ttft_buckets=self._ttft_buckets.copy(), ttft_sum=np.array(self._ttft_sum),
                migrations=self._num_migrations, finished=self._finished,
            )

    def close(self) -> None:
        """Stop and drop the streaming segment (what was not dumped is lost)."""
        with self._lock:
            self._recording = False
            self._close_segment(discard=True)

    def __del__(self) -> None:  # the hidden segment must not outlive the recorder
        try:
            self.close()
        except Exception:
            pass


def _build_columns(rows: list[list], migrations: list[tuple], first_candidate: int) -> dict[str, np.ndarray]:
    """Column arrays of staged rows (runs on the writer thread)."""
    n = len(rows)
    cols: dict[str, np.ndarray] = {}
    if n:
        fields = list(zip(*rows, strict=True))  # one tuple per record field
        arrival, start, first, finish = (np.array(fields[i], np.float64) for i in (_ARR, _START, _FIRST, _FIN))
        counts = np.fromiter(map(len, fields[_CANDS]), np.int32, n)
        offsets = first_candidate + np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64)))
        simple = {"seq": _SEQ, "decision": _DEC, "replica": _REP, "policy": _POL, "reason": _REA, "input_tokens": _IN,
                  "cached_tokens": _CACHED, "output_tokens": _OUT, "predicted_tokens": _PRED, "best_tokens": _BEST}
        for name, idx in simple.items():
            cols[dataset(Data.REQUESTS, name)] = np.array(fields[idx], REQUEST_FIELDS[name])
        cols[dataset(Data.REQUESTS, "id")] = np.array(fields[_ID], dtype=object)
        cols[dataset(Data.REQUESTS, "session")] = np.array(fields[_SESSION], dtype=object)
        cols.update({dataset(Data.REQUESTS, "arrival"): arrival, dataset(Data.REQUESTS, "start"): start, dataset(Data.REQUESTS, "first_token"): first, dataset(Data.REQUESTS, "finish"): finish,
                     dataset(Data.REQUESTS, "queue_wait"): start - arrival, dataset(Data.REQUESTS, "ttft"): first - arrival, dataset(Data.REQUESTS, "e2e"): finish - arrival,
                     dataset(Data.REQUESTS, "finished"): (finish == finish).astype(np.int8), dataset(Data.REQUESTS, "cand_start"): offsets, dataset(Data.REQUESTS, "cand_count"): counts})
        width = len(CANDIDATE_FIELDS) - 1
        flat = chain.from_iterable(chain.from_iterable(fields[_CANDS]))
        cands = np.fromiter(flat, np.float64, int(counts.sum()) * width).reshape(-1, width)
        cols[dataset(Data.REQUESTS_CANDIDATES, "request_seq")] = np.repeat(np.array(fields[_SEQ], np.int64), counts)
        for j, (name, dtype) in enumerate(list(CANDIDATE_FIELDS.items())[1:]):  # homogeneous float64: fast to build
            cols[dataset(Data.REQUESTS_CANDIDATES, name)] = cands[:, j].astype(dtype)
    if migrations:
        cols[dataset(Data.REQUESTS_MIGRATIONS, "time")] = np.array([m[0] for m in migrations], np.float64)
        cols[dataset(Data.REQUESTS_MIGRATIONS, "session")] = np.array([m[1] for m in migrations], dtype=object)
        cols[dataset(Data.REQUESTS_MIGRATIONS, "source")] = np.array([m[2] for m in migrations], np.int32)
        cols[dataset(Data.REQUESTS_MIGRATIONS, "target")] = np.array([m[3] for m in migrations], np.int32)
    # object columns need the HDF5 string dtype: TraceWriter.append creates from the array's dtype
    return {k: (v.astype(REQUEST_FIELDS["id"]) if v.dtype == object else v) for k, v in cols.items()}
