"""``stat`` mode's sink: a ring of the last ``W`` passes on the device, and a dump's copy of it on write."""

from __future__ import annotations

import numpy as np
import torch

from ..batch import PassBatch
from ..config import RecorderConfig
from ..trace.stat import CounterLayout
from .pass_counter import PassCounter
from .sink import ModeSink, copy_event

__all__ = ["StatWindow", "WindowCut"]


class WindowCut:
    """A ``stat`` dump's copy of the window ring ``[W, L, P]`` as it was at the cut, taken without
    holding up the pass ends: copy on write into a host buffer.

    The cut's live slots are copied a batch at a time (:meth:`StatWindow.copy_cut`, recorder lock
    held for one batch only), and a pass end about to overwrite a live slot not copied yet copies
    that slot first (:meth:`StatWindow.push`). Copies are ``non_blocking`` (into pinned memory on
    CUDA, ordered on the stream before the overwrite); :meth:`StatWindow.end_cut` gives the event
    to wait for.

    Attributes:
        host: ``[W, L, P]`` int32 host buffer, slot-indexed like the ring.
        order: the live slots at the cut, oldest first.
        pending: ``[W]`` bool, live slots not copied yet.
    """

    def __init__(self, host: torch.Tensor, order: np.ndarray) -> None:
        self.host = host
        self.order = order
        self.pending = np.zeros(len(host), dtype=bool)
        self.pending[order] = True

    def take(self, counts: torch.Tensor, slots: np.ndarray) -> None:
        """Copy the pending ``slots`` of ``counts`` (the ring) into :attr:`host`, run by run of consecutive slots."""
        slots = np.sort(slots[self.pending[slots]])
        if not len(slots):
            return
        self.pending[slots] = False
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        for run in np.split(slots, breaks):
            a, b = int(run[0]), int(run[-1]) + 1
            self.host[a:b].copy_(counts[a:b], non_blocking=True)


class StatWindow(ModeSink):
    """``stat`` mode: a ring of the last ``W`` passes' expert counts ``[W, L, P]`` (int32) and tokens ``[W]`` (int64,
    on the device), plus host metadata (pass id, timestamp, pass phase, requests)."""

    def __init__(self, config: RecorderConfig, layout: CounterLayout) -> None:
        w = config.window
        self.experts = layout.experts
        self.counts = torch.zeros((w, config.num_layers, config.num_physical_experts), dtype=torch.int32, device=config.device)
        self.pass_id = np.full(w, -1, dtype=np.int64)
        self.timestamp = np.zeros(w, dtype=np.float64)
        self.pass_phase = np.zeros(w, dtype=np.int8)
        self.requests = np.full(w, -1, dtype=np.int64)
        self.tokens = torch.zeros(w, dtype=torch.int64, device=config.device)
        self.pushed = 0
        self._cuts: list[WindowCut] = []  # dumps' copies of the ring still being taken

    def host_buffer(self) -> torch.Tensor:
        """A fresh host buffer for one :class:`WindowCut` (pinned on CUDA): ``[W, L, P]`` int32, zeroed
        here (before the recorder's lock) so that the copies made under the lock fault in no page."""
        return torch.zeros(tuple(self.counts.shape), dtype=torch.int32, pin_memory=self.counts.device.type == "cuda")

    def cut(self, host: torch.Tensor) -> WindowCut:
        """Begin a dump's copy of the ring into ``host`` (recorder lock held): O(W) host bookkeeping, no copy."""
        cut = WindowCut(host, self.order())
        self._cuts.append(cut)
        return cut

    def copy_cut(self, cut: WindowCut, slots: np.ndarray) -> None:
        """Copy ``slots`` of the cut (those no pass end copied yet) into its host buffer (recorder lock held)."""
        cut.take(self.counts, slots)

    def end_cut(self, cut: WindowCut) -> torch.cuda.Event | None:
        """Stop copying on write for ``cut`` (recorder lock held; after every live slot was taken, or
        after a failure); the CUDA event after its copies (``None`` on the CPU, where they are done)."""
        self._cuts.remove(cut)
        return copy_event(self.counts.device)

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, batch: PassBatch | None) -> None:
        """Store the pass's expert counts ``counter.current[:, P columns]`` and tokens in the oldest
        slot (copying it first into a dump's cut that still needs it)."""
        slot = self.pushed % len(self.pass_id)
        for cut in self._cuts:
            if cut.pending[slot]:
                cut.take(self.counts, np.array([slot]))
        self.counts[slot].copy_(counter.current[:, self.experts])
        self.tokens[slot : slot + 1].copy_(counter.pass_tokens)
        self.pass_id[slot], self.timestamp[slot] = pass_id, timestamp
        self.pass_phase[slot], self.requests[slot] = phase, requests
        self.pushed += 1

    def order(self) -> np.ndarray:
        """Slot indices oldest to newest."""
        w = len(self.pass_id)
        if self.pushed <= w:
            return np.arange(self.pushed)
        start = self.pushed % w
        return np.concatenate([np.arange(start, w), np.arange(start)])

    def reset(self) -> None:
        self.pass_id.fill(-1)
        self.pushed = 0

