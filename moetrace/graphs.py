"""Where moetrace asks "is a CUDA graph being captured right now?".

Under CUDA graphs a hook's Python runs once, while the graph is captured; each
replay runs only the device ops it queued. The recorder therefore needs to know
when it is being captured (to queue its gated counting ops whether or not it is
recording, and to skip pass-end work that must not be captured).

:func:`is_capturing` answers for CUDA through
``torch.cuda.is_current_stream_capturing()``. For other devices it reports the
emulated capture of :class:`moetrace.testing.CpuGraph`, so that a CPU test suite
runs the same code paths as a GPU under graph capture and replay.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["emulated_capture", "is_capturing"]

_state = threading.local()


def is_capturing(device: torch.device) -> bool:
    """Whether work issued now on ``device`` is being captured into a graph (not run)."""
    if device.type == "cuda":
        return torch.cuda.is_current_stream_capturing()
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def emulated_capture() -> Iterator[None]:
    """Make :func:`is_capturing` report a capture in progress for non-CUDA devices (this thread)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
