"""A recording's phase timing: the clock, the aggregates, the per-pass rows and what the last dump covered.

The recorder holds one :class:`RecordingTiming` built by :func:`recording_timing`: with
``RecorderConfig(timing=True)`` it times every recorded pass through a
:class:`~moetrace.timing.PhaseClock`, folds each resolved pass into
:class:`~moetrace.timing.TimingStats` (aggregates over all passes) and
:class:`~moetrace.timing.TimingRows` (``stat``: a ring of the window's rows; streaming modes: a
block handed to the segment writer when full); without it, :class:`NoTiming`, whose every method
does nothing, so the recorder never asks whether it times.

Thread use: :meth:`RecordingTiming.begin_pass`, :meth:`RecordingTiming.end_pass` and the scopes
of :attr:`RecordingTiming.live` run on the forward thread; :meth:`RecordingTiming.add` and
everything a dump or a snapshot calls run under the recorder's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..config import RecorderConfig
from ..cuda_clock import make_clock
from ..graphs import is_capturing
from ..timing import (
    PassTiming,
    PhaseClock,
    TimingCaptureError,
    TimingRows,
    TimingStats,
    row_fields,
)
from ..trace.schema import Data, dataset
from ..trace.stream import StreamJob

__all__ = ["NoTiming", "RecordingTiming", "TimingPart", "recording_timing"]

#: One rank's timing in a dump: aggregates since the previous dump ``{field: array}`` and (``stat``)
#: the window's ``/timing`` rows ``{field: [W, ...]}``, else ``None``.
TimingPart = tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]

#: The additive aggregates a streaming dump covers since the previous one (maxima are since start_record).
_ADDITIVE = ("phase_seconds_sum", "phase_count", "phase_histogram", "step_seconds_sum", "step_count", "step_histogram")


class NoTiming:
    """A recording without phase timing: nothing timed, nothing stored, nothing in a dump."""

    #: The clock while a timed pass runs (``None``: no pass is timed).
    live: PhaseClock | None = None
    #: The clock's kind (``"cuda_event"`` / ``"perf_counter"``), ``None`` without timing.
    kind: str | None = None

    def row_schema(self) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
        """``{field: (row shape, dtype)}`` of the ``/timing`` rows a trace streams (``None``: none)."""
        return None

    def begin_pass(self, recorded: bool, device: torch.device) -> None:
        """A pass begins (``recorded``: its hooks count)."""

    def begin_capture(self, device: torch.device) -> None:
        """A hook runs under a CUDA-graph capture."""

    def end_pass(self, pass_id: int) -> Sequence[PassTiming]:
        """The pass ended: the passes whose timing resolved (forward thread, outside the lock)."""
        return ()

    def add(self, timings: Sequence[PassTiming]) -> None:
        """Fold resolved passes into the aggregates and rows (lock held)."""

    def close_pass(self) -> None:
        """The pass's scope ends (timed or not): no clock is live any more."""

    def discard_pass(self) -> None:
        """The pass raised: forget its timing."""

    def flush_rows(self) -> None:
        """Hand the staged ``/timing`` rows to the segment writer (streaming modes)."""

    def part(self, rows: bool, resolve: bool) -> TimingPart | None:
        """This rank's timing for a dump (``rows``: with the window's rows; ``resolve``: fold the
        passes whose CUDA events are in flight first, waiting for them); ``None`` without timing."""
        return None

    def cut(self) -> Callable[[], None]:
        """A streaming dump's cut: its aggregates cover the passes up to here; returns the undo of a failed dump (lock held)."""
        return _nothing

    def stats(self) -> dict[str, np.ndarray] | None:
        """Copies of the aggregates over every timed pass (``None`` without timing)."""
        return None

    def reset(self) -> None:
        """A new recording: nothing timed yet."""


def _nothing() -> None:
    return None


