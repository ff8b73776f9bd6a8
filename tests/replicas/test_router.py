"""PrefixCache (LRU, pins, prefix semantics) and the ReplicaRouter's policy rules on hand-built states."""

from __future__ import annotations

import pytest

from moetrace.replicas.prefix_cache import PrefixCache, chain_hashes
from moetrace.replicas.router import (
    POLICY_NAMES,
    CostModel,
    ReplicaRouter,
    RouterConfig,
    RouteRequest,
)


def test_prefix_cache_lru_and_pins():
    evicted = []
    cache = PrefixCache(3, on_evict=lambda h, p: evicted.append((h, p)))
    assert cache.insert(["a", "b"], ["A", "B"]) == [0, 1]
    assert cache.match(["a", "b", "c"]) == 2 and cache.match(["b"]) == 1 and cache.match(["x", "a"]) == 0
    cache.insert(["z"])  # full: a, b, z
    cache.touch(["a", "b"])  # z is now least recent
    cache.insert(["a", "b", "c"], [None, None, "C"])
    assert evicted == [("z", None)] and len(cache) == 3
    cache.pin(["a", "b", "c"])
    assert cache.insert(["q"]) == [] and cache.evict(5) == 0  # everything pinned
    cache.pin(["c"], -1)
    assert cache.insert(["q"]) == [0] and evicted[-1] == ("c", "C")
    with pytest.raises(ValueError, match="unpinned"):
        cache.pin(["q"], -1)
    cache.remove(["q", "nope"])
    assert "q" not in cache and cache.evictions == 2
    with pytest.raises(ValueError, match="positive"):
        PrefixCache(0)


def test_chain_hashes_cover_the_whole_prefix():
    a = chain_hashes(list(range(40)), 16)
    b = chain_hashes([*range(16), 99, *range(17, 40)], 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert chain_hashes(list(range(15)), 16) == []


def _router(policy: str, loads: list[tuple[int, int]], cached: list[list[int]], **cfg) -> ReplicaRouter:
    router = ReplicaRouter(len(loads), policy, block_size=10, config=RouterConfig(**cfg), cost=CostModel(prefill_fixed=0.0, prefill_per_token=1.0))
    for view, (waiting, running), blocks in zip(router.replicas, loads, cached, strict=True):
        view.waiting, view.running = waiting, running
        view.prefill_tokens = 10 * waiting
        view.cache.insert(blocks)
    return router


REQ = RouteRequest("r", 40, [1, 2, 3, 4])


def test_cache_aware_rules():
    # balanced, best match 30/40 > 0.5 -> prefix owner
    d = _router("cache_aware", [(1, 0), (0, 0), (0, 1)], [[1, 2, 3], [1], []]).route(REQ)
    assert (d.replica, d.reason) == (0, "prefix_match") and d.chosen.match_tokens == 30 and d.candidates[1].match_blocks == 1
    # match rate 10/40 <= 0.5 -> the replica with the smallest cache
    d = _router("cache_aware", [(0, 0), (0, 0), (0, 0)], [[1, 9, 8], [1], [5, 6]]).route(REQ)
    assert (d.replica, d.reason) == (1, "smallest_cache")
    # imbalanced past both thresholds -> least loaded, even though replica 0 holds the prefix
    d = _router("cache_aware", [(40, 0), (3, 0), (5, 0)], [[1, 2, 3], [], []]).route(REQ)
    assert (d.replica, d.reason) == (1, "imbalance_fallback")
    # abs difference over the threshold but not the relative one: not imbalanced
    d = _router("cache_aware", [(40, 0), (3, 0)], [[1, 2, 3], []], balance_rel_threshold=20.0).route(REQ)
    assert (d.replica, d.reason) == (0, "prefix_match")


def test_locality_and_kv_cost_trade_match_against_wait():
    # replica 0 holds 3 of 4 blocks but has 100 tokens of prefill queued; replica 1 is idle with nothing cached
    router = _router("constrained_locality", [(10, 0), (0, 0)], [[1, 2, 3], []])
    d = router.route(REQ)
    assert d.candidates[0].est_ttft == pytest.approx(100 + 10) and d.candidates[1].est_ttft == pytest.approx(40)
    assert (d.replica, d.reason) == (1, "min_est_ttft")
    router.replicas[0].waiting, router.replicas[0].prefill_tokens = 1, 10
    assert router.route(REQ).replica == 0  # now the cached replica is cheaper: 10 + 10 < 40
    d = _router("kv_cost", [(0, 0), (0, 0)], [[1, 2, 3], []]).route(REQ)
    assert (d.replica, d.reason) == (0, "min_kv_cost") and d.candidates[0].score < d.candidates[1].score


def test_session_sticky_and_migration_and_regret_signals():
    router = _router("session_sticky", [(0, 0), (2, 0)], [[], [1, 2, 3]], migrate_threshold=3)
    req = RouteRequest("a", 40, [1, 2, 3, 4], session="s")
    d = router.route(req)
    assert (d.replica, d.reason) == (0, "new_session") and d.chosen.match_tokens == 0
    assert max(c.match_tokens for c in d.candidates) == 30  # regret 30 tokens: the prefix lived on replica 1
    router.assign(d, req)
    d2 = router.route(RouteRequest("b", 40, [1], session="s"))
    assert (d2.replica, d2.reason, d2.candidates[0].session_owner) == (0, "session_owner", True)
    router.replicas[0].waiting = 9
    d3 = router.route(RouteRequest("c", 40, [1], session="s"))
    assert (d3.replica, d3.reason, d3.migrated_from) == (1, "session_migrated", 0)


def test_baselines_and_bookkeeping():
    rr = ReplicaRouter(3, "round_robin", block_size=10)
    assert [rr.route(REQ).replica for _ in range(4)] == [0, 1, 2, 0]
    rnd = ReplicaRouter(4, "random", block_size=10, config=RouterConfig(seed=1))
    assert len({rnd.route(REQ).replica for _ in range(50)}) == 4
    sq = ReplicaRouter(2, "shortest_queue", block_size=10)
    d = sq.route(REQ)
    sq.assign(d, REQ)
    assert sq.replicas[0].waiting == 1 and sq.replicas[0].prefill_tokens == 40 and sq.route(REQ).replica == 1
    sq.started("r")
    sq.prefilled("r")
    assert (sq.replicas[0].running, sq.replicas[0].prefill_tokens, sq.replicas[0].active_blocks) == (1, 0, 4)
    sq.finished("r")
    assert sq.replicas[0].load == 0 and sq.replicas[0].active_blocks == 0
    assert set(POLICY_NAMES) == {"round_robin", "random", "shortest_queue", "cache_aware", "session_sticky", "constrained_locality", "kv_cost"}
    with pytest.raises(ValueError, match="max_batch"):
        CostModel(max_batch=0)
    with pytest.raises(ValueError, match="unknown fields"):
        CostModel.from_dict({"speed": 1})
