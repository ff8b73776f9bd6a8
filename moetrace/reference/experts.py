"""SwiGLU experts, stored stacked so a rank can hold any contiguous shard of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .init import derive_seed, seeded_normal

__all__ = ["SwiGLUExperts"]

_GATE, _UP, _DOWN = 1, 2, 3


class SwiGLUExperts(torch.nn.Module):
    """Experts ``[first, first + count)`` of ``E``: ``down(silu(x W_gate) * (x W_up))``.

    Expert ``e``'s weights depend only on ``(seed, e)``, so a shard built on an
    EP rank equals the same experts of the full set.

    Parameters: ``w_gate [n, H, I]``, ``w_up [n, H, I]``, ``w_down [n, I, H]``
    with ``n = count``.

    ``init="seeded"`` (default) draws each expert from its own seeded generator on the host;
    ``init="fast"`` draws the stacks directly on ``device`` from the global generator, for
    benchmarks at sizes where host drawing takes minutes (DeepSeek-V3: 11 G parameters per
    layer). Fast weights are not reproducible per expert, so a shard does not equal the same
    experts of another build.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        count: int,
        first: int = 0,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        init: str = "seeded",
    ) -> None:
        super().__init__()
        if count <= 0 or first < 0:
            raise ValueError(f"need count > 0 and first >= 0, got count={count}, first={first}")
        if init not in ("seeded", "fast"):
            raise ValueError(f"init must be 'seeded' or 'fast', got {init!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.first, self.count = first, count
        h, i = hidden_size, intermediate_size

        def stack(role: int, shape: tuple[int, int], std: float) -> torch.nn.Parameter:
            if init == "fast":
                return torch.nn.Parameter(torch.randn((count, *shape), dtype=dtype, device=device).mul_(std))
            rows = [seeded_normal(shape, std, derive_seed(seed, role, first + e)) for e in range(count)]
            return torch.nn.Parameter(torch.stack(rows).to(dtype=dtype, device=device))

        self.w_gate = stack(_GATE, (h, i), h**-0.5)
        self.w_up = stack(_UP, (h, i), h**-0.5)
        self.w_down = stack(_DOWN, (i, h), i**-0.5)

    @property
    def dtype(self) -> torch.dtype:
        return self.w_gate.dtype

    @property
    def device(self) -> torch.device:
        return self.w_gate.device

    def parameter_bytes(self) -> int:
        """Bytes held by this shard's weights."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        """Run local expert ``local`` on ``x [m, H]`` -> ``[m, H]``."""
        return (F.silu(x @ self.w_gate[local]) * (x @ self.w_up[local])) @ self.w_down[local]

    def grouped(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rows of ``x [M, H]`` grouped by local expert (``sizes[e]`` rows each, host ints) -> ``[M, H]``."""
        out = torch.empty_like(x)
        start = 0
        for local, size in enumerate(sizes):
            if size:
                out[start : start + size] = self.expert(local, x[start : start + size])
            start += size
        return out

    def batched(self, x: torch.Tensor) -> torch.Tensor:
        """Fixed-shape compute on ``x [n, C, H]`` (row block ``e`` for local expert ``e``) -> ``[n, C, H]``."""
        return torch.bmm(F.silu(torch.bmm(x, self.w_gate)) * torch.bmm(x, self.w_up), self.w_down)
