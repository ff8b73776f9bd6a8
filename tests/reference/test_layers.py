"""EPMoELayer on one rank (no process group) against the dense oracle; memory; no host sync; errors."""

from __future__ import annotations

import pytest
import torch

from moetrace.dispatch import expert_capacity
from moetrace.reference import EPMoELayer, MoELayer, SwiGLUExperts, TopKRouter
from moetrace.testing import HostSyncError, assert_no_host_sync

H, FFN, E, K = 32, 48, 8, 2


def _layers(mode: str, factor: float | None, max_tokens: int = 40) -> tuple[MoELayer, EPMoELayer]:
    router = TopKRouter(H, E, K, seed=1)
    dense = MoELayer(router, SwiGLUExperts(H, FFN, E, seed=2), capacity_factor=factor)
    ep = EPMoELayer(router, SwiGLUExperts(H, FFN, E, seed=2), ep_size=1, ep_rank=0, mode=mode,
                    max_tokens=max_tokens, capacity_factor=factor)
    return dense, ep


@pytest.mark.parametrize("mode", ["exact", "padded"])
@pytest.mark.parametrize("factor", [None, 0.5])
def test_single_rank_ep_equals_oracle(mode, factor):
    dense, ep = _layers(mode, factor)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        diff = (ep(x) - dense(x)).abs().max().item()
    assert diff <= 1e-5
    dropped = int(ep.last_layout.dropped)
    if factor is None:
        assert dropped == 0
    else:
        assert dropped > 0 and int(ep.last_layout.kept_counts.max()) <= expert_capacity(37, K, E, factor)


def test_padded_forward_has_no_host_sync_and_exact_mode_says_it_syncs():
    _, padded = _layers("padded", 0.75)
    _, exact = _layers("exact", None)
    x = torch.randn(20, H)
    with torch.inference_mode(), assert_no_host_sync():
        padded(x)
    with torch.inference_mode(), pytest.raises(HostSyncError), assert_no_host_sync():
        exact(x)


def test_empty_batch():
    _, ep = _layers("padded", None)
    out = ep(torch.zeros(0, H))
    assert out.shape == (0, H)


def test_shards_hold_their_share_of_expert_memory():
    full = SwiGLUExperts(H, FFN, E, seed=2)
    shards = [SwiGLUExperts(H, FFN, E // 4, r * (E // 4), seed=2) for r in range(4)]
    assert sum(s.parameter_bytes() for s in shards) == full.parameter_bytes()
    assert shards[2].parameter_bytes() * 4 == full.parameter_bytes()
    assert torch.equal(shards[2].w_down, full.w_down[4:6])  # same weights as the dense set


def test_construction_errors():
    router = TopKRouter(H, E, K, seed=1)
    with pytest.raises(ValueError, match="ep_size=3 does not divide num_experts=8"):
        EPMoELayer(router, SwiGLUExperts(H, FFN, 2, seed=2), ep_size=3, ep_rank=0)
    with pytest.raises(ValueError, match="must hold experts"):
        EPMoELayer(router, SwiGLUExperts(H, FFN, 4, seed=2), ep_size=2, ep_rank=1)
    with pytest.raises(ValueError, match=r"needs an initialised torch\.distributed"):
        EPMoELayer(router, SwiGLUExperts(H, FFN, 4, seed=2), ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="padded mode needs max_tokens"):
        EPMoELayer(router, SwiGLUExperts(H, FFN, E, seed=2), ep_size=1, ep_rank=0, mode="padded")
    with pytest.raises(ValueError, match="mode must be one of"):
        EPMoELayer(router, SwiGLUExperts(H, FFN, E, seed=2), ep_size=1, ep_rank=0, mode="ragged")
    with pytest.raises(ValueError, match=r"router dtype torch\.float64 != experts dtype torch\.float32"):
        MoELayer(TopKRouter(H, E, K, dtype=torch.float64), SwiGLUExperts(H, FFN, E))
    with pytest.raises(ValueError, match="router is on cpu but experts are on meta"):
        MoELayer(router, SwiGLUExperts(H, FFN, E, device="meta"))
    with pytest.raises(ValueError, match="needs all 8 experts"):
        MoELayer(router, SwiGLUExperts(H, FFN, 4))
    with pytest.raises(ValueError, match="top_k=9"):
        TopKRouter(H, E, 9)
    dense, padded = _layers("padded", None, max_tokens=8)
    with pytest.raises(ValueError, match=r"expects torch\.float32"):
        dense(torch.zeros(3, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="exceeds max_tokens=8"):
        padded(torch.zeros(9, H))
