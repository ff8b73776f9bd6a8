"""The CUDA clock's ring bookkeeping, on CPU, with a stand-in for ``torch.cuda.Event``.

No GPU here: this checks moetrace's own logic (which slot a pass uses, that a
pass is resolved only once its end event reports done, that a full ring skips a
pass instead of waiting, flush order, capture refusal). It is not a test of
CUDA itself; the real device path runs in benchmarks/gpu_check.py on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from moetrace.cuda_clock import CudaClock
from moetrace.timing import TimingCaptureError


class _Device:
    """Stand-in device: a clock in ms and a switch saying whether recorded work has finished."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.done = True
        self.capturing = False


def _install(monkeypatch, device: _Device) -> None:
    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self) -> None:
            self.at = device.now_ms

        def query(self) -> bool:
            return device.done

        def synchronize(self) -> None:
            device.done = True

        def elapsed_time(self, end: Event) -> float:
            assert self.at is not None and end.at is not None, "elapsed_time on unrecorded events"
            if not (self.query() and end.query()):  # as torch's CUDAEvent::elapsed_time
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: device.capturing)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1024.0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)


def _pass(clock: CudaClock, device: _Device, expert_ms: float) -> None:
    clock.begin_pass()
    device.now_ms += 1
    with clock.layer_scopes[0]:
        with clock.phase(0, 0):
            device.now_ms += 1
        with clock.phase(0, 2):
            device.now_ms += expert_ms
    device.now_ms += 1


def test_passes_resolve_when_done_and_a_full_ring_skips_instead_of_waiting(monkeypatch):
    device = _Device()
    _install(monkeypatch, device)
    clock = CudaClock(num_layers=1, device=torch.device("cuda", 0), depth=2)
    _pass(clock, device, expert_ms=5)
    first = clock.end_pass(0)
    assert [t.pass_id for t in first] == [0]
    assert first[0].phase[0, 2] == pytest.approx(5e-3) and first[0].phase_start[0, 2] == pytest.approx(2e-3)
    assert first[0].layer[0] == pytest.approx(6e-3) and first[0].step == pytest.approx(8e-3)
    assert math.isnan(first[0].phase_start[0, 1]) and first[0].peak_memory == 1024.0
    device.done = False  # the device falls behind: nothing resolves, nothing waits
    for pass_id in (1, 2):
        _pass(clock, device, expert_ms=7)
        assert clock.end_pass(pass_id) == []
    _pass(clock, device, expert_ms=9)  # both slots in flight: this pass is not timed
    assert clock.end_pass(3) == [] and clock.dropped_passes == 1
    device.done = True
    _pass(clock, device, expert_ms=3)  # begin_pass resolves the slot it reuses; end_pass the rest
    resolved = clock.end_pass(4)
    assert [t.pass_id for t in resolved] == [1, 2, 4]
    assert [round(t.phase[0, 2] * 1e3) for t in resolved] == [7, 7, 3]
    assert clock.flush() == []


def test_flush_waits_for_pending_passes_in_order(monkeypatch):
    device = _Device()
    _install(monkeypatch, device)
    clock = CudaClock(num_layers=1, device=torch.device("cuda", 0), depth=4)
    device.done = False
    for pass_id in range(3):
        _pass(clock, device, expert_ms=pass_id + 1)
        assert clock.end_pass(pass_id) == []
    flushed = clock.flush()
    assert [t.pass_id for t in flushed] == [0, 1, 2]
    assert [round(t.phase[0, 2] * 1e3) for t in flushed] == [1, 2, 3]


def test_timing_inside_graph_capture_is_refused(monkeypatch):
    device = _Device()
    _install(monkeypatch, device)
    clock = CudaClock(num_layers=1, device=torch.device("cuda", 0))
    clock.begin_pass()
    device.capturing = True
    with pytest.raises(TimingCaptureError, match="CUDA-graph capture"), clock.phase(0, 2):
        pass


def test_a_phase_on_another_stream_still_running_keeps_the_pass_pending(monkeypatch):
    """The end event finished but an expert-phase event recorded on a side stream has not:
    the pass is not resolved (``elapsed_time`` would raise) until that event is done too."""
    device = _Device()
    _install(monkeypatch, device)
    clock = CudaClock(num_layers=1, device=torch.device("cuda", 0), depth=2)
    _pass(clock, device, expert_ms=5)
    side = clock._ring[0].ends[2]
    side.query = lambda: False  # type: ignore[method-assign]
    assert clock.end_pass(0) == []  # no raise, nothing resolved
    _pass(clock, device, expert_ms=4)
    assert [t.pass_id for t in clock.end_pass(1)] == [1]
    _pass(clock, device, expert_ms=2)  # reuses pass 0's slot, still unfinished: skipped, not waited for
    assert clock.end_pass(2) == [] and clock.dropped_passes == 1
    del side.query  # the side stream finishes
    flushed = clock.flush()
    assert [t.pass_id for t in flushed] == [0] and flushed[0].phase[0, 2] == pytest.approx(5e-3)
