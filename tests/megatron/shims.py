"""CPU stand-ins that let Megatron-Core 0.16.1's MoE code run on a CPU-only machine with gloo.

These patches are the TEST HARNESS's, never the adapter's: moetrace.adapters.megatron
attaches to Megatron as it is. Each one replaces a CUDA-only call that Megatron makes
unconditionally on code paths the tests run, by the CPU equivalent; none changes what
Megatron computes. :func:`apply` installs all of them once per process (idempotent).

1. ``torch.cuda.current_device()``: ``router.py`` (``Router.gating`` moves the gate
   weight there; ``TopKRouter`` buffers) and ``experts.py`` (``GroupedMLP`` /
   ``SequentialMLP`` weights) place tensors on it. Answer ``"cpu"``.
2. ``torch.cuda.Stream`` / ``current_stream`` / ``stream``: ``MoEAlltoAllTokenDispatcher``
   builds a class-level device-to-host copy stream and records an event on it
   (``_maybe_dtoh_and_synchronize``). CPU stand-ins: one stream object whose
   ``wait_stream`` does nothing and whose ``record_event`` returns an event whose
   ``synchronize`` does nothing (CPU work is already complete in program order).
3. ``moe_utils.te_general_gemm``: referenced by ``RouterGatingLinearFunction`` but only
   defined when Transformer Engine imports; without TE it is an undefined name
   (``NameError``). Set it to ``None``, the value Megatron's own ``if`` tests for.
4. ``token_dispatcher.maybe_move_tensor_to_cpu``: converts only CUDA tensors, so on CPU the
   all-to-all split sizes stay tensors, which gloo's ``all_to_all_single`` refuses. The
   stand-in also honours ``as_numpy=True`` for CPU tensors (what the CUDA path returns).
5. ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: activation
   recomputation (``tensor_parallel.checkpoint``, ``recompute_modules=["moe"]``) saves and
   restores the CUDA generator around the recomputed forward. On CPU there is none: an
   empty state, and nothing to restore (the CPU generator is saved and restored by
   Megatron itself, ``torch.get_rng_state`` / ``set_rng_state``).

A whole ``GPTModel`` would also need the CUDA RNG tracker mapped to the CPU generator; the
tests build bare ``MoELayer`` stacks (tests/megatron/harness.py) and do not need it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["apply", "reset_megatron_state"]

_APPLIED = False


class _CPUEvent:
    def synchronize(self) -> None:
        """CPU work is complete in program order: nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to order on CPU."""


class _CPUStream:
    def wait_stream(self, other: Any) -> None:
        """Nothing to order on CPU."""

    def record_event(self, event: Any = None) -> _CPUEvent:
        return _CPUEvent()

    def synchronize(self) -> None:
        """Nothing in flight on CPU."""


_STREAM = _CPUStream()


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    yield


def apply() -> None:
    """Install the CPU stand-ins (see the module docstring); a second call does nothing."""
    global _APPLIED
    if _APPLIED:
        return
    torch.cuda.current_device = lambda: "cpu"  # 1
    torch.cuda.Stream = lambda *a, **k: _STREAM  # 2
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.stream = _stream

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):  # 3
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:  # 4
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)  # 5
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    _APPLIED = True


def reset_megatron_state() -> None:
    """Clear Megatron's process-global state that leaks between models in one process.

    ``RouterReplay.global_router_replay_instances`` (one per router ever built), the
    aux-loss tracker, and the all-to-all dispatcher's class-level stream.
    """
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    RouterReplay.clear_global_router_replay_instances()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
