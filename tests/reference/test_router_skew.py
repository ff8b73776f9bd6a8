"""Router bias reproduces the intended skew (Zipf, real OLMoE counts) roughly; bad input errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace.data import olmoe_counts
from moetrace.reference import TopKRouter, fitted_bias, olmoe_bias, zipf_bias


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _realised(bias: torch.Tensor, top_k: int, tokens: int = 4096) -> np.ndarray:
    experts = bias.numel()
    router = TopKRouter(64, experts, top_k, bias=bias, seed=3)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0))
    ids, _ = router(x)
    return np.bincount(ids.reshape(-1).numpy(), minlength=experts)


def test_zipf_bias_skews_load_in_rank_order():
    bias = zipf_bias(16, s=1.2)
    counts = _realised(bias, top_k=2)
    assert _spearman(counts, bias.numpy()) > 0.9
    assert counts[0] > 3 * counts.mean() / 2 and counts[-1] < counts.mean() / 2
    assert counts[:4].sum() > counts.sum() / 2  # a few hot experts carry most of the load
    unbiased = _realised(torch.zeros(16), top_k=2)
    assert unbiased.max() / unbiased.mean() < counts.max() / counts.mean()


def test_zipf_bias_seeded_permutation():
    a, b = zipf_bias(8, 1.0, seed=1), zipf_bias(8, 1.0)
    assert sorted(a.tolist()) == pytest.approx(sorted(b.tolist()))
    assert a.tolist() != b.tolist()


def test_olmoe_fitted_bias_follows_real_counts():
    bias = olmoe_bias(64, layer=1, domain="github")
    real = np.asarray(olmoe_counts()["expert_counts"]["github"][1])
    counts = _realised(bias, top_k=8, tokens=8192)
    assert _spearman(counts, real) > 0.8
    hot = np.argsort(real)[-8:]
    assert counts[hot].sum() > 2 * counts.sum() * 8 / 64  # the real hot experts stay hot
    pooled = olmoe_bias(8, layer=1, domain="github")
    assert _spearman(pooled.numpy(), real.reshape(8, 8).sum(1)) == pytest.approx(1.0)


def test_bias_errors():
    with pytest.raises(ValueError, match="must divide the 64"):
        olmoe_bias(6)
    with pytest.raises(ValueError, match="unknown domain"):
        olmoe_bias(8, domain="poetry")
    with pytest.raises(ValueError, match="non-negative"):
        fitted_bias([1, -2, 3])
    with pytest.raises(ValueError, match=r"top_k=9 must be in \[1, num_experts=8\]"):
        TopKRouter(16, 8, 9)
    with pytest.raises(ValueError, match="bias must have shape"):
        TopKRouter(16, 8, 2, bias=torch.zeros(7))
