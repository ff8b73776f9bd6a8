"""Deterministic parameter initialisation from integer seeds.

Every tensor is drawn from its own generator, seeded from a tuple of integers
(model seed, layer, role, expert), so a rank that holds a shard of the experts
builds exactly the weights the dense model would hold, without materialising
the others.
"""

from __future__ import annotations

import torch

__all__ = ["derive_seed", "seeded_normal"]

_MASK = (1 << 63) - 1


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (a fixed polynomial hash, stable across runs)."""
    seed = 1469598103934665603
    for part in parts:
        seed = ((seed ^ (int(part) & _MASK)) * 1099511628211) & _MASK
    return seed


def seeded_normal(shape: tuple[int, ...], std: float, *seed_parts: int) -> torch.Tensor:
    """A float32 CPU tensor of ``N(0, std²)`` values drawn from ``derive_seed(*seed_parts)``."""
    generator = torch.Generator().manual_seed(derive_seed(*seed_parts))
    return torch.randn(shape, generator=generator) * std
