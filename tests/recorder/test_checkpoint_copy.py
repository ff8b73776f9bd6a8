"""A ``stat`` checkpoint copies its window a part at a time (issue 50): no pass end carries the whole
``[W, L, P]`` copy (67 MB at DeepSeek-V3 size), and the checkpoint still holds the window exactly as it
was at its pass while the passes after it overwrite the ring (checked against the ids fed): the copy
goes oldest slot first, at least one a pass end, so it stays ahead of the overwrites, and a slot about to
be overwritten before it was copied is copied first (the dumps' copy on write, tests/recorder/test_dump_cut.py)."""

from __future__ import annotations

import numpy as np

from moetrace.recording import session as session_module
from moetrace.recording.window import StatWindow
from moetrace.trace import open_trace
from moetrace.trace.recover import recover
from tests.faults.recording import EXPERTS, LAYERS, feed, make_recorder, pass_ids

WINDOW, PERIOD, SLOTS_PER_PASS_END = 16, 20, 2


def expected_counts(first: int, last: int) -> np.ndarray:
    """``[passes, L, E]`` expert counts of passes ``first..last``, from the ids fed (numpy, not moetrace)."""
    return np.stack([np.stack([np.bincount(pass_ids(i)[:, layer].ravel(), minlength=EXPERTS) for layer in range(LAYERS)])
                     for i in range(first, last + 1)])


def checkpoint_after(tmp_path, monkeypatch, copy_bytes: int) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Record ``PERIOD`` passes (the checkpoint's cut) and 10 more while its window is copied; the
    slots copied at each copy call, and the checkpoint's totals, window pass ids and window counts."""
    monkeypatch.setattr(session_module, "CHECKPOINT_COPY_BYTES", copy_bytes)
    copied: list[int] = []
    real = StatWindow.copy_cut

    def spy(window, cut, slots):
        copied.append(len(slots))
        real(window, cut, slots)

    monkeypatch.setattr(StatWindow, "copy_cut", spy)
    out = tmp_path / "run"
    out.mkdir()
    rec = make_recorder("stat", out, segment_seconds=0, segment_passes=PERIOD, window=WINDOW)
    rec.start_record()
    for pass_id in range(PERIOD + 10):
        feed(rec, pass_id)
    session = rec._files.session
    assert session is not None
    session.writer.drain()  # the checkpoint of pass PERIOD - 1 is written (the next is due at 2 * PERIOD)
    [rank] = recover(out, tmp_path / "recovered.h5", force=True)
    with open_trace(rank.path) as trace:
        totals, window = trace.physical_count(), trace.window()
    rec.reset()
    return copied, totals, window.pass_id[0], window.physical_count[0]


def assert_as_at_its_pass(totals: np.ndarray, pass_id: np.ndarray, counts: np.ndarray) -> None:
    """The checkpoint holds the first ``PERIOD`` passes' totals and the last ``WINDOW`` of them in its window."""
    fed = expected_counts(0, PERIOD - 1)
    np.testing.assert_array_equal(totals, fed.sum(axis=0))
    np.testing.assert_array_equal(pass_id, np.arange(PERIOD - WINDOW, PERIOD))
    np.testing.assert_array_equal(counts, fed[-WINDOW:])  # slots overwritten meanwhile were copied before


def test_a_checkpoint_copies_its_window_a_part_a_pass_end_and_holds_it_as_at_its_pass(tmp_path, monkeypatch):
    slot_bytes = LAYERS * EXPERTS * 4
    copied, *checkpoint = checkpoint_after(tmp_path, monkeypatch, SLOTS_PER_PASS_END * slot_bytes)
    assert copied == [SLOTS_PER_PASS_END] * (WINDOW // SLOTS_PER_PASS_END), copied  # spread over 8 pass ends
    assert_as_at_its_pass(*checkpoint)


def test_negative_control_a_large_allowance_copies_the_window_at_once(tmp_path, monkeypatch):
    """The check above can fail: with room for the whole window, one pass end copies all of it (the
    same checkpoint)."""
    copied, *checkpoint = checkpoint_after(tmp_path, monkeypatch, 1 << 30)
    assert copied == [WINDOW]
    assert_as_at_its_pass(*checkpoint)
