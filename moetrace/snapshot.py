"""The snapshot channel: ``RecorderSnapshot``, the host copy of a recorder's totals that exporters read.

A snapshot is immutable plain numpy; building it never touches device tensors
beyond the asynchronous copy the recorder made at the end of a pass
(:class:`SnapshotChannel`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from . import balance
from .config import RecorderConfig
from .dispatch import ep_ideal_bytes, exchanged_bytes, remote_copies
from .ids import to_logical
from .layout import RankLayout
from .pass_phase import PASS_PHASES
from .trace.stat import CounterLayout

__all__ = ["RecorderSnapshot", "SnapshotChannel"]


@dataclasses.dataclass(frozen=True)
class RecorderSnapshot(balance.LoadMetrics):
    """Totals since ``start_record`` as seen by one rank.

    Attributes:
        timestamp: unix seconds when the underlying copy was taken.
        recording: whether the recorder was recording then.
        mode, id_space, model, engine: descriptive labels.
        rank, ep_size: this process's EP rank and the EP world size.
        layer_ids: model layer index of each MoE layer ``[L]``.
        num_passes: forward passes recorded.
        num_tokens: tokens recorded (sum of each pass's token count).
        physical_count: ``[L, P]`` token copies per physical expert.
        logical_count: ``[L, E]`` token copies per logical expert.
        invalid_ids: ``[L]`` ids outside ``[0, P)`` other than -1.
        send_count, recv_count: ``[L, R]`` token copies this rank sent to /
            received from each EP rank (from ``on_dispatch``).
        dropped: ``[L]`` token copies dropped over capacity.
        hidden_size, dtype_bytes, top_k: for the byte figures (0 = unknown).
        last_dump_path: the last file ``dump_record`` wrote, if any.
        errors: background errors (e.g. a failed streaming write).
        dropped_passes: streaming passes dropped whole because the trace
            writer was behind (``on_overflow="drop"``).
        timing: phase-timing aggregates since ``start_record``
            (:meth:`moetrace.timing.TimingStats.arrays`), ``None`` when timing is off.
        retention: what the retention policy removed and compacted in ``output_dir``
            (:class:`moetrace.trace.retention.RetentionStats`), ``None`` without a policy.
        rank_layout: the rank's parallel layout (``None``: not known, the
            rank's view counts as its own tokens).
        pass_phase_physical_count: ``[Q, L, P]`` ``physical_count`` split by pass phase
            (:data:`moetrace.pass_phase.PASS_PHASES`: unknown, prefill, decode, mixed, idle).
        pass_phase_logical_count: ``[Q, L, E]`` ``logical_count`` split by pass phase.
        pass_phase_num_passes, pass_phase_num_tokens, pass_phase_num_requests: ``[Q]`` passes,
            tokens and requests (the sum of each pass's request count) of each pass phase.
    """

    timestamp: float
    recording: bool
    mode: str
    id_space: str
    model: str
    engine: str
    rank: int
    ep_size: int
    top_k: int
    hidden_size: int
    dtype_bytes: int
    layer_ids: np.ndarray
    num_passes: int
    num_tokens: int
    physical_count: np.ndarray
    logical_count: np.ndarray
    invalid_ids: np.ndarray
    send_count: np.ndarray
    recv_count: np.ndarray
    dropped: np.ndarray
    last_dump_path: str | None = None
    errors: tuple[str, ...] = ()
    dropped_passes: int = 0
    timing: dict[str, np.ndarray] | None = None
    retention: dict[str, object] | None = None
    rank_layout: RankLayout | None = None
    pass_phase_physical_count: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((len(PASS_PHASES), 0, 0), np.int64))
    pass_phase_logical_count: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((len(PASS_PHASES), 0, 0), np.int64))
    pass_phase_num_passes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(PASS_PHASES), np.int64))
    pass_phase_num_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(PASS_PHASES), np.int64))
    pass_phase_num_requests: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(len(PASS_PHASES), np.int64))

    @property
    def pass_phase_balancedness(self) -> np.ndarray:
        """``[Q]`` balancedness over EP ranks of each pass phase's load, all layers (1 = perfect; 1 with no load)."""
        return np.array([balance.balancedness(balance.rank_load(c, self.ep_size)) for c in self.pass_phase_physical_count])

    @property
    def pass_phase_expert_imbalance(self) -> np.ndarray:
        """``[Q]`` expert imbalance of each pass phase's logical load, all layers (1 = even)."""
        return np.array([balance.overall_expert_imbalance(c) for c in self.pass_phase_logical_count])

    @property
    def replicates_tokens(self) -> bool:
        """True when another rank of the same TP (attention) group routes these same tokens and counts them."""
        return self.rank_layout is not None and self.rank_layout.replicates_tokens

    def counted(self, value: np.ndarray | int) -> np.ndarray | int:
        """``value`` as this rank adds it to run-wide counters: zeros on a rank whose view replicates
        another's (TP attention), so that the sum over ranks counts each token once."""
        if not self.replicates_tokens:
            return value
        return 0 if isinstance(value, (int, np.integer)) else np.zeros_like(value)

    @property
    def phase_histogram(self) -> np.ndarray:
        """Per-pass phase durations ``[F, B]`` in the fixed buckets of ``moetrace.timing.HISTOGRAM_EDGES``, all layers pooled."""
        if self.timing is None:
            return np.zeros((0, 0), dtype=np.int64)
        return self.timing["phase_histogram"].sum(axis=0)

    @property
    def phase_seconds_sum(self) -> np.ndarray:
        """Seconds spent in each phase ``[F]`` over all layers and passes."""
        return np.zeros(0) if self.timing is None else self.timing["phase_seconds_sum"].sum(axis=0)

    @property
    def step_seconds_sum(self) -> float:
        """Seconds of timed forward passes (0 without timing)."""
        return 0.0 if self.timing is None else float(self.timing["step_seconds_sum"])

    @property
    def peak_memory_bytes(self) -> float:
        """Largest per-pass peak of device memory allocated (NaN on CPU or without timing)."""
        return float("nan") if self.timing is None else float(self.timing["peak_memory_bytes"])

    @property
    def tokens_per_layer(self) -> np.ndarray:
        """Token copies routed per layer ``[L]`` (sum over experts)."""
        return self.physical_count.sum(axis=1)

    @property
    def alltoall_bytes_ideal(self) -> np.ndarray:
        """Ideal EP all-to-all bytes per layer ``[L]`` (``2·T·k·H·b``, T = copies / k); zeros when H is unknown."""
        copies = self.tokens_per_layer
        return np.array([ep_ideal_bytes(int(c) // max(self.top_k, 1), self.top_k, self.hidden_size, self.dtype_bytes) for c in copies], dtype=np.float64)

    @property
    def alltoall_bytes_actual(self) -> np.ndarray:
        """Bytes this rank sent to other ranks per layer ``[L]`` (dispatch + combine); zeros when H is unknown."""
        remote = remote_copies(self.send_count, self.rank)
        return np.array([exchanged_bytes(int(c), self.hidden_size, self.dtype_bytes) for c in remote], dtype=np.float64)

    @classmethod
    def of_rows(
        cls,
        config: RecorderConfig,
        layout: CounterLayout,
        rows: np.ndarray,
        progress: tuple[int, int, float],
        **state: object,
    ) -> RecorderSnapshot:
        """The snapshot of counter rows ``[L, C]`` (columns of ``layout``) after ``(passes, tokens, unix time)``.

        ``state``: the remaining fields (``recording``, ``id_space``, ``last_dump_path``, ``errors``,
        ``dropped_passes``, ``timing``, ``rank_layout``, ``retention``, the ``pass_phase_num_*`` counts).
        ``rows`` may be ``[Q, L, C]``, split by pass phase: the totals are their sum.
        """
        num_passes, num_tokens, timestamp = progress
        if rows.ndim == 3:
            state["pass_phase_physical_count"] = rows[:, :, layout.experts]
            state["pass_phase_logical_count"] = to_logical(rows[:, :, layout.experts], config.physical_to_logical)  # type: ignore[arg-type]
            rows = rows.sum(axis=0)
        physical = rows[:, layout.experts]
        return cls(
            timestamp=timestamp,
            mode=config.mode,
            model=config.model,
            engine=config.engine,
            rank=config.ep_rank,
            ep_size=config.ep_size,
            top_k=config.top_k,
            hidden_size=config.hidden_size or 0,
            dtype_bytes=config.dtype_bytes,
            layer_ids=np.asarray(config.layer_ids),
            num_passes=num_passes,
            num_tokens=num_tokens,
            physical_count=physical,
            logical_count=to_logical(physical, config.physical_to_logical),  # type: ignore[arg-type]
            invalid_ids=layout.invalid(rows),
            send_count=rows[:, layout.send],
            recv_count=rows[:, layout.recv],
            dropped=rows[:, layout.dropped],
            **state,  # type: ignore[arg-type]
        )


class SnapshotChannel:
    """Two host buffers that receive the totals by pass phase ``[Q, L, C]`` and the tokens of each
    pass phase ``[Q]`` asynchronously at pass end (the totals are their sums over ``Q``).

    ``publish`` (forward thread, at pass end) first asks whether the copy in
    flight has finished (``event.query()``, never blocks), then copies into the
    buffer that does not hold the newest finished copy (``non_blocking=True``)
    and records an event. It copies only the rows ``[L, C]`` of the pass phases
    that changed since that buffer's last copy (a pass changes one: at
    DeepSeek-V3's 58 layers and 72 ranks, 0.2 MB a pass instead of all five
    phases' 1.0 MB). ``latest`` (any thread: an exporter's scrape) returns
    the newest finished copy from host memory only: it makes no CUDA call,
    which from another thread could break a CUDA-graph capture in progress.
    ``clear`` forgets both buffers without touching them (a copy may still be
    landing in one); until the next finished copy ``latest`` reads zeros. While
    recording, scrapes therefore lag the device by up to one pass; ``settle``
    (``stop_record``, ``dump_record``) waits for the last copy. All run under the
    recorder's lock.

    Args:
        shape: ``(Q, L, C)`` of the counter rows by pass phase.
    """

    def __init__(self, shape: tuple[int, int, int], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._rows = [torch.zeros(shape, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)]
        self._tokens = [torch.zeros(shape[0], dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)]
        self._views = [(rows.numpy(), tokens.numpy()) for rows, tokens in zip(self._rows, self._tokens, strict=True)]
        self._events: list[torch.cuda.Event | None] = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else [None, None]  # one per slot, made once: none per pass
        self._passes = [0, 0]
        self._timestamps = [0.0, 0.0]
        self._host = [np.zeros((2, shape[0]), np.int64) for _ in range(2)]  # passes, requests of each pass phase
        self._stale = np.ones((2, shape[0]), dtype=bool)  # [slot, Q]: the pass phases whose rows in a slot are older than the device's
        self._done = -1  # slot of the newest finished copy (-1: none since clear)
        self._flight = -1  # slot of the copy not yet known finished (-1: none)
        self._shape = shape
        self._empty_time = time.time()

    def _settle(self) -> None:
        slot = self._flight
        if slot >= 0:
            event = self._events[slot]
            if event is None or event.query():
                self._done, self._flight = slot, -1

    def publish(self, totals: torch.Tensor, tokens: torch.Tensor, changed_phase: int, num_passes: int, timestamp: float,
                host: np.ndarray | None = None) -> None:
        """Start copying ``totals [Q, L, C]`` and ``tokens [Q]`` (device) after ``num_passes`` passes,
        of which the last changed the rows of pass phase ``changed_phase`` only (the rows of the other
        phases are copied where the buffer's are older); ``host [2, Q]``: passes and requests of each
        pass phase (``None``: zeros)."""
        self._settle()
        slot = 1 if self._done == 0 else 0
        stale = self._stale
        stale[:, changed_phase] = True
        for phase in np.flatnonzero(stale[slot]).tolist():
            self._rows[slot][phase].copy_(totals[phase], non_blocking=True)
        stale[slot] = False
        self._tokens[slot].copy_(tokens, non_blocking=True)
        self._host[slot][:] = 0 if host is None else host
        event = self._events[slot]
        if event is not None:
            event.record()  # recorded again: a slot's event answers for its newest copy
        self._passes[slot], self._timestamps[slot] = num_passes, timestamp
        self._flight = slot
        if event is None:
            self._settle()

    def latest(self) -> tuple[np.ndarray, tuple[int, int, float]]:
        """``(rows [L, C], (passes, tokens, timestamp))`` of the newest finished copy (sums over pass phases)."""
        rows, progress, _ = self.latest_phases()
        return rows.sum(axis=0), (progress[0], int(progress[1].sum()), progress[2])

    def latest_phases(self) -> tuple[np.ndarray, tuple[int, np.ndarray, float], np.ndarray]:
        """``(rows [Q, L, C], (passes, tokens [Q], timestamp), host [2, Q])`` of the newest finished copy:
        the counter rows, tokens, passes and requests of each pass phase."""
        slot = self._done
        if slot < 0:
            q = self._shape[0]
            return np.zeros(self._shape, dtype=np.int64), (0, np.zeros(q, np.int64), self._empty_time), np.zeros((2, q), np.int64)
        rows, tokens = self._views[slot]
        return rows.copy(), (self._passes[slot], tokens.copy(), self._timestamps[slot]), self._host[slot].copy()

    def settle(self) -> None:
        """Wait for the copy in flight (a lifecycle call: the forward thread may be idle from now on)."""
        slot = self._flight
        if slot >= 0:
            event = self._events[slot]
            if event is not None:
                event.synchronize()
            self._done, self._flight = slot, -1

    def clear(self) -> None:
        self._done = self._flight = -1
        self._stale[:] = True  # the device's rows start over: both buffers copy every phase again
        self._empty_time = time.time()
