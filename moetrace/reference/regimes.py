"""Labelled load regimes: time-ordered routes whose domain mix follows a named schedule.

Every regime routes tokens through the real OLMoE-1B-7B domain skews
(:func:`moetrace.reference.domain_drift.mixed_routes`: reference routers biased with
the packaged counts of 6 text domains); what differs, and is synthetic, is the
*schedule* of domains over passes. A placement planner chosen on one schedule
alone can lose on another (issue 25), so the backtest runs them all:

- ``stationary``: one fixed mix of the 6 domains; sampling noise only (which
  request gets which domain, which token goes where);
- ``slow-drift``: the mix drifts slowly (mean-reverting walk of log weights,
  volatility 0.03 per pass);
- ``drift``: the mix drifts faster (volatility 0.15, :class:`DriftSpec`'s default);
- ``switches``: all traffic from one domain at a time, switching abruptly to
  another after a random dwell (geometric, mean 120 passes, at least 20);
- ``bursts``: the stationary background with bursts of 20-40 passes in which
  80% of requests come from one domain (one burst every ~150 passes);
- ``domain-order``: the 6 real domains one after another, each for a sixth of
  the passes (seed 0: the packaged order arxiv, book, c4, github, wikipedia,
  tulu; other seeds: a seeded permutation).
"""

from __future__ import annotations

import numpy as np

from .domain_drift import DriftSpec, domain_mix, mixed_routes, olmoe_domains
from .init import derive_seed

__all__ = ["REGIMES", "regime_mix", "regime_routes"]

#: Regime name -> what its schedule is (the label printed with every figure).
REGIMES: dict[str, str] = {
    "stationary": "fixed mix of the 6 real domains, sampling noise only",
    "slow-drift": "the mix drifts slowly (log-weight walk, volatility 0.03/pass)",
    "drift": "the mix drifts (log-weight walk, volatility 0.15/pass)",
    "switches": "one domain at a time, abrupt switches (dwell mean 120 passes)",
    "bursts": "fixed background mix with 20-40-pass bursts of one domain (80%)",
    "domain-order": "the 6 real domains in sequence, a sixth of the passes each",
}


def _background(rng: np.random.Generator, domains: int) -> np.ndarray:
    return rng.dirichlet(np.full(domains, 4.0))


def regime_mix(regime: str, num_passes: int, seed: int = 0) -> np.ndarray:
    """Domain mix ``[num_passes, D]`` (rows sum to 1) of a named regime (:data:`REGIMES`).

    Raises:
        ValueError: an unknown regime or a non-positive ``num_passes``.
    """
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; pass one of {', '.join(REGIMES)}")
    if isinstance(num_passes, bool) or not isinstance(num_passes, int) or num_passes <= 0:
        raise ValueError(f"num_passes must be a positive integer, got {num_passes!r}")
    domains = olmoe_domains()
    count = len(domains)
    rng = np.random.default_rng(derive_seed(seed, 11, list(REGIMES).index(regime)))
    if regime in ("slow-drift", "drift"):
        spec = DriftSpec(num_passes=num_passes, seed=seed, volatility=0.03 if regime == "slow-drift" else 0.15)
        return domain_mix(spec, domains)
    mix = np.tile(_background(rng, count), (num_passes, 1))
    if regime == "switches":
        start, current = 0, int(rng.integers(count))
        while start < num_passes:
            dwell = max(20, int(rng.geometric(1 / 120)))
            mix[start : start + dwell] = np.eye(count)[current]
            start += dwell
            current = int((current + rng.integers(1, count)) % count)
    elif regime == "bursts":
        start = int(rng.integers(50, 150))
        while start < num_passes:
            length = int(rng.integers(20, 41))
            mix[start : start + length] = 0.2 * mix[start] + 0.8 * np.eye(count)[int(rng.integers(count))]
            start += length + int(rng.integers(100, 200))
    elif regime == "domain-order":
        order = np.arange(count) if seed == 0 else rng.permutation(count)
        block = np.minimum(np.arange(num_passes) * count // num_passes, count - 1)
        mix = np.eye(count)[order[block]]
    return mix


def regime_routes(regime: str, spec: DriftSpec) -> tuple[list[np.ndarray], np.ndarray]:
    """Routes ``[T, 3, k]`` per pass of a named regime, sized and seeded by ``spec`` (its volatility is the regime's).

    Returns ``(passes, domain_of_request [num_passes, requests_per_pass])``
    (domains in :func:`~moetrace.reference.domain_drift.olmoe_domains` order).
    """
    mix = regime_mix(regime, spec.num_passes, spec.seed)
    return mixed_routes(spec, mix)
