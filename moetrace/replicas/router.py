"""``ReplicaRouter``: send each request to one of N model replicas, and say why.

Policies (each follows a real router; docs/replicas.md cites them):

- ``round_robin``, ``random``: baselines.
- ``shortest_queue``: fewest requests waiting + running (ties: less
  outstanding prefill, then the lowest index).
- ``cache_aware``: SGLang router's ``cache_aware``. The system is imbalanced
  when ``max_load - min_load > balance_abs_threshold`` *and*
  ``max_load > balance_rel_threshold * min_load``; then the least loaded
  replica wins (``imbalance_fallback``). Otherwise the replica with the longest
  prefix match wins if its match rate (matched / input tokens) is above
  ``cache_threshold`` (``prefix_match``), else the replica whose cache holds the
  fewest blocks (``smallest_cache``).
- ``session_sticky``: a session's turns go to the replica that served its
  first turn (``session_owner``); a new session goes to the shortest queue
  (``new_session``); with ``migrate_threshold`` set, a session whose owner's
  load exceeds the least loaded replica's by more than it moves there
  (``session_migrated``).
- ``constrained_locality``: Mooncake's conductor: estimated TTFT = the
  replica's queue wait (its outstanding prefill work under the cost model) +
  the prefill time of the *uncached* part of this prompt; smallest wins
  (``min_est_ttft``), trading cache locality against waiting.
- ``kv_cost``: Dynamo's KV router cost ``w * prefill_blocks + decode_blocks``:
  prefill blocks = (the replica's outstanding prefill tokens + this prompt's
  uncached tokens) / block size, decode blocks = KV blocks of the replica's
  active requests plus this one's; smallest wins (``min_kv_cost``).

The router keeps a view of each replica (:class:`ReplicaView`): requests
waiting and running, outstanding prefill tokens, active KV blocks, and a
:class:`~moetrace.replicas.prefix_cache.PrefixCache` of the blocks the replica
holds. The driver keeps it true with :meth:`ReplicaRouter.assign`,
:meth:`~ReplicaRouter.started`, :meth:`~ReplicaRouter.stored`,
:meth:`~ReplicaRouter.evicted` and :meth:`~ReplicaRouter.finished` (Dynamo's
KV events); the trace replay shares the replicas' own caches instead.
Every decision lists each replica's signals as
:class:`~moetrace.replicas.Candidate` s, ready for the ``ReplicaRecorder``.
"""

from __future__ import annotations

import dataclasses
import math
import random as _random
from collections.abc import Sequence
from typing import Any

from .prefix_cache import PrefixCache
from .replica_recorder import Candidate

__all__ = ["POLICY_NAMES", "CostModel", "Decision", "ReplicaRouter", "ReplicaView", "RouteRequest", "RouterConfig"]

