"""The serving loop's prefix cache really skips the prefill of cached blocks, frees what it evicts, and changes no output."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace import ExpertDistributionRecorder
from moetrace.reference import ModelConfig, ReferenceMoEModel, Request, ServingLoop
from moetrace.trace.token_routes import request_routes


@pytest.fixture(scope="module")
def model():
    return ReferenceMoEModel(ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_experts=4, top_k=2, seed=3))


def _run(model, cache_blocks, waves):
    loop = ServingLoop(model, capture=False, max_running=4, max_tokens_per_pass=64, num_kv_slots=512, max_len=128,
                       prefix_cache_blocks=cache_blocks, block_size=8)
    outputs, computed, cached = {}, 0, {}
    for wave in waves:
        loop.submit(wave)
        while (progress := loop.step()) is not None:
            computed += progress.batch_tokens
            for res in progress.new_results:
                outputs[res.rid] = res.output_ids
                cached[res.rid] = res.cached_tokens
    return loop, outputs, computed, cached


def _waves():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 128, 40).tolist()
    first = [Request(f"a{i}", system + rng.integers(0, 128, 5 + i).tolist(), 4) for i in range(4)]
    second = [Request(f"b{i}", system + rng.integers(0, 128, 3).tolist(), 4) for i in range(4)]
    return [first, second]


def test_cached_blocks_skip_prefill_and_outputs_are_unchanged(model):
    _, plain, plain_tokens, _ = _run(model, None, _waves())
    loop, cached_out, cached_tokens, cached = _run(model, 64, _waves())
    assert cached_out == plain
    assert all(cached[f"a{i}"] == 0 for i in range(4))  # nothing cached before the first wave finished
    assert all(cached[f"b{i}"] == 40 for i in range(4))  # the 40-token system prompt = 5 blocks of 8
    assert cached_tokens == plain_tokens - sum(cached.values())  # exactly the cached positions were not computed
    stored = [h for kind, hashes in loop.take_kv_events() if kind == "stored" for h in hashes]
    assert len(stored) == len(loop.prefix_cache) and len(set(stored)) == len(stored)
    assert loop.allocator.available == loop.allocator.num_slots - 8 * len(loop.prefix_cache)


def test_small_cache_evicts_and_frees_slots(model):
    _, plain, _, _ = _run(model, None, _waves())
    loop, out, _, _ = _run(model, 3, _waves())
    assert out == plain
    assert len(loop.prefix_cache) <= 3 and loop.prefix_cache.evictions > 0
    assert any(kind == "evicted" for kind, _ in loop.take_kv_events())
    assert loop.allocator.available == loop.allocator.num_slots - 8 * len(loop.prefix_cache)


def test_routed_experts_refused_with_prefix_cache(model):
    loop = ServingLoop(model, max_running=2, max_tokens_per_pass=32, num_kv_slots=64, max_len=64, prefix_cache_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="prefix_cache_blocks=None"):
        loop.submit([Request("x", [1, 2, 3], 2, return_routed_experts=True)])


def test_per_token_rows_skip_cached_positions(model, tmp_path):
    """Issue 35: with prefix-cache hits the per_token trace holds rows only for the positions computed;
    the routes it gives are -1 at the cached positions and equal the run without a cache elsewhere."""
    runs = {}
    for blocks in (None, 64):
        recorder = ExpertDistributionRecorder(model.recorder_config(mode="per_token", output_dir=tmp_path / str(blocks)))
        recorder.start_record()
        loop = ServingLoop(model, capture=False, recorder=recorder, max_running=4, max_tokens_per_pass=64, num_kv_slots=512,
                           max_len=128, prefix_cache_blocks=blocks, block_size=8)
        for wave in _waves():
            loop.run(wave)
        recorder.stop_record()
        runs[blocks] = request_routes(recorder.dump_record())
    plain, cached = runs[None], runs[64]
    assert sorted(plain) == sorted(cached) == sorted(f"{w}{i}" for w in "ab" for i in range(4))
    for rid, routes in plain.items():
        hit = 40 if rid.startswith("b") else 0  # the 40-token system prompt the b wave finds cached
        assert (routes >= 0).all() and cached[rid].shape == routes.shape, rid
        assert (cached[rid][:hit] == -1).all(), rid
        np.testing.assert_array_equal(cached[rid][hit:], routes[hit:], err_msg=rid)
