"""Time-ordered routes whose load drifts: a changing mix of the real OLMoE domains.

This is **synthetic drift of real counts**. The per-domain expert skew is the
real OLMoE-1B-7B routing (:func:`moetrace.reference.olmoe_bias`, fitted to the
packaged counts of 6 text domains); what is synthetic is the *schedule*: which
domains the traffic comes from, pass after pass. Each pass serves a few
requests; each request belongs to one domain drawn from the current mix, and
the mix wanders (a mean-reverting random walk of the domains' log weights).
Every token is routed by the reference :class:`~moetrace.reference.TopKRouter`
with its request's domain bias, so the ids are real top-k selections of random
hidden states, and consecutive passes share load the way a serving system's do.

Used by the placement backtest (tests, ``benchmarks/placement_backtest.py``)
and the demo. Routes are ``[T, L, k]`` int64 per pass, like the recorder's hooks see.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..data import olmoe_counts
from .gate import TopKRouter, olmoe_bias
from .init import derive_seed

__all__ = ["DriftSpec", "domain_mix", "drift_routes", "mixed_routes", "olmoe_domains"]


@dataclasses.dataclass(frozen=True)
class DriftSpec:
    """How the domain mix moves and how passes are filled.

    Attributes:
        num_passes: passes to generate.
        tokens_per_pass: tokens in each pass (split evenly over its requests).
        requests_per_pass: requests per pass; each has one domain.
        num_experts: experts ``E``; must divide 64 (OLMoE experts are pooled).
        top_k: experts per token.
        volatility: step size of the domains' log weights per pass.
        reversion: pull of the log weights back to 0 per pass (0 = free walk).
        hidden_size: width of the random hidden states fed to the routers.
        seed: everything is derived from it.
    """

    num_passes: int = 600
    tokens_per_pass: int = 64
    requests_per_pass: int = 4
    num_experts: int = 64
    top_k: int = 8
    volatility: float = 0.15
    reversion: float = 0.01
    hidden_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_passes", "tokens_per_pass", "requests_per_pass", "num_experts", "top_k", "hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tokens_per_pass % self.requests_per_pass:
            raise ValueError(f"tokens_per_pass={self.tokens_per_pass} must be a multiple of requests_per_pass={self.requests_per_pass}")
        if self.volatility < 0 or not 0 <= self.reversion <= 1:
            raise ValueError("volatility must be >= 0 and reversion in [0, 1]")


def domain_mix(spec: DriftSpec, domains: list[str]) -> np.ndarray:
    """Mix weights ``[num_passes, D]`` (rows sum to 1): softmax of a mean-reverting random walk."""
    rng = np.random.default_rng(derive_seed(spec.seed, 1))
    logits = np.zeros((spec.num_passes, len(domains)))
    state = rng.normal(0.0, 1.0, len(domains))
    for p in range(spec.num_passes):
        state = (1 - spec.reversion) * state + rng.normal(0.0, spec.volatility, len(domains))
        logits[p] = state
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def olmoe_domains() -> list[str]:
    """The real OLMoE text domains of the packaged counts, in their packaged order."""
    return list(olmoe_counts()["expert_counts"])


def drift_routes(spec: DriftSpec) -> tuple[list[np.ndarray], np.ndarray, list[str]]:
    """Routes of ``spec.num_passes`` passes over the 3 recorded OLMoE layers, the mix drifting (:func:`domain_mix`).

    Returns:
        ``(passes, domain_of_request, domains)``: ``passes[p]`` is ``[T, 3, k]``
        int64 expert ids; ``domain_of_request [num_passes, requests_per_pass]``
        indexes ``domains``.
    """
    domains = olmoe_domains()
    passes, request_domain = mixed_routes(spec, domain_mix(spec, domains))
    return passes, request_domain, domains


def mixed_routes(spec: DriftSpec, mix: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Routes of ``spec.num_passes`` passes whose requests draw their domain from ``mix [num_passes, D]``.

    ``D`` is the number of real OLMoE domains (:func:`olmoe_domains`, in that
    order); each row of ``mix`` is a probability vector. ``spec``'s volatility
    and reversion are not used (the mix is given).

    Returns:
        ``(passes, domain_of_request)``: ``passes[p]`` is ``[T, 3, k]`` int64
        expert ids; ``domain_of_request [num_passes, requests_per_pass]``.

    Raises:
        ValueError: ``mix`` of another shape, or rows that are not probabilities.
    """
    domains = olmoe_domains()
    mix = np.asarray(mix, dtype=np.float64)
    if mix.shape != (spec.num_passes, len(domains)):
        raise ValueError(f"mix must be [num_passes, domains] = [{spec.num_passes}, {len(domains)}], got {list(mix.shape)}")
    if (mix < 0).any() or not np.allclose(mix.sum(axis=1), 1.0):
        raise ValueError("every row of mix must be a probability vector (non-negative, summing to 1)")
    data = olmoe_counts()
    num_layers = len(data["layers"])
    rng = np.random.default_rng(derive_seed(spec.seed, 2))
    request_domain = np.stack([rng.choice(len(domains), size=spec.requests_per_pass, p=m / m.sum()) for m in mix])
    # One router per layer (seeded weights W) with each domain's real bias b_d; a token of
    # domain d gets TopKRouter's selection top-k(softmax(x W^T + b_d)), all tokens at once.
    routers = [TopKRouter(spec.hidden_size, spec.num_experts, spec.top_k, seed=derive_seed(spec.seed, 3, layer)) for layer in range(num_layers)]
    biases = [torch.stack([olmoe_bias(spec.num_experts, layer, d) for d in domains]) for layer in range(num_layers)]  # [D, E]
    generator = torch.Generator().manual_seed(derive_seed(spec.seed, 4))
    tokens = spec.num_passes * spec.tokens_per_pass
    token_domain = torch.from_numpy(np.repeat(request_domain.reshape(-1), spec.tokens_per_pass // spec.requests_per_pass))
    x = torch.randn(tokens, spec.hidden_size, generator=generator)
    ids = torch.empty(tokens, num_layers, spec.top_k, dtype=torch.int64)
    with torch.no_grad():
        for layer, router in enumerate(routers):
            logits = x @ router.weight.t() + biases[layer][token_domain]
            ids[:, layer] = torch.topk(torch.softmax(logits, dim=-1), spec.top_k, dim=-1).indices
            # Hidden states move on between layers (a fresh residual update).
            x = x + 0.5 * torch.randn(x.shape, generator=generator)
    passes = list(ids.numpy().reshape(spec.num_passes, spec.tokens_per_pass, num_layers, spec.top_k))
    return passes, request_domain
