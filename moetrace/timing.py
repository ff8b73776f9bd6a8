"""Phase timing: what route, dispatch, expert compute and combine cost per MoE layer.

A :class:`PhaseClock` times the phases a runtime brackets with
``recorder.with_phase(name)`` (names in :data:`PHASES`) inside
``recorder.with_current_layer(i)``, the layer scopes themselves and the whole
forward pass. Two implementations:

- :class:`HostClock` (CPU tensors): ``time.perf_counter_ns`` at entry and exit,
  kept in flat Python lists; a phase entered several times in one layer of one
  pass sums its durations.
- :class:`~moetrace.cuda_clock.CudaClock` (:mod:`moetrace.cuda_clock`, the one part that
  needs torch; this module loads none): a preallocated ring of ``torch.cuda.Event`` (timing
  enabled), one slot per pass in flight. Hooks only ``record()`` events. At a
  later pass end, a slot whose end event ``query()`` reports done is resolved
  with ``elapsed_time`` (never blocking); :meth:`CudaClock.flush` waits for the
  rest at dump time. When every slot is still in flight the new pass is not
  timed and counted in ``dropped_passes`` rather than waiting. A phase entered
  several times in one layer of one pass is timed from its first entry to its
  last exit. Timing inside CUDA-graph capture is refused with
  :class:`TimingCaptureError` (events with timing cannot be captured).

Neither reads a tensor value: the hooks stay within the hot-path contract.
Untested on a GPU in this repository's CI (no device); see docs/timing.md.

Each resolved pass is a :class:`PassTiming`; offsets are seconds since the
pass start, anchored to the host's unix time at that start (``start_unix``) so
the ranks of one run share a clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

__all__ = [
    "EXPORT_EDGES",
    "HISTOGRAM_EDGES",
    "PHASES",
    "UNTIMED",
    "HostClock",
    "PassTiming",
    "PhaseClock",
    "TimingCaptureError",
    "TimingRows",
    "TimingStats",
    "bucket_quantile",
    "cumulative_buckets",
    "row_fields",
]

#: Phase names, in the column order of every ``[..., phases]`` array.
PHASES: tuple[str, ...] = ("route", "dispatch", "expert", "combine")
#: What ``with_phase`` returns when nothing is timed: one shared null context (nothing allocated per call).
UNTIMED = contextlib.nullcontext()
_NAN = float("nan")

#: Upper edges (seconds) of the fixed histogram buckets: 16 per decade from 100 ns to 1000 s.
#: Bucket ``0`` holds values below ``HISTOGRAM_EDGES[0]``, bucket ``i`` values in
#: ``[edges[i-1], edges[i])``, the last bucket values ``>= edges[-1]``: ``len(edges) + 1`` buckets.
HISTOGRAM_EDGES: np.ndarray = 10.0 ** np.linspace(-7.0, 3.0, 161)


#: Bucket upper bounds exported to Prometheus (2 per decade, 10 us to 100 s): a subset of
#: :data:`HISTOGRAM_EDGES`, so exported counts are exact sums of the fine buckets.
EXPORT_EDGES: np.ndarray = HISTOGRAM_EDGES[((np.arange(-5.0, 2.01, 0.5) + 7.0) * 16).round().astype(int)]


def cumulative_buckets(histogram: np.ndarray, edges: np.ndarray = EXPORT_EDGES) -> np.ndarray:
    """Fine-bucket counts ``[..., B]`` -> cumulative counts of values below each of ``edges`` ``[..., len(edges)]``."""
    index = np.searchsorted(HISTOGRAM_EDGES, edges)
    return np.cumsum(histogram, axis=-1)[..., index]


class TimingCaptureError(RuntimeError):
    """Phase timing was asked for inside CUDA-graph capture, where it cannot work."""


@dataclasses.dataclass
class PassTiming:
    """One pass's timing on one rank (seconds; ``L`` MoE layers, ``F = len(PHASES)``).

    Attributes:
        pass_id: the recorder's pass id.
        start_unix: host unix time at the pass start (the epoch of every offset).
        step: the pass's duration (host wall time on CPU, device time on CUDA).
        peak_memory: peak device memory allocated during the pass in bytes (NaN on CPU).
        layer: ``[L]`` duration of each ``with_current_layer`` scope (0 when not entered).
        layer_start: ``[L]`` offset of the layer's first entry from the pass start (NaN when not entered).
        phase: ``[L, F]`` duration of each phase (0 when not entered).
        phase_start: ``[L, F]`` offset of the phase's first entry (NaN when not entered).
    """

    pass_id: int
    start_unix: float
    step: float
    peak_memory: float
    layer: np.ndarray
    layer_start: np.ndarray
    phase: np.ndarray
    phase_start: np.ndarray


class _PhaseScope:
    """Reusable context manager for one ``(layer, phase)`` column (nothing allocated per call)."""

    __slots__ = ("_enter", "_exit", "_index")

    def __init__(self, enter: Callable[[int], None], exit_: Callable[[int], None], index: int) -> None:
        self._enter, self._exit, self._index = enter, exit_, index

    def __enter__(self) -> None:
        self._enter(self._index)

    def __exit__(self, *exc: object) -> None:
        self._exit(self._index)


class PhaseClock:
    """Common bookkeeping: ``L`` layers x ``F`` phases; column ``l*F + f`` is a phase, ``L*F + l`` a layer."""

    kind = "none"

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.columns = num_layers * (len(PHASES) + 1)
        self.dropped_passes = 0
        f = len(PHASES)
        self.scopes = [[_PhaseScope(self._enter, self._exit, layer * f + p) for p in range(f)] for layer in range(num_layers)]
        self.layer_scopes = [_PhaseScope(self._enter, self._exit, num_layers * f + layer) for layer in range(num_layers)]

    def phase(self, layer: int, phase: int) -> _PhaseScope:
        return self.scopes[layer][phase]

    def _enter(self, column: int) -> None:
        raise NotImplementedError

    def _exit(self, column: int) -> None:
        raise NotImplementedError

    def begin_pass(self) -> None:
        raise NotImplementedError

    def end_pass(self, pass_id: int) -> list[PassTiming]:
        """Close the pass; returns the passes resolved now (this one on CPU, older ones on CUDA)."""
        raise NotImplementedError

    def discard_pass(self) -> None:
        raise NotImplementedError

    def flush(self) -> list[PassTiming]:
        """Resolve every pass still in flight (may wait for the device; dump time only)."""
        return []

    def reset(self) -> None:
        self.dropped_passes = 0

    def _split(self, pass_id: int, start_unix: float, step: float, peak: float, start: np.ndarray, duration: np.ndarray) -> PassTiming:
        lf = self.num_layers * len(PHASES)
        shape = (self.num_layers, len(PHASES))
        return PassTiming(
            pass_id=pass_id, start_unix=start_unix, step=step, peak_memory=peak,
            layer=duration[lf:].copy(), layer_start=start[lf:].copy(),
            phase=duration[:lf].reshape(shape).copy(), phase_start=start[:lf].reshape(shape).copy(),
        )


class HostClock(PhaseClock):
    """``perf_counter_ns`` timing on the host (CPU runtimes)."""

    kind = "perf_counter"

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        n = self.columns
        self._start: list[float] = [_NAN] * n
        self._open = [0] * n
        self._duration = [0] * n
        self._t0 = 0
        self._unix = 0.0
        self._clock = time.perf_counter_ns

    def _enter(self, column: int) -> None:
        now = self._clock()
        self._open[column] = now
        if self._start[column] != self._start[column]:  # NaN: first entry in this pass
            self._start[column] = now - self._t0

    def _exit(self, column: int) -> None:
        self._duration[column] += self._clock() - self._open[column]

    def begin_pass(self) -> None:
        n = self.columns
        self._start = [_NAN] * n
        self._duration = [0] * n
        self._unix = time.time()
        self._t0 = self._clock()

    def end_pass(self, pass_id: int) -> list[PassTiming]:
        step = (self._clock() - self._t0) * 1e-9
        start = np.asarray(self._start, dtype=np.float64) * 1e-9
        duration = np.asarray(self._duration, dtype=np.float64) * 1e-9
        return [self._split(pass_id, self._unix, step, _NAN, start, duration)]

    def discard_pass(self) -> None:
        return None


def bucket_quantile(histogram: np.ndarray, q: float, edges: np.ndarray = HISTOGRAM_EDGES) -> np.ndarray:
    """Quantile ``q`` in ``[0, 1]`` from fixed-bucket counts ``[..., len(edges) + 1]`` (seconds).

    The value is the geometric middle of the bucket where the cumulative count
    crosses ``q`` (relative error under 8% with 16 buckets per decade); NaN
    where a histogram is empty.
    """
    counts = np.asarray(histogram, dtype=np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    cumulative = np.cumsum(counts, axis=-1)
    bucket = np.argmax(cumulative >= np.maximum(q * total, 1e-12), axis=-1)
    lower = np.concatenate([[edges[0] / 10 ** (1 / 16)], edges])
    upper = np.concatenate([edges, [edges[-1] * 10 ** (1 / 16)]])
    value = np.sqrt(lower[bucket] * upper[bucket])
    return np.where(total[..., 0] > 0, value, math.nan)


def row_fields(num_layers: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Row shape and dtype of each ``/timing`` dataset (see docs/trace-format.md)."""
    f, f64 = len(PHASES), np.dtype(np.float64)
    return {
        "pass_id": ((), np.dtype(np.int64)),
        "start_unix": ((), f64),
        "step": ((), f64),
        "peak_memory": ((), f64),
        "layer": ((num_layers,), f64),
        "layer_start": ((num_layers,), f64),
        "phase": ((num_layers, f), f64),
        "phase_start": ((num_layers, f), f64),
    }