#: Policies a :class:`ReplicaRouter` runs (``moetrace replicas compare`` runs all of them).
POLICY_NAMES = ("round_robin", "random", "shortest_queue", "cache_aware", "session_sticky", "constrained_locality", "kv_cost")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Time a replica spends on a request (seconds), fitted on live replicas.

    ``prefill(n) = prefill_fixed + prefill_per_token * n`` for ``n`` uncached
    prompt tokens, run one prompt at a time; decoding takes
    ``decode_fixed + decode_per_seq * b`` per step with ``b`` requests in the
    decode batch, at most ``max_batch`` of them.
    """

    prefill_fixed: float = 1e-3
    prefill_per_token: float = 1e-5
    decode_fixed: float = 1e-3
    decode_per_seq: float = 1e-4
    max_batch: int = 64

    def __post_init__(self) -> None:
        for name in ("prefill_fixed", "prefill_per_token", "decode_fixed", "decode_per_seq"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.max_batch, int) or self.max_batch <= 0:
            raise ValueError(f"cost model: max_batch must be a positive integer, got {self.max_batch!r}")

    def prefill(self, tokens: int) -> float:
        return self.prefill_fixed + self.prefill_per_token * tokens

    def decode_step(self, batch: int) -> float:
        return self.decode_fixed + self.decode_per_seq * batch

    def scaled(self, factor: float) -> CostModel:
        """Every time multiplied by ``factor`` (a slower or faster model, same shape)."""
        return dataclasses.replace(self, prefill_fixed=self.prefill_fixed * factor, prefill_per_token=self.prefill_per_token * factor,
                                   decode_fixed=self.decode_fixed * factor, decode_per_seq=self.decode_per_seq * factor)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"cost model: unknown fields {sorted(unknown)}; expected {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Policy parameters (defaults: the real routers' defaults).

    Args:
        cache_threshold, balance_abs_threshold, balance_rel_threshold: SGLang
            ``cache_aware`` (defaults 0.5, 32, 1.0001).
        overlap_weight: Dynamo ``kv_overlap_score_weight`` (default 1).
        migrate_threshold: ``session_sticky`` moves a session when its owner's
            load exceeds the minimum by more than this (``None``: never).
        seed: seed of ``random``.
    """

    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    overlap_weight: float = 1.0
    migrate_threshold: int | None = None
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What the router sees of a request.

    Args:
        rid: request id.
        input_tokens: prompt length.
        hashes: chained hashes of its prefix blocks (``block_size`` tokens each).
        session: session id (multi-turn), or ``None``.
    """

    rid: str
    input_tokens: int
    hashes: Sequence[Any]
    session: str | None = None


@dataclasses.dataclass
class ReplicaView:
    """The router's view of one replica."""

    index: int
    cache: PrefixCache
    waiting: int = 0
    running: int = 0
    prefill_tokens: int = 0
    active_blocks: int = 0

    @property
    def load(self) -> int:
        return self.waiting + self.running


@dataclasses.dataclass(frozen=True)
class Decision:
    """The router's decision: the replica, the rule that decided, every replica's signals."""

    rid: str
    replica: int
    policy: str
    reason: str
    candidates: tuple[Candidate, ...]
    migrated_from: int | None = None

    @property
    def chosen(self) -> Candidate:
        return self.candidates[self.replica]


