"""Replay on the reference runtime: own routes, chunked-prefill routes from the serving loop, forced routes, EP on gloo."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, NoOpRecorder
from moetrace.analysis.divergence import route_divergence
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.reference import (
    EPSpec,
    ModelConfig,
    ReferenceMoEModel,
    Request,
    ServingLoop,
    launch,
    replay,
    zipf_bias,
)
from moetrace.replay import LayerRoutes, ReplayError, TopKReplay
from moetrace.testing import assert_no_host_sync

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_experts=8, top_k=2,
                     dense_layers=(1,), router_bias=tuple(zipf_bias(8, 0.5, seed=2).tolist()), seed=7)
MOE = [0, 2, 3]


def forward_routes(model: ReferenceMoEModel, ids: torch.Tensor, recorder: object = None) -> tuple[torch.Tensor, np.ndarray]:
    """Logits and captured routes ``[B, S, model layers, k]`` of one teacher-forced forward."""
    batch, length = ids.shape
    capturer = RoutedExpertsCapturer(CONFIG.num_layers, CONFIG.top_k, batch * length, batch * length)
    with torch.no_grad():
        logits = model(ids, recorder=recorder or NoOpRecorder(), capturer=capturer)
    capturer.on_forward_end(torch.arange(batch * length))
    table = torch.arange(batch * length).view(batch, length)
    return logits, np.stack([capturer.get_routed_experts(table, row, length) for row in range(batch)]).astype(np.int64)


@pytest.fixture(scope="module")
def model() -> ReferenceMoEModel:
    return ReferenceMoEModel(CONFIG)


def test_own_routes_reproduce_logits_and_routes(model: ReferenceMoEModel) -> None:
    ids = torch.randint(0, CONFIG.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    logits, routes = forward_routes(model, ids)
    assert (routes[..., 1, :] == -1).all() and (routes[..., MOE, :] >= 0).all()
    with replay(model, routes):
        replayed_logits, replayed = forward_routes(model, ids)
    assert (replayed_logits - logits).abs().max().item() <= 1e-6
    np.testing.assert_array_equal(replayed, routes)


def test_chunked_prefill_routes_replay_exactly(model: ReferenceMoEModel) -> None:
    """Routes a serving loop returns after chunked prefill (4-token chunks, batched with other requests) and decode."""
    rng = np.random.default_rng(1)
    requests = [Request(f"r{i}", rng.integers(0, CONFIG.vocab_size, int(n)).tolist(), 5, arrival_step=i, return_routed_experts=True)
                for i, n in enumerate([13, 9, 17])]
    results = ServingLoop(model, max_running=3, max_tokens_per_pass=12, chunk_size=4, num_kv_slots=128, max_len=32).run(requests)
    for req, result in zip(requests, sorted(results, key=lambda r: r.rid), strict=True):
        tokens = torch.tensor([req.prompt + result.output_ids[:-1]])  # positions with routes: the last token has none
        served = result.routed_experts[None].astype(np.int64)
        assert served.shape[1] == tokens.shape[1]
        _, own = forward_routes(model, tokens)  # one teacher-forced forward: may break near-ties differently
        with replay(model, served):
            logits, replayed = forward_routes(model, tokens)
        np.testing.assert_array_equal(replayed, served)
        assert route_divergence(replayed[..., MOE, :], served[..., MOE, :]).router_agreement == 1.0
        assert route_divergence(own[..., MOE, :], served[..., MOE, :]).router_agreement >= 0.9
        # Greedy continuation: the replayed forward predicts the tokens the loop generated.
        predicted = logits[0, len(req.prompt) - 1 :].argmax(-1).tolist()
        assert predicted == result.output_ids[: len(predicted)]


def test_forced_routes_are_what_the_recorder_counts(model: ReferenceMoEModel, tmp_path: Path) -> None:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    rng = np.random.default_rng(4)
    forced = np.stack([rng.permutation(8)[:2] for _ in range(2 * 9 * 3)]).reshape(2, 9, 3, 2)
    forced[1, 7:] = -1  # right padding: those positions keep their own top-k
    recorder = ExpertDistributionRecorder(model.recorder_config(output_dir=tmp_path))
    recorder.start_record()
    with replay(model, forced) as handle:
        _, replayed = forward_routes(model, ids, recorder)
    recorder.stop_record()
    assert not handle.active
    np.testing.assert_array_equal(replayed[0][:, MOE], forced[0])
    np.testing.assert_array_equal(replayed[1, :7][:, MOE], forced[1, :7])
    assert (replayed[1, 7:][:, MOE] >= 0).all()
    expected = np.stack([np.bincount(replayed[..., layer, :].ravel(), minlength=8) for layer in MOE])
    np.testing.assert_array_equal(recorder.snapshot().physical_count, expected)
    recorder.reset()


def test_replay_does_not_sync_host_and_device() -> None:
    scores = torch.randn(6, 8).softmax(-1)
    ids = np.array([[0, 1], [2, 3], [-1, -1], [4, 5], [6, 7], [1, 0]])
    with assert_no_host_sync(), TopKReplay(LayerRoutes(ids, torch.device("cpu")), 8, 2) as mode:
        values, got = torch.topk(scores, 2, dim=-1)
    assert mode.hits == 1
    assert got.tolist()[2] == torch.topk(scores[2], 2).indices.tolist()
    assert got[[0, 1, 3, 4, 5]].tolist() == ids[[0, 1, 3, 4, 5]].tolist()
    torch.testing.assert_close(values, scores.gather(1, got))


def test_serving_forward_and_non_model_input_are_refused(model: ReferenceMoEModel) -> None:
    with replay(model, np.tile([0, 1], (1, 4, 3, 1))):
        with pytest.raises(ReplayError, match="before any forward"):
            model.moe_layers[0](torch.zeros(4, 32), recorder=NoOpRecorder())
        with pytest.raises(ReplayError, match="forward_batch is not replayed"):
            ServingLoop(model, max_running=1, max_tokens_per_pass=8, chunk_size=8, num_kv_slots=16, max_len=16).run(
                [Request("x", [1, 2, 3], 1, 0)])
    assert "forward_batch" not in model.__dict__
    with pytest.raises(TypeError, match="ReferenceMoEModel"):
        replay(torch.nn.Linear(2, 2), np.zeros((1, 1, 1), dtype=np.int64))  # type: ignore[arg-type]


def _ep_worker(rank: int, world: int) -> dict:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 7 + rank), generator=torch.Generator().manual_seed(10 + rank))
    dense = ReferenceMoEModel(CONFIG)
    rng = np.random.default_rng(rank)
    forced = np.stack([rng.permutation(8)[:2] for _ in range(ids.numel() * 3)]).reshape(*ids.shape, 3, 2)
    with replay(dense, forced):
        dense_logits, _ = forward_routes(dense, ids)
    out = {}
    for mode in ("exact", "padded"):
        ep = ReferenceMoEModel(CONFIG, ep=EPSpec(world, rank, mode, max_tokens=32))
        with replay(ep, forced):
            logits, routes = forward_routes(ep, ids)
        out[mode] = {"diff": (logits - dense_logits).abs().max().item(), "routes_equal": bool((routes[..., MOE, :] == forced).all())}
    return out


@pytest.mark.slow
def test_expert_parallel_replay_equals_dense_replay() -> None:
    for rank, result in enumerate(launch(_ep_worker, 2, backend="gloo", threads_per_rank=1)):
        for mode, figures in result.items():
            assert figures["routes_equal"], f"rank {rank} {mode}"
            assert figures["diff"] <= 1e-5, f"rank {rank} {mode}"
