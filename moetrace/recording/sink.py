"""What a recording keeps of each pass besides the pass counter's totals: the sink interface.

Each mode has one sink (its class in :mod:`moetrace.recording.modes` builds it): ``stat``'s
:class:`~moetrace.recording.window.StatWindow`, a ring of the last passes, and the streaming modes'
:class:`~moetrace.recording.streams.PassStream` and :class:`~moetrace.recording.streams.TokenStream`,
which stage rows and hand them to the segment writer. The recorder calls this one interface and
never asks for its mode.

All buffers are allocated once, at construction, and sized from the
:class:`~moetrace.config.RecorderConfig`. Pass-end methods run on the host thread between
passes with fixed-shape device ops, never reading device values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..batch import PassBatch
from ..trace.stream import StreamJob
from .pass_counter import PassCounter

__all__ = ["ModeSink", "Submit", "copy_event"]

#: Hands a job to the segment writer.
Submit = Callable[[StreamJob], None]


def copy_event(device: torch.device) -> torch.cuda.Event | None:
    """A CUDA event recorded after the copies just queued on ``device`` (``None`` off CUDA, where they are done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class ModeSink:
    """What a recording keeps of each pass besides the counter's totals, behind one interface, so
    that the recorder's pass end never asks which mode it runs in (the hooks count into the
    :class:`~moetrace.recording.pass_counter.PassCounter` alone).

    The defaults are those of a sink that hands nothing to a writer. Every method runs on the
    forward thread with fixed-shape device ops only.
    """

    #: Whether the sink hands its rows to the segment writer (streaming modes) rather than keeping a window.
    streamed = False

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, batch: PassBatch | None) -> None:
        """Keep the ended pass: its counter rows ``counter.current [L, C]``, tokens and stage
        (``counter.stage``, the first ``counter.pass_rows`` rows of each layer), its id, time, pass
        phase and request count (-1: unknown), and the engine's ``batch`` (``None``: not given)."""
        raise NotImplementedError

    def at_boundary(self) -> bool:
        """Whether what is staged ends on a chunk boundary of the segment (a time rotation waits for it)."""
        return True

    def flush(self, rotate: bool = False, wait: bool = False) -> None:
        """Hand what is staged to the writer; ``rotate`` closes the segment after it (nothing here)."""

    @property
    def dropped_passes(self) -> int:
        """Passes dropped whole since ``start_record`` because the writer was behind."""
        return 0

    def reset(self) -> None:
        """Start empty (a new recording)."""
        raise NotImplementedError
