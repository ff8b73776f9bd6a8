"""RoutedExpertsCapturer on its own: slicing by KV slot, -1 for uncaptured layers, errors, no host sync, bounded memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace.capturer import RoutedExpertsCapturer
from moetrace.reference import KVSlotAllocator, ReqToTokenPool
from moetrace.testing import assert_no_host_sync
from moetrace.wire import CaptureError

L, K = 4, 2


def _ids(tokens: int, layer: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 8, (tokens, K), generator=torch.Generator().manual_seed(seed * 10 + layer))


def _pass(capturer: RoutedExpertsCapturer, locs: list[int], seed: int, layers=(0, 2, 3)) -> np.ndarray:
    expected = np.full((len(locs), L, K), -1)
    for layer in layers:
        ids = _ids(len(locs), layer, seed)
        capturer.capture(layer, ids)
        expected[:, layer] = ids.numpy()
    capturer.on_forward_end(torch.tensor(locs))
    return expected


def test_rows_land_at_kv_slots_and_slice_per_request():
    cap = RoutedExpertsCapturer(L, K, max_tokens_per_pass=8, num_kv_slots=32)
    pool = ReqToTokenPool(4, 16)
    a, b = pool.alloc(), pool.alloc()
    pool.assign(a, 0, torch.tensor([5, 9, 2]))
    pool.assign(b, 0, torch.tensor([30, 1]))
    first = _pass(cap, [5, 9, 2, 30, 1], seed=1)  # a's 3 tokens and b's 2 in one pass
    pool.mark_written(a, 3)
    pool.mark_written(b, 2)
    pool.assign(a, 3, torch.tensor([17]))
    second = _pass(cap, [17], seed=2)
    pool.mark_written(a, 4)
    got_a = cap.get_routed_experts(pool, a, 4)
    np.testing.assert_array_equal(got_a, np.concatenate([first[:3], second]))
    assert (got_a[:, 1] == -1).all()  # layer 1 never captured: -1, never 0
    np.testing.assert_array_equal(cap.get_routed_experts(pool, b, 2), first[3:])
    np.testing.assert_array_equal(cap.get_routed_experts(pool, a, 4, start=2), got_a[2:])
    assert cap.get_routed_experts(pool, a, 4, start=4).shape == (0, L, K)
    # a raw req_to_token tensor works too (bounds checks only)
    np.testing.assert_array_equal(cap.get_routed_experts(pool.req_to_token, a, 4), got_a)


def test_reused_slot_returns_the_new_owner_rows_only():
    cap = RoutedExpertsCapturer(L, K, max_tokens_per_pass=4, num_kv_slots=4, staging=1)
    pool = ReqToTokenPool(2, 4)
    old = pool.alloc()
    pool.assign(old, 0, torch.tensor([0, 1]))
    _pass(cap, [0, 1], seed=3)
    pool.mark_written(old, 2)
    pool.free(old)
    new = pool.alloc()
    pool.assign(new, 0, torch.tensor([1]))
    with pytest.raises(CaptureError, match="beyond the 0 positions written"):
        cap.get_routed_experts(pool, new, 1)  # slot 1 still holds the old request's row
    fresh = _pass(cap, [1], seed=4, layers=(1,))
    pool.mark_written(new, 1)
    np.testing.assert_array_equal(cap.get_routed_experts(pool, new, 1), fresh)


def test_lookup_errors():
    cap = RoutedExpertsCapturer(L, K, max_tokens_per_pass=4, num_kv_slots=8)
    pool = ReqToTokenPool(2, 6)
    idx = pool.alloc()
    pool.assign(idx, 0, torch.tensor([3, 4]))
    _pass(cap, [3, 4], seed=5)
    pool.mark_written(idx, 2)
    with pytest.raises(CaptureError, match="request slot 1 is not live"):
        cap.get_routed_experts(pool, 1, 1)
    with pytest.raises(CaptureError, match="seq_len=3 is beyond the 2 positions written"):
        cap.get_routed_experts(pool, idx, 3)
    with pytest.raises(CaptureError, match="start=3 is past the end"):
        cap.get_routed_experts(pool, idx, 2, start=3)
    with pytest.raises(CaptureError, match="outside"):
        cap.get_routed_experts(pool.req_to_token, idx, 3)  # position 2 has no KV slot
    with pytest.raises(CaptureError, match="req_pool_idx 5"):
        cap.get_routed_experts(pool, 5, 1)
    pool.free(idx)
    with pytest.raises(CaptureError, match="not live"):
        cap.get_routed_experts(pool, idx, 1)


def test_capture_errors():
    cap = RoutedExpertsCapturer(L, K, max_tokens_per_pass=4, num_kv_slots=8)
    with pytest.raises(CaptureError, match="layer_id 4"):
        cap.capture(4, _ids(2, 0, 0))
    with pytest.raises(CaptureError, match="top_k=2"):
        cap.capture(0, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(CaptureError, match="exceeds max_tokens_per_pass=4"):
        cap.capture(0, torch.zeros(5, K, dtype=torch.int64))
    cap.capture(0, _ids(3, 0, 0))
    with pytest.raises(CaptureError, match="captured 3 tokens but out_cache_loc has 2"):
        cap.on_forward_end([0, 1])
    with pytest.raises(CaptureError, match="outside"):
        cap.on_forward_end([0, 1, 8])
    with pytest.raises(ValueError, match="num_kv_slots must be a positive integer"):
        RoutedExpertsCapturer(L, K, 4, 0)


def test_capture_has_no_host_sync():
    cap = RoutedExpertsCapturer(L, K, max_tokens_per_pass=16, num_kv_slots=64)
    ids = _ids(16, 0, 0)
    with assert_no_host_sync():
        for layer in range(L):
            cap.capture(layer, ids)


def test_memory_is_bounded_by_construction():
    cap = RoutedExpertsCapturer(L, K, max_tokens_per_pass=8, num_kv_slots=16, staging=2)
    allocator, pool = KVSlotAllocator(16), ReqToTokenPool(2, 8)
    size = cap.nbytes()
    for step in range(300):  # many requests through few slots
        idx = pool.alloc()
        slots = allocator.alloc(5)
        pool.assign(idx, 0, torch.tensor(slots))
        expected = _pass(cap, slots, seed=step)
        pool.mark_written(idx, 5)
        assert cap.pending <= 2
        np.testing.assert_array_equal(cap.get_routed_experts(pool, idx, 5), expected)
        allocator.free(slots)
        pool.free(idx)
    assert cap.nbytes() == size


def test_capturer_built_under_inference_mode_works_outside_it():
    with torch.inference_mode():
        capturer = RoutedExpertsCapturer(2, 2, 8, 16, "cpu")
    capturer.capture(0, torch.tensor([[1, 2], [3, 4]]))
    capturer.on_forward_end(torch.tensor([5, 6]))
    pool = torch.tensor([[5, 6]])
    np.testing.assert_array_equal(capturer.get_routed_experts(pool, 0, 2)[:, 0], [[1, 2], [3, 4]])
