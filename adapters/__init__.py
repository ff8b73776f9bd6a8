"""Engine adapters (Hugging Face transformers, vLLM, SGLang, Megatron-Core).

Each engine module offers ``instrument(...) -> Instrumentation``; the shared handle
and hook bookkeeping live in :mod:`moetrace.adapters.base`. The signatures do not
agree yet (one contract for all four is still to be made):

- ``hf.instrument(model, recorder=None, capturer=None, *, top_k, mark_passes, capture_seq_len, **recorder_options)``
- ``vllm.instrument(target, recorder=None, capturer=None, *, mark_passes, **recorder_options)``
- ``megatron.instrument(model, recorder=None, *, mark_passes, **recorder_options)``: no capturer
- ``sglang.instrument(recorder=None, capturer=None, **recorder_options)``: no target (SGLang in
  this process); a capturer is refused (SGLang captures routed experts itself)

``**recorder_options`` are :class:`~moetrace.config.RecorderConfig` fields for the recorder
the adapter builds when ``recorder`` is ``None``. Engine modules are imported on demand so
that ``import moetrace.adapters`` needs no engine installed.
"""

from __future__ import annotations

from typing import Any

from .base import (
    AdapterError,
    AlreadyInstrumentedError,
    Instrumentation,
    NoMoELayersError,
    UnsupportedVersionError,
    live_instrumentation,
)

__all__ = [
    "AdapterError",
    "AlreadyInstrumentedError",
    "Instrumentation",
    "NoMoELayersError",
    "UnsupportedVersionError",
    "live_instrumentation",
    "uninstrument",
]


def uninstrument(target: Any) -> list[str]:
    """Remove moetrace's instrumentation from ``target`` (no-op when it has none); returns problems met."""
    live = live_instrumentation(target)
    return live.uninstrument() if live is not None else []