class TimingRows:
    """Host rows of :class:`PassTiming`, ``capacity`` passes: a ring (``stat`` window) or a staging block.

    Arrays are allocated once; :meth:`push` writes one row in place.
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.arrays = {name: np.zeros((capacity, *shape), dtype=dtype) for name, (shape, dtype) in row_fields(num_layers).items()}
        self.pushed = 0

    def push(self, timing: PassTiming) -> int:
        """Store ``timing`` in the oldest slot; returns the slot."""
        slot = self.pushed % self.capacity
        for name, array in self.arrays.items():
            array[slot] = getattr(timing, name)
        self.pushed += 1
        return slot

    def ordered(self) -> dict[str, np.ndarray]:
        """Copies of the rows held, oldest first."""
        n = self.capacity
        order = np.arange(self.pushed) if self.pushed <= n else np.roll(np.arange(n), -(self.pushed % n))
        return {name: array[order] for name, array in self.arrays.items()}

    def reset(self) -> None:
        self.pushed = 0


class TimingStats:
    """Aggregates over every timed pass: per ``(layer, phase)`` sum, count, max and a fixed-bucket histogram, same for the step.

    Attributes (``L`` layers, ``F`` phases, ``B = len(HISTOGRAM_EDGES) + 1`` buckets):
        phase_seconds_sum, phase_seconds_max: ``[L, F]`` float64.
        phase_count: ``[L, F]`` passes in which the phase ran.
        phase_histogram: ``[L, F, B]`` counts of per-pass durations.
        step_seconds_sum, step_seconds_max, step_count, step_histogram ``[B]``: the same for the step.
        peak_memory_bytes: the largest per-pass peak (NaN on CPU).
        dropped_passes: passes not timed because every CUDA event slot was in flight.
    """

    def __init__(self, num_layers: int) -> None:
        f, b = len(PHASES), len(HISTOGRAM_EDGES) + 1
        self._columns = np.arange(num_layers * f) * b
        self.phase_seconds_sum = np.zeros((num_layers, f))
        self.phase_seconds_max = np.zeros((num_layers, f))
        self.phase_count = np.zeros((num_layers, f), dtype=np.int64)
        self.phase_histogram = np.zeros((num_layers, f, b), dtype=np.int64)
        self.step_histogram = np.zeros(b, dtype=np.int64)
        self.reset()

    def add(self, timing: PassTiming) -> None:
        entered = ~np.isnan(timing.phase_start)
        self.phase_seconds_sum += timing.phase
        np.maximum(self.phase_seconds_max, timing.phase, out=self.phase_seconds_max)
        self.phase_count += entered
        flat = self._columns + np.searchsorted(HISTOGRAM_EDGES, timing.phase.ravel(), side="right")
        self.phase_histogram.reshape(-1)[flat[entered.ravel()]] += 1
        self.step_seconds_sum += timing.step
        self.step_seconds_max = max(self.step_seconds_max, timing.step)
        self.step_count += 1
        self.step_histogram[np.searchsorted(HISTOGRAM_EDGES, timing.step, side="right")] += 1
        if not math.isnan(timing.peak_memory):
            self.peak_memory_bytes = timing.peak_memory if math.isnan(self.peak_memory_bytes) else max(self.peak_memory_bytes, timing.peak_memory)
        self.last = timing

    def arrays(self) -> dict[str, np.ndarray]:
        """Copies of every aggregate under its ``/stat`` dataset name."""
        return {
            "phase_seconds_sum": self.phase_seconds_sum.copy(),
            "phase_seconds_max": self.phase_seconds_max.copy(),
            "phase_count": self.phase_count.copy(),
            "phase_histogram": self.phase_histogram.copy(),
            "step_seconds_sum": np.float64(self.step_seconds_sum),
            "step_seconds_max": np.float64(self.step_seconds_max),
            "step_count": np.int64(self.step_count),
            "step_histogram": self.step_histogram.copy(),
            "peak_memory_bytes": np.float64(self.peak_memory_bytes),
            "timing_dropped_passes": np.int64(self.dropped_passes),
        }

    def reset(self) -> None:
        for array in (self.phase_seconds_sum, self.phase_seconds_max, self.phase_count, self.phase_histogram, self.step_histogram):
            array.fill(0)
        self.step_seconds_sum = self.step_seconds_max = 0.0
        self.step_count = 0
        self.peak_memory_bytes = _NAN
        self.dropped_passes = 0
        self.last: PassTiming | None = None
