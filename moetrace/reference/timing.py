"""Optional per-layer phase timing: route, dispatch, expert compute, combine.

Off by default and then free (a shared null context). On a GPU each phase is
bracketed by CUDA events, resolved only when :meth:`PhaseTimer.summary` is
called; on the CPU it uses the wall clock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["PHASES", "PhaseTimer", "phase"]

PHASES: tuple[str, ...] = ("route", "dispatch", "expert", "combine")
_NULL = contextlib.nullcontext()


class PhaseTimer:
    """Accumulates seconds per ``(MoE layer, phase)`` while :attr:`enabled`.

    Args:
        num_layers: MoE layers ``L`` (compact index).
        device: device the layers run on (CUDA events on ``cuda``).
    """

    def __init__(self, num_layers: int, device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.enabled = False
        self._cuda = torch.device(device).type == "cuda"
        self._seconds = np.zeros((num_layers, len(PHASES)))
        self._calls = np.zeros((num_layers, len(PHASES)), dtype=np.int64)
        self._pending: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []

    def phase(self, layer: int, name: str) -> contextlib.AbstractContextManager[None]:
        """Context manager timing ``name`` (one of :data:`PHASES`) of MoE layer ``layer``."""
        if not self.enabled:
            return _NULL
        return self._timed(layer, PHASES.index(name))

    @contextlib.contextmanager
    def _timed(self, layer: int, column: int) -> Iterator[None]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((layer, column, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[layer, column] += time.perf_counter() - t0
        self._calls[layer, column] += 1

    def summary(self) -> dict[str, np.ndarray]:
        """``{"seconds": [L, 4], "calls": [L, 4]}`` in :data:`PHASES` order (waits for pending CUDA events)."""
        for layer, column, start, end in self._pending:
            end.synchronize()
            self._seconds[layer, column] += start.elapsed_time(end) / 1e3
        self._pending.clear()
        return {"seconds": self._seconds.copy(), "calls": self._calls.copy()}

    def reset(self) -> None:
        self._pending.clear()
        self._seconds[:] = 0
        self._calls[:] = 0


def phase(timer: PhaseTimer | None, layer: int, name: str) -> contextlib.AbstractContextManager[None]:
    """``timer.phase(layer, name)``, or a null context when there is no timer."""
    return _NULL if timer is None else timer.phase(layer, name)
