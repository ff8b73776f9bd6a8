"""Engine adapters (Hugging Face transformers, vLLM, SGLang).

Each engine module offers ``instrument(target, recorder=None, capturer=None,
**options) -> Instrumentation``; the shared handle and hook bookkeeping live in
:mod:`moetrace.adapters.base`. Engine modules are imported on demand so that
``import moetrace.adapters`` needs no engine installed.
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
