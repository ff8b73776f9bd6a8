"""KV-slot bookkeeping of the serving loop: a slot allocator and the ``req_to_token`` table."""

from __future__ import annotations

import torch

__all__ = ["KVSlotAllocator", "ReqToTokenPool", "SlotError"]


class SlotError(RuntimeError):
    """A slot request that cannot be served (pool exhausted, slot not live, double free)."""


class KVSlotAllocator:
    """Hands out KV-cache slot numbers ``0..num_slots-1``; freed slots are reused first (LIFO).

    Args:
        num_slots: slots in the KV cache.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._used = bytearray(num_slots)

    @property
    def available(self) -> int:
        """Free slots."""
        return len(self._free)

    def alloc(self, count: int) -> list[int]:
        """``count`` free slots (most recently freed first)."""
        if count > len(self._free):
            raise SlotError(f"asked for {count} KV slots but only {len(self._free)} of {self.num_slots} are free; finish requests or raise num_kv_slots")
        slots = [self._free.pop() for _ in range(count)]
        for slot in slots:
            self._used[slot] = 1
        return slots

    def free(self, slots: list[int]) -> None:
        """Return ``slots`` to the pool."""
        for slot in slots:
            if not 0 <= slot < self.num_slots or not self._used[slot]:
                raise SlotError(f"KV slot {slot} is not allocated; it cannot be freed")
            self._used[slot] = 0
        self._free.extend(reversed(slots))


class ReqToTokenPool:
    """Request slot -> KV slots table ``req_to_token [max_requests, max_len]``.

    Tracks which request slots are live and, for each, how many leading
    positions have been written by a forward pass (:meth:`written`).

    Args:
        max_requests: request slots.
        max_len: longest request in tokens.
        device: where the table lives (the model's device).
    """

    def __init__(self, max_requests: int, max_len: int, device: torch.device | str = "cpu") -> None:
        if max_requests <= 0 or max_len <= 0:
            raise ValueError(f"max_requests and max_len must be positive, got {max_requests}, {max_len}")
        self.req_to_token = torch.full((max_requests, max_len), -1, dtype=torch.int64, device=device)
        self.max_len = max_len
        self._free = list(range(max_requests - 1, -1, -1))
        self._written = [-1] * max_requests  # -1 = not live

    @property
    def max_requests(self) -> int:
        return self.req_to_token.shape[0]

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A free request slot (now live, 0 positions written)."""
        if not self._free:
            raise SlotError(f"all {self.max_requests} request slots are in use; wait for requests to finish or raise max_requests")
        idx = self._free.pop()
        self._written[idx] = 0
        return idx

    def free(self, idx: int) -> None:
        """Release request slot ``idx`` (its table row is cleared)."""
        self.check_live(idx)
        self._written[idx] = -1
        self.req_to_token[idx].fill_(-1)
        self._free.append(idx)

    def is_live(self, idx: int) -> bool:
        return 0 <= idx < self.max_requests and self._written[idx] >= 0

    def check_live(self, idx: int) -> None:
        """Raise :class:`SlotError` unless ``idx`` is a live request slot."""
        if not self.is_live(idx):
            raise SlotError(f"request slot {idx} is not live (never allocated or already freed); its data may belong to another request")

    def assign(self, idx: int, start: int, kv_slots: torch.Tensor) -> None:
        """Map positions ``start .. start+len(kv_slots)-1`` of request ``idx`` to ``kv_slots``."""
        self.check_live(idx)
        end = start + kv_slots.numel()
        if end > self.max_len:
            raise SlotError(f"request slot {idx} would hold {end} tokens, more than max_len={self.max_len}")
        self.req_to_token[idx, start:end] = kv_slots

    def written(self, idx: int) -> int:
        """Leading positions of request ``idx`` that a forward pass has written."""
        self.check_live(idx)
        return self._written[idx]

    def mark_written(self, idx: int, length: int) -> None:
        """Record that positions ``0 .. length-1`` of request ``idx`` went through a forward."""
        self.check_live(idx)
        self._written[idx] = max(self._written[idx], length)
