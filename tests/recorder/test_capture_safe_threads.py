"""Background threads make no CUDA call (one could break a CUDA-graph capture in progress).

Under the default global capture mode, an event query or synchronize from any
thread while another captures invalidates the capture. The writer thread and
exporters' scrapes must therefore never touch CUDA events: the forward thread
polls them at pass end, lifecycle calls settle them. Checked on CPU with
stand-in events that note which thread called them.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import torch

from moetrace.snapshot import SnapshotChannel
from moetrace.trace.stream import BackgroundTraceWriter, StreamJob


class FakeEvent:
    """A CUDA event stand-in: ``done`` says whether the copy before it finished; notes calling threads."""

    calls: ClassVar[list[tuple[str, int]]] = []

    def __init__(self) -> None:
        self.done = False

    def record(self) -> None:
        FakeEvent.calls.append(("record", threading.get_ident()))
        self.done = False  # as a CUDA event recorded again: not complete until the stream reaches it

    def query(self) -> bool:
        FakeEvent.calls.append(("query", threading.get_ident()))
        return self.done

    def synchronize(self) -> None:
        FakeEvent.calls.append(("synchronize", threading.get_ident()))
        self.done = True


class ListSink:
    def __init__(self) -> None:
        self.parts: list[object] = []

    def write(self, part: object) -> None:
        self.parts.append(part)

    def rotate(self) -> None:
        return None


def callers() -> set[int]:
    return {thread for _, thread in FakeEvent.calls}


def test_writer_thread_waits_for_the_forward_thread_to_see_the_copy_done():
    FakeEvent.calls = []
    sink = ListSink()
    writer = BackgroundTraceWriter(sink, max_pending=8)
    events = [FakeEvent() for _ in range(3)]
    for i, event in enumerate(events):
        writer.submit(StreamJob(event=event, build=lambda i=i: i, done=lambda: None))  # type: ignore[arg-type]
    writer.poll()  # nothing finished: nothing becomes ready
    assert sink.parts == []
    events[0].done = events[1].done = True
    writer.poll()
    writer.submit(StreamJob(event=None, build=lambda: "barrier", done=lambda: None))
    for _ in range(200):
        if len(sink.parts) == 2:
            break
        threading.Event().wait(0.01)
    assert sink.parts == [0, 1]  # job 2's copy is still in flight: the writer waits, in order
    writer.drain()  # a lifecycle call settles (synchronizes) on its own thread
    writer.close()
    assert [p for p in sink.parts if p is not None] == [0, 1, 2, "barrier"]  # (drain writes a None barrier)
    assert callers() == {threading.get_ident()}  # never the writer thread


def test_a_full_queue_settles_instead_of_deadlocking():
    FakeEvent.calls = []
    sink = ListSink()
    writer = BackgroundTraceWriter(sink, max_pending=1)
    for i in range(4):  # never polled: the writer could not proceed unless submit settles
        writer.submit(StreamJob(event=FakeEvent(), build=lambda i=i: i, done=lambda: None))  # type: ignore[arg-type]
    writer.close()
    assert sink.parts == [0, 1, 2, 3] and callers() == {threading.get_ident()}


def cuda_channel() -> SnapshotChannel:
    channel = SnapshotChannel((1, 2, 3), torch.device("cpu"))  # one pass phase
    channel._cuda = True  # events as on a GPU (one per slot, made once, recorded again); host buffers stay unpinned here
    channel._events = [FakeEvent(), FakeEvent()]  # type: ignore[list-item]
    return channel


def scrape(channel: SnapshotChannel) -> tuple[np.ndarray, tuple[int, int, float]]:
    out: list[tuple[np.ndarray, tuple[int, int, float]]] = []
    thread = threading.Thread(target=lambda: out.append(channel.latest()))
    thread.start()
    thread.join()
    return out[0]


def test_scrapes_read_host_memory_only_and_clear_drops_copies_in_flight():
    FakeEvent.calls = []
    channel = cuda_channel()
    ones, tokens = torch.ones((1, 2, 3), dtype=torch.int64), torch.tensor([5])
    channel.publish(ones, tokens, 0, 1, 10.0)
    rows, (passes, num_tokens, _) = scrape(channel)
    assert rows.sum() == 0 and passes == 0  # the copy is not known finished yet
    channel._events[channel._flight].done = True  # type: ignore[union-attr]
    channel.publish(ones * 2, tokens * 2, 0, 2, 11.0)  # pass end: the forward thread sees the first copy done
    rows, (passes, num_tokens, _) = scrape(channel)
    assert rows.sum() == 6 and (passes, num_tokens) == (1, 5)
    channel.clear()  # start_record/reset while pass 2's copy may still be landing
    channel._events[0].done = channel._events[1].done = True  # type: ignore[union-attr]
    rows, (passes, num_tokens, _) = scrape(channel)
    assert rows.sum() == 0 and (passes, num_tokens) == (0, 0)
    channel.publish(ones * 3, tokens * 3, 0, 1, 12.0)
    channel._events[channel._flight].done = True  # type: ignore[union-attr]
    channel.publish(ones * 4, tokens * 4, 0, 2, 13.0)
    rows, (passes, num_tokens, _) = scrape(channel)
    assert rows.sum() == 18 and (passes, num_tokens) == (1, 15)  # the new recording's copy, never the stale one
    assert callers() == {threading.get_ident()}  # the scrape threads made no event call


def test_a_lifecycle_call_settles_the_last_copy():
    """An idle engine publishes no more passes: stop_record/dump_record wait for the copy in flight."""
    FakeEvent.calls = []
    channel = cuda_channel()
    channel.publish(torch.ones((1, 2, 3), dtype=torch.int64), torch.tensor([4]), 0, 1, 10.0)
    assert scrape(channel)[1][:2] == (0, 0)
    channel.settle()
    rows, (passes, tokens, _) = scrape(channel)
    assert rows.sum() == 6 and (passes, tokens) == (1, 4)
    assert ("synchronize", threading.get_ident()) in FakeEvent.calls and callers() == {threading.get_ident()}
