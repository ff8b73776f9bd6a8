"""A block-level prefix cache with a capacity and LRU eviction.

A prompt is cut into fixed-size blocks; each block is named by a hash that
covers the whole prefix up to and including it (vLLM's and Mooncake's
chained block hashes), so two prompts share a cached prefix exactly as far as
their hash lists agree. A request can reuse the leading blocks that are present
(:meth:`PrefixCache.match`); after its prefill the blocks it computed are
:meth:`~PrefixCache.insert`-ed. When the cache holds ``capacity`` blocks, the
least recently used block that no running request pins is evicted; matched
blocks are touched leaf first so that a prefix's root is evicted last.

The same class serves the router's view of a replica and the replica itself:
the serving loop stores KV slots as each block's ``payload`` and frees them in
``on_evict``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = ["PrefixCache", "chain_hashes"]


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``tokens``.

    Block ``i``'s hash covers tokens ``0 .. (i+1)*block_size-1``; a trailing
    partial block gets none (it cannot be shared).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tuple(tokens[start : start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixCache:
    """LRU cache of prefix blocks, at most ``capacity`` of them.

    Args:
        capacity: blocks the cache may hold (``None``: unlimited).
        on_evict: called with ``(block_hash, payload)`` for every evicted block.
    """

    def __init__(self, capacity: int | None, on_evict: Callable[[Hashable, Any], None] | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"prefix cache capacity must be a positive number of blocks or None, got {capacity}")
        self.capacity = capacity
        self._on_evict = on_evict
        self._blocks: OrderedDict[Hashable, list[Any]] = OrderedDict()  # hash -> [payload, pins]; last = most recent
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: Hashable) -> bool:
        return block in self._blocks

    def match(self, hashes: Sequence[Hashable]) -> int:
        """Leading blocks of ``hashes`` that are cached (no side effects)."""
        n = 0
        blocks = self._blocks
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def payloads(self, hashes: Sequence[Hashable]) -> list[Any]:
        """Payloads of ``hashes`` (all must be cached)."""
        return [self._blocks[h][0] for h in hashes]

    def touch(self, hashes: Sequence[Hashable]) -> None:
        """Mark ``hashes`` (cached) as just used; the first block ends most recent."""
        move = self._blocks.move_to_end
        for h in reversed(hashes):
            move(h)

    def pin(self, hashes: Sequence[Hashable], delta: int = 1) -> None:
        """Add ``delta`` to the pin count of each of ``hashes``; pinned blocks are never evicted."""
        for h in hashes:
            entry = self._blocks[h]
            entry[1] += delta
            if entry[1] < 0:
                raise ValueError(f"prefix block {h!r} unpinned more often than pinned")

    def insert(self, hashes: Sequence[Hashable], payloads: Sequence[Any] | None = None) -> list[int]:
        """Add the blocks of ``hashes`` not yet cached, evicting LRU blocks to make room.

        Returns the indices (into ``hashes``) of the blocks actually inserted;
        a block that finds no room (everything else pinned) is skipped, and so
        are the blocks after it (a prefix cache holds prefixes).
        """
        inserted: list[int] = []
        blocks, cap = self._blocks, self.capacity
        for i, h in enumerate(hashes):
            if h in blocks:
                continue
            if cap is not None and len(blocks) >= cap and not self._evict_one():
                break
            blocks[h] = [None if payloads is None else payloads[i], 0]
            inserted.append(i)
        move = blocks.move_to_end
        for h in reversed(hashes):
            if h in blocks:
                move(h)
        return inserted

    def remove(self, hashes: Sequence[Hashable]) -> None:
        """Drop ``hashes`` (those present) without calling ``on_evict`` (a mirror applying eviction events)."""
        for h in hashes:
            self._blocks.pop(h, None)

    def evict(self, blocks: int) -> int:
        """Evict up to ``blocks`` unpinned LRU blocks; returns how many went."""
        done = 0
        while done < blocks and self._evict_one():
            done += 1
        return done

    def _evict_one(self) -> bool:
        for h, (payload, pins) in self._blocks.items():
            if pins == 0:
                del self._blocks[h]
                self.evictions += 1
                if self._on_evict is not None:
                    self._on_evict(h, payload)
                return True
        return False
