"""Engine adapters (Hugging Face transformers, vLLM, SGLang, Megatron-Core).

Every engine module offers one contract::

    instrument(target, recorder=None, capturer=None, *, <typed options>, **recorder_options) -> Instrumentation

- ``target``: what to hook. ``hf``: a transformers model; ``vllm``: a ``vllm.LLM`` (in-process
  engine) or a vLLM model module; ``megatron``: a ``GPTModel``, any module holding ``MoELayer``
  s, or one ``MoELayer``; ``sglang``: ``None``, SGLang in this process (its recorder hooks are
  module-level, so there is nothing to hand over).
- ``recorder``: the recorder to count into; ``None`` builds one from the model and
  ``recorder_options`` (:class:`~moetrace.config.RecorderConfig` fields: ``mode``,
  ``output_dir``, ...) and installs it globally.
- ``capturer``: a routed-experts capturer, fed by ``hf``. ``vllm``, ``sglang`` and ``megatron``
  refuse one with the engine's own way to the same routes (vLLM's and SGLang's per-request
  capture, Megatron's ``record_routes``).
- Typed options, keyword-only with defaults: ``mark_passes: bool = True`` (``hf``, ``vllm``,
  ``megatron``: wrap the forward in ``with_forward_pass``; turn off when you mark passes
  yourself); ``hf`` also ``top_k: int | None`` (experts per token when the config does not say)
  and ``capture_seq_len: int | None`` (KV slots per batch row for the capturer).

Instrumenting again with the same (or no) recorder returns the live handle; another recorder
raises :class:`AlreadyInstrumentedError`. ``tests/adapters/test_contract.py`` checks the four
signatures from the source. The shared handle and hook bookkeeping live in
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
