"""Old home of :mod:`moetrace.replicas.prefix_cache` (request→replica routing lives in ``moetrace.replicas``); the names stay importable from here."""

from ..replicas.prefix_cache import PrefixCache, chain_hashes

__all__ = ["PrefixCache", "chain_hashes"]
