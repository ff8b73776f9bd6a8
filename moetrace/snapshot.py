"""``RecorderSnapshot``: the host copy of a recorder's totals that exporters read.

A snapshot is immutable plain numpy; building it never touches device tensors
beyond the asynchronous copy the recorder made at the end of a pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import metrics
from .dispatch import ep_ideal_bytes, exchanged_bytes, remote_copies

__all__ = ["RecorderSnapshot"]


@dataclasses.dataclass(frozen=True)
class RecorderSnapshot(metrics.LoadMetrics):
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
