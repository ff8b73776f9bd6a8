"""CUDA-event phase timing: :class:`CudaClock`, and :func:`make_clock`, which picks the clock of a device.

:class:`CudaClock` keeps a preallocated ring of ``torch.cuda.Event`` (timing enabled), one slot
per pass in flight; the rest of phase timing (phase names, :class:`~moetrace.timing.HostClock`,
histograms, rows) is :mod:`moetrace.timing`, which loads no torch. See that module's docstring
for how passes are resolved and dropped.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .timing import HostClock, PassTiming, PhaseClock, TimingCaptureError

__all__ = ["CudaClock", "make_clock"]

_NAN = float("nan")


class _Slot:
    """Events of one pass in flight on the device."""

    def __init__(self, columns: int) -> None:
        def event() -> torch.cuda.Event:
            return torch.cuda.Event(enable_timing=True)

        self.begin, self.end = event(), event()
        self.starts = [event() for _ in range(columns)]
        self.ends = [event() for _ in range(columns)]
        self.entered = [False] * columns
        self.pending = False
        self.pass_id = -1
        self.unix = 0.0
        self.peak = _NAN


class CudaClock(PhaseClock):
    """CUDA-event timing from a preallocated ring of ``depth`` pass slots (see the module docstring)."""

    kind = "cuda_event"

    def __init__(self, num_layers: int, device: torch.device, depth: int = 4) -> None:
        super().__init__(num_layers)
        self.device = device
        self._ring = [_Slot(self.columns) for _ in range(depth)]
        self._head = 0
        self._slot: _Slot | None = None
        self._ready: list[PassTiming] = []

    def _enter(self, column: int) -> None:
        slot = self._slot
        if slot is None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise TimingCaptureError(
                "phase timing cannot run inside CUDA-graph capture (timed CUDA events are not capturable); "
                "build the recorder with RecorderConfig(timing=False) for captured graphs, or capture outside "
                "recorder.with_forward_pass"
            )
        if not slot.entered[column]:
            slot.starts[column].record()
            slot.entered[column] = True

    def _exit(self, column: int) -> None:
        slot = self._slot
        if slot is not None:
            slot.ends[column].record()

    def begin_pass(self) -> None:
        slot = self._ring[self._head]
        if slot.pending and not slot.end.query():
            self._slot = None  # every slot in flight: do not wait, skip this pass
            self.dropped_passes += 1
            return
        if slot.pending:
            timing = self._resolve(slot)
            if timing is None:  # a phase on another stream is still running: do not wait, skip this pass
                self._slot = None
                self.dropped_passes += 1
                return
            self._ready.append(timing)
        slot.entered = [False] * self.columns
        slot.unix = time.time()
        slot.begin.record()
        self._slot = slot

    def end_pass(self, pass_id: int) -> list[PassTiming]:
        slot, done, self._ready = self._slot, self._ready, []
        if slot is not None:
            slot.end.record()
            slot.pass_id, slot.pending = pass_id, True
            slot.peak = float(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            self._head = (self._head + 1) % len(self._ring)
            self._slot = None
        # Resolve, oldest first, the slots the device has finished (query() never blocks).
        for offset in range(len(self._ring)):
            older = self._ring[(self._head + offset) % len(self._ring)]
            if older.pending and older.end.query():
                timing = self._resolve(older)
                if timing is not None:
                    done.append(timing)
        return sorted(done, key=lambda t: t.pass_id)

    def _resolve(self, slot: _Slot) -> PassTiming | None:
        """The slot's timing, or ``None`` (slot still pending) while one of its events has not completed.

        The end event finishing does not imply the phase events finished when
        phases ran on another stream than the current one; each event is asked
        (``query()``, never blocking) before ``elapsed_time``, which refuses
        unfinished events.
        """
        n = self.columns
        entered = [c for c in range(n) if slot.entered[c]]
        if not all(slot.starts[c].query() and slot.ends[c].query() for c in entered):
            return None
        start = np.full(n, _NAN)
        duration = np.zeros(n)
        for c in entered:
            start[c] = slot.begin.elapsed_time(slot.starts[c]) * 1e-3
            duration[c] = slot.starts[c].elapsed_time(slot.ends[c]) * 1e-3
        step = slot.begin.elapsed_time(slot.end) * 1e-3
        slot.pending = False
        return self._split(slot.pass_id, slot.unix, step, slot.peak, start, duration)

    def discard_pass(self) -> None:
        self._slot = None

    def flush(self) -> list[PassTiming]:
        done, self._ready = self._ready, []
        for offset in range(len(self._ring)):
            slot = self._ring[(self._head + offset) % len(self._ring)]
            if slot.pending:
                for event in (slot.end, *(e for c in range(self.columns) if slot.entered[c] for e in (slot.starts[c], slot.ends[c]))):
                    event.synchronize()
                timing = self._resolve(slot)
                assert timing is not None
                done.append(timing)
        return sorted(done, key=lambda t: t.pass_id)

    def reset(self) -> None:
        super().reset()
        for slot in self._ring:
            slot.pending = False
        self._slot = None
        self._ready = []


def make_clock(num_layers: int, device: torch.device, depth: int = 4) -> PhaseClock:
    """The clock for ``device``: :class:`CudaClock` on CUDA, :class:`HostClock` otherwise."""
    if device.type == "cuda":
        return CudaClock(num_layers, device, depth)
    return HostClock(num_layers)
