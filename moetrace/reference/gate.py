"""Top-k softmax router with an optional per-expert logit bias (to reproduce skew).

A bias ``b[e]`` added to every token's logits shifts expert ``e``'s share of
the routing: :func:`zipf_bias` gives a Zipf-like skew, :func:`fitted_bias`
matches observed counts (e.g. the real OLMoE counts, shipped as package data, via
:func:`olmoe_bias`). A per-pass-phase bias (``phase_bias``) adds a second bias on
the passes of one pass phase only (:mod:`moetrace.pass_phase`), so that prefill
and decode route differently by construction (the set phase is host state).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..data import olmoe_counts
from ..pass_phase import PASS_PHASES
from .init import seeded_normal

__all__ = ["TopKRouter", "fitted_bias", "olmoe_bias", "zipf_bias"]


def zipf_bias(num_experts: int, s: float = 1.0, seed: int | None = None) -> torch.Tensor:
    """Logit bias ``[E]`` giving expert shares roughly ``∝ 1 / rank^s``.

    Expert ``e`` has rank ``e + 1`` unless ``seed`` is given, in which case the
    ranks are a seeded permutation (so the hot experts are not all on rank 0).
    """
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    rank = torch.arange(1, num_experts + 1, dtype=torch.float64)
    if seed is not None:
        rank = rank[torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))]
    bias = -s * torch.log(rank)
    return (bias - bias.mean()).float()


def fitted_bias(counts: np.ndarray | list[int] | torch.Tensor) -> torch.Tensor:
    """Logit bias ``[E]`` whose softmax prior matches ``counts [E]`` (log shares, centred).

    Zero counts are floored at half the smallest non-zero count so the bias stays finite.
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or (c < 0).any() or c.sum() == 0:
        raise ValueError("counts must be a non-empty 1-d array of non-negative numbers with a positive sum")
    floor = c[c > 0].min() / 2
    logp = np.log(np.maximum(c, floor) / c.sum())
    return torch.from_numpy(logp - logp.mean()).float()


def olmoe_bias(
    num_experts: int = 64,
    layer: int = 0,
    domain: str = "arxiv",
) -> torch.Tensor:
    """Bias ``[num_experts]`` fitted to the real OLMoE-1B-7B expert counts.

    Args:
        num_experts: experts of the model to bias; must divide 64 (groups of
            ``64 / num_experts`` OLMoE experts are pooled into one).
        layer: index into the recorded layers (0, 1, 2 = OLMoE layers 0, 7, 15).
        domain: one of the recorded domains (arxiv, book, c4, github, wikipedia, tulu).

    The counts ship with moetrace as package data (:func:`moetrace.data.olmoe_counts`).
    """
    data = olmoe_counts()
    if domain not in data["expert_counts"]:
        raise ValueError(f"unknown domain {domain!r}; choose one of {sorted(data['expert_counts'])}")
    layers = data["expert_counts"][domain]
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}) (OLMoE layers {data['layers']}), got {layer}")
    counts = np.asarray(layers[layer], dtype=np.int64)
    if num_experts <= 0 or counts.size % num_experts:
        raise ValueError(f"num_experts={num_experts} must divide the {counts.size} OLMoE experts")
    return fitted_bias(counts.reshape(num_experts, -1).sum(1))


class TopKRouter(torch.nn.Module):
    """Softmax top-k gate: ``logits = x W^T + bias``.

    Args:
        hidden_size: ``H``.
        num_experts: ``E``.
        top_k: ``k`` experts per token (``k <= E``).
        renormalize: rescale the k weights to sum to 1.
        bias: optional ``[E]`` per-expert logit bias (a buffer, not trained).
        phase_bias: optional ``{pass phase: [E] bias}`` added on the passes of that pass
            phase only (``pass_phase``, set by the model's ``set_pass_phase``).
        seed: weights are drawn from a generator seeded with it.
        dtype, device: parameter dtype and device.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        bias: torch.Tensor | None = None,
        phase_bias: Mapping[str, torch.Tensor] | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # Logit std ~1 for unit-variance inputs, so a bias of a few units shifts shares strongly.
        weight = seeded_normal((num_experts, hidden_size), hidden_size**-0.5, seed)
        self.weight = torch.nn.Parameter(weight.to(dtype=dtype, device=device))
        if bias is None:
            bias = torch.zeros(num_experts)
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have shape [num_experts={num_experts}], got {list(bias.shape)}")
        self.register_buffer("bias", bias.to(dtype=dtype, device=device))
        self.pass_phase = PASS_PHASES[0]
        self.phase_bias: dict[str, torch.Tensor] = {}
        for phase, extra in (phase_bias or {}).items():
            if phase not in PASS_PHASES or extra.shape != (num_experts,):
                raise ValueError(f"phase_bias[{phase!r}] must name one of {PASS_PHASES} and have shape [num_experts={num_experts}], got {list(extra.shape)}")
            self.phase_bias[phase] = extra.to(dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(topk_ids [T, k] int64, topk_weights [T, k])``."""
        logits = x @ self.weight.t() + self.bias
        extra = self.phase_bias.get(self.pass_phase)  # host lookup: no device read
        if extra is not None:
            logits = logits + extra
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype)