class ReplicaRouter:
    """Routes requests over ``num_replicas`` replicas with one policy.

    Args:
        num_replicas: replicas (``>= 1``).
        policy: one of :data:`POLICY_NAMES`.
        block_size: prefix block size in tokens.
        cost: cost model for wait / TTFT estimates.
        config: policy parameters.
        caches: the replicas' caches to read (trace replay); default: one
            unlimited mirror per replica, kept by :meth:`stored` / :meth:`evicted`.
    """

    def __init__(self, num_replicas: int, policy: str, *, block_size: int, cost: CostModel | None = None,
                 config: RouterConfig | None = None, caches: Sequence[PrefixCache] | None = None) -> None:
        if not isinstance(num_replicas, int) or num_replicas <= 0:
            raise ValueError(f"the router needs at least one replica, got {num_replicas!r}; pass --replicas N with N >= 1")
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown router policy {policy!r}; choose one of: {', '.join(POLICY_NAMES)}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if caches is not None and len(caches) != num_replicas:
            raise ValueError(f"got {len(caches)} caches for {num_replicas} replicas")
        self.policy, self.block_size = policy, block_size
        self.cost = cost or CostModel()
        self.config = config or RouterConfig()
        self.replicas = [ReplicaView(i, caches[i] if caches is not None else PrefixCache(None)) for i in range(num_replicas)]
        self._rng = _random.Random(self.config.seed)
        self._next = 0
        self.sessions: dict[str, int] = {}
        self._assigned: dict[str, tuple[int, int, int]] = {}  # rid -> (replica, est. uncached tokens, blocks)
        self._choose = getattr(self, f"_{policy}")

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ deciding
    def route(self, req: RouteRequest) -> Decision:
        """Choose a replica for ``req`` (does not change the router's state: call :meth:`assign`)."""
        bs, w, cost = self.block_size, self.config.overlap_weight, self.cost
        owner = self.sessions.get(req.session) if req.session is not None else None
        n_blocks = -(-req.input_tokens // bs)
        signals = []
        for v in self.replicas:
            mb = v.cache.match(req.hashes)
            mt = min(mb * bs, req.input_tokens)
            wait = cost.prefill_per_token * v.prefill_tokens + cost.prefill_fixed * v.waiting
            ttft = wait + cost.prefill(req.input_tokens - mt)
            kv = w * (v.prefill_tokens + req.input_tokens - mt) / bs + v.active_blocks + n_blocks
            signals.append((v, mb, mt, wait, ttft, kv))
        replica, reason, scores = self._choose(req, signals, owner)
        candidates = tuple(
            Candidate(v.index, v.waiting, v.running, v.prefill_tokens, mb, mt, owner == v.index, wait, ttft, score)
            for (v, mb, mt, wait, ttft, _), score in zip(signals, scores, strict=True)
        )
        migrated = owner if owner is not None and owner != replica else None
        return Decision(req.rid, replica, self.policy, reason, candidates, migrated)

    @staticmethod
    def _least_loaded(signals: list) -> int:
        return min(signals, key=lambda s: (s[0].load, s[0].prefill_tokens, s[0].index))[0].index

    def _round_robin(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        replica = self._next % len(signals)
        self._next += 1
        return replica, "round_robin", [math.nan] * len(signals)

    def _random(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        return self._rng.randrange(len(signals)), "random", [math.nan] * len(signals)

    def _shortest_queue(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        return self._least_loaded(signals), "shortest_queue", [float(s[0].load) for s in signals]

    def _cache_aware(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        cfg = self.config
        loads = [s[0].load for s in signals]
        rates = [s[2] / req.input_tokens if req.input_tokens else 0.0 for s in signals]
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            return self._least_loaded(signals), "imbalance_fallback", [float(x) for x in loads]
        best = max(signals, key=lambda s: (s[2], -s[0].load, -s[0].index))
        if rates[best[0].index] > cfg.cache_threshold:
            return best[0].index, "prefix_match", rates
        smallest = min(signals, key=lambda s: (len(s[0].cache), s[0].load, s[0].index))
        return smallest[0].index, "smallest_cache", rates

    def _session_sticky(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        loads = [float(s[0].load) for s in signals]
        if owner is None:
            return self._least_loaded(signals), "new_session", loads
        limit = self.config.migrate_threshold
        if limit is not None and loads[owner] - min(loads) > limit:
            return self._least_loaded(signals), "session_migrated", loads
        return owner, "session_owner", loads

    def _constrained_locality(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        best = min(signals, key=lambda s: (s[4], s[0].index))
        return best[0].index, "min_est_ttft", [s[4] for s in signals]

    def _kv_cost(self, req: RouteRequest, signals: list, owner: int | None) -> tuple[int, str, list[float]]:
        best = min(signals, key=lambda s: (s[5], s[0].index))
        return best[0].index, "min_kv_cost", [s[5] for s in signals]

    # ------------------------------------------------------------------ keeping the view true
    def assign(self, decision: Decision, req: RouteRequest) -> None:
        """``req`` was sent to ``decision.replica``."""
        v = self.replicas[decision.replica]
        uncached = req.input_tokens - decision.chosen.match_tokens
        blocks = -(-req.input_tokens // self.block_size)
        v.waiting += 1
        v.prefill_tokens += uncached
        self._assigned[req.rid] = (v.index, uncached, blocks)
        if req.session is not None:
            self.sessions[req.session] = decision.replica

    def started(self, rid: str) -> None:
        """The replica started ``rid``'s prefill."""
        replica, _, _ = self._assigned[rid]
        v = self.replicas[replica]
        v.waiting -= 1
        v.running += 1

    def prefilled(self, rid: str) -> None:
        """``rid``'s prefill is done: its prompt now decodes (active KV blocks)."""
        replica, uncached, blocks = self._assigned[rid]
        v = self.replicas[replica]
        v.prefill_tokens -= uncached
        v.active_blocks += blocks

    def finished(self, rid: str) -> None:
        """``rid`` finished; it leaves the replica's load."""
        replica, _, blocks = self._assigned.pop(rid)
        v = self.replicas[replica]
        v.running -= 1
        v.active_blocks -= blocks

    def stored(self, replica: int, hashes: Sequence[Any]) -> None:
        """KV event: ``replica`` now holds ``hashes`` (the view's mirror)."""
        self.replicas[replica].cache.insert(hashes)

    def evicted(self, replica: int, hashes: Sequence[Any]) -> None:
        """KV event: ``replica`` dropped ``hashes``."""
        self.replicas[replica].cache.remove(hashes)
