"""An independent divergence computation (Python sets per token and layer), and random route builders."""

from __future__ import annotations

from typing import Any

import numpy as np


def random_routes(rng: np.random.Generator, tokens: int, layers: int, experts: int, top_k: int) -> np.ndarray:
    """``[T, L, k]`` distinct ids per row, drawn with a skew so that two draws often overlap."""
    p = np.arange(1, experts + 1, dtype=np.float64) ** -1.2
    p /= p.sum()
    out = np.empty((tokens, layers, top_k), dtype=np.int64)
    for t in range(tokens):
        for layer in range(layers):
            out[t, layer] = rng.choice(experts, size=top_k, replace=False, p=p)
    return out


def perturb(rng: np.random.Generator, routes: np.ndarray, experts: int, share: float) -> np.ndarray:
    """A copy where about ``share`` of the rows are redrawn, some only reordered."""
    out = routes.copy()
    tokens, layers, top_k = routes.shape
    for t in range(tokens):
        for layer in range(layers):
            u = rng.random()
            if u < share / 2:
                out[t, layer] = rng.choice(experts, size=top_k, replace=False)
            elif u < share:
                out[t, layer] = rng.permutation(out[t, layer])
    return out


def oracle(a: np.ndarray, b: np.ndarray, experts: int) -> dict[str, Any]:
    """Divergence figures by plain loops over sets (rows with a -1 on either side are not compared)."""
    tokens, layers, _ = a.shape
    compared = np.zeros(layers)
    same_set = np.zeros(layers)
    same_order = np.zeros(layers)
    jaccard = np.zeros(layers)
    dropped = np.zeros((layers, experts), dtype=np.int64)
    added = np.zeros((layers, experts), dtype=np.int64)
    histogram = np.zeros(layers + 1, dtype=np.int64)
    pairs = agree = 0
    for t in range(tokens):
        differing, any_compared = 0, False
        for layer in range(layers):
            ra, rb = list(a[t, layer]), list(b[t, layer])
            if min(ra) < 0 or min(rb) < 0:
                continue
            any_compared = True
            sa, sb = set(ra), set(rb)
            compared[layer] += 1
            pairs += 1
            same_set[layer] += sa == sb
            agree += sa == sb
            same_order[layer] += ra == rb
            jaccard[layer] += len(sa & sb) / len(sa | sb)
            for e in sa - sb:
                dropped[layer, e] += 1
            for e in sb - sa:
                added[layer, e] += 1
            differing += sa != sb
        if any_compared:
            histogram[differing] += 1
    with np.errstate(invalid="ignore"):
        return {
            "layer_tokens": compared, "set_agreement": same_set / compared, "order_agreement": same_order / compared,
            "jaccard": jaccard / compared, "dropped": dropped, "added": added, "differing_layers": histogram,
            "router_agreement": agree / pairs, "tokens_any_differ": histogram[1:].sum() / histogram.sum(),
        }


def assert_matches_oracle(result: Any, expected: dict[str, Any]) -> None:
    np.testing.assert_array_equal(result.layer_tokens, expected["layer_tokens"])
    for name in ("set_agreement", "order_agreement", "jaccard"):
        np.testing.assert_allclose(getattr(result, name), expected[name], rtol=1e-12, equal_nan=True)
    experts = expected["dropped"].shape[1]
    np.testing.assert_array_equal(result.dropped[:, :experts], expected["dropped"])
    np.testing.assert_array_equal(result.added[:, :experts], expected["added"])
    assert result.dropped[:, experts:].sum() == 0 and result.added[:, experts:].sum() == 0
    np.testing.assert_array_equal(result.differing_layers, expected["differing_layers"])
    assert result.router_agreement == expected["router_agreement"]
    assert result.tokens_any_differ == expected["tokens_any_differ"]
