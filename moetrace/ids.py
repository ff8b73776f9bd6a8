"""Physical and logical expert ids: the core vocabulary of the id spaces.

Engines with redundant experts (EPLB) route to *physical* slots; several slots can hold
replicas of one *logical* expert. ``physical_to_logical`` is the ``[L, P]`` map from slot to
expert (EPLB's ``phy2log``), with ``E = max + 1`` logical experts.
"""

from __future__ import annotations

import numpy as np

__all__ = ["to_logical"]


def to_logical(counts: np.ndarray, physical_to_logical: np.ndarray) -> np.ndarray:
    """Fold physical-expert counts ``[..., L, P]`` into logical-expert counts ``[..., L, E]``.

    ``physical_to_logical`` is ``[L, P]``; ``E = max + 1``.
    """
    counts = np.asarray(counts)
    mapping = np.asarray(physical_to_logical, dtype=np.int64)
    num_layers, num_physical = mapping.shape
    num_logical = int(mapping.max()) + 1
    flat = counts.reshape(-1, num_layers, num_physical)
    out = np.zeros((flat.shape[0], num_layers, num_logical), dtype=np.int64)
    for layer in range(num_layers):
        np.add.at(out[:, layer, :], (slice(None), mapping[layer]), flat[:, layer, :])
    return out.reshape(*counts.shape[:-1], num_logical)