class RecordingTiming(NoTiming):
    """Phase timing of a recording (see the module docstring).

    Args:
        clock: the phase clock (host ``perf_counter_ns`` or CUDA events).
        num_layers: ``L``, the layers timed.
        row_capacity: rows held: the ``stat`` window, or a streaming hand-off's passes.
        hand_off: streaming modes: submits a block of ``/timing`` rows ``{dataset: [n, ...]}`` to
            the segment writer when ``row_capacity`` are staged; ``None`` (``stat``): the rows are a ring.
    """

    def __init__(self, clock: PhaseClock, num_layers: int, row_capacity: int, hand_off: Callable[[dict[str, np.ndarray]], None] | None) -> None:
        self.clock = clock
        self.kind = clock.kind
        self.live = None
        self._num_layers = num_layers
        self._stats = TimingStats(num_layers)
        self._rows = TimingRows(num_layers, row_capacity)
        self._hand_off = hand_off
        self._dumped: dict[str, np.ndarray] | None = None  # the aggregates at the last streaming dump's cut

    def row_schema(self) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
        return row_fields(self._num_layers)

    def begin_pass(self, recorded: bool, device: torch.device) -> None:
        if recorded or is_capturing(device):
            self.begin_capture(device)  # refuses a CUDA-graph capture

    def begin_capture(self, device: torch.device) -> None:
        if is_capturing(device):
            raise TimingCaptureError(
                "phase timing cannot run inside CUDA-graph capture (timed CUDA events are not capturable); "
                "build the recorder with RecorderConfig(timing=False) for a model run as CUDA graphs (its hooks are captured whether recording or not)"
            )
        self.clock.begin_pass()
        self.live = self.clock

    def end_pass(self, pass_id: int) -> Sequence[PassTiming]:
        return self.clock.end_pass(pass_id) if self.live is not None else ()

    def add(self, timings: Sequence[PassTiming]) -> None:
        for timing in timings:
            self._stats.add(timing)
            self._stats.dropped_passes = self.clock.dropped_passes
            self._rows.push(timing)
            if self._hand_off is not None and self._rows.pushed == self._rows.capacity:
                self.flush_rows()

    def close_pass(self) -> None:
        self.live = None

    def discard_pass(self) -> None:
        self.clock.discard_pass()

    def flush_rows(self) -> None:
        if not self._rows.pushed or self._hand_off is None:
            return
        rows = {dataset(Data.TIMING, name): array for name, array in self._rows.ordered().items()}
        self._rows.reset()
        self._hand_off(rows)

    def part(self, rows: bool, resolve: bool) -> TimingPart | None:
        if resolve:
            self.add(self.clock.flush())
        current = self._stats.arrays()
        if self._dumped is not None:
            for name in _ADDITIVE:
                current[name] = current[name] - self._dumped[name]
        return current, ({k: v.copy() for k, v in self._rows.ordered().items()} if rows else None)

    def cut(self) -> Callable[[], None]:
        previous = self._dumped
        self._dumped = current = self._stats.arrays()

        def undo() -> None:  # no later cut: the next dump's aggregates cover these passes too
            if self._dumped is current:
                self._dumped = previous

        return undo

    def stats(self) -> dict[str, np.ndarray] | None:
        return self._stats.arrays()

    def reset(self) -> None:
        self.clock.reset()
        self._stats.reset()
        self._rows.reset()
        self._dumped = None


def recording_timing(config: RecorderConfig, device: torch.device, streamed: bool,
                     submit: Callable[[StreamJob], None]) -> NoTiming:
    """A :class:`RecordingTiming` when ``config.timing``, else :class:`NoTiming`.

    ``streamed`` (the mode's sink streams, ``per_pass`` / ``per_token``): ``/timing`` rows are kept in
    blocks of ``config.stream_chunk_passes`` and each full block goes to ``submit`` (the segment
    writer) as a :class:`~moetrace.trace.stream.StreamJob`; ``stat``: a ring of the last
    ``config.window`` passes' rows. The CUDA clock keeps ``config.timing_ring`` events in flight."""
    if not config.timing:
        return NoTiming()
    clock = make_clock(config.num_layers, device, config.timing_ring)
    if not streamed:
        return RecordingTiming(clock, config.num_layers, config.window, None)

    def hand_off(rows: dict[str, np.ndarray]) -> None:
        submit(StreamJob(event=None, build=lambda: rows))

    return RecordingTiming(clock, config.num_layers, config.stream_chunk_passes, hand_off)
