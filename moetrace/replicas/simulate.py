"""Trace replay in simulated time: a router in front of N replicas under a cost model.

Each simulated replica has a block-level LRU prefix cache
(:class:`~moetrace.replicas.prefix_cache.PrefixCache`, ``cache_blocks``
capacity), runs prefills one at a time in arrival order (a prefill of ``n``
uncached tokens takes ``cost.prefill(n)``; the blocks found in its cache when
the prefill *starts* are skipped, and the prompt's blocks are inserted when it
ends) and decodes up to ``cost.max_batch`` requests at once (a request's
decode takes ``(output_tokens - 1) * cost.decode_step(batch)`` with the batch
it joins; further requests wait for a decode slot). The first token comes out
at the end of the prefill. The router sees the replicas' real caches and
counts (a global view, as Mooncake's conductor and Dynamo's KV events give).

Everything is recorded through a :class:`~moetrace.replicas.RoutingRecorder`
on the simulated clock, so a replay and a live run give the same trace and the
same analysis.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .prefix_cache import PrefixCache
from .recorder import RoutingRecorder
from .router import CostModel, ReplicaRouter, RouterConfig, RouteRequest
from .trace import TraceRequest

__all__ = ["REFERENCE_COST", "ReplayResult", "offered_utilization", "replay", "scale_to_utilization"]

#: Cost model fitted on live reference replicas (``moetrace replicas calibrate``; docs/replicas.md).
REFERENCE_COST = CostModel(prefill_fixed=7.1e-3, prefill_per_token=1.7e-5, decode_fixed=2.5e-3, decode_per_seq=1.6e-4, max_batch=8)


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """A finished replay: where its trace is and what ran."""

    path: Path
    policy: str
    num_replicas: int
    requests: int
    cost: CostModel
    evictions: int


def offered_utilization(requests: Sequence[TraceRequest], num_replicas: int, cost: CostModel) -> float:
    """Prefill work of every prompt computed in full, per replica-second of the trace's span."""
    span = max(requests[-1].arrival - requests[0].arrival, 1e-9)
    work = sum(cost.prefill(r.input_tokens) for r in requests)
    return work / (num_replicas * span)


def scale_to_utilization(requests: Sequence[TraceRequest], num_replicas: int, cost: CostModel, utilization: float) -> CostModel:
    """``cost`` scaled so that :func:`offered_utilization` is ``utilization`` (same shape, slower or faster model)."""
    if not utilization > 0:
        raise ValueError(f"utilization must be > 0, got {utilization}")
    return cost.scaled(utilization / offered_utilization(requests, num_replicas, cost))


class _Replica:
    def __init__(self, index: int, cache_blocks: int | None) -> None:
        self.index = index
        self.cache = PrefixCache(cache_blocks)
        self.prefill_queue: collections.deque = collections.deque()
        self.prefilling = False
        self.decoding = 0
        self.decode_queue: collections.deque = collections.deque()


def replay(requests: Sequence[TraceRequest], num_replicas: int, policy: str, *, block_size: int, cost: CostModel,
           cache_blocks: int | None = None, config: RouterConfig | None = None, out: str | Path | None = None,
           chunk_rows: int = 8192) -> ReplayResult:
    """Replay ``requests`` (sorted by arrival) through a :class:`ReplicaRouter`; write the routing trace.

    Args:
        cache_blocks: prefix-cache capacity of each replica in blocks (``None``: unlimited).
        out: trace path (default: a temporary file the caller owns).
    """
    if not isinstance(num_replicas, int) or num_replicas <= 0:
        raise ValueError(f"need at least one replica, got {num_replicas!r}; pass --replicas N with N >= 1")
    replicas = [_Replica(i, cache_blocks) for i in range(num_replicas)]
    router = ReplicaRouter(num_replicas, policy, block_size=block_size, cost=cost, config=config, caches=[r.cache for r in replicas])
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="moetrace-replay-")) / f"replay-{policy}.h5"
    out = Path(out)
    rec = RoutingRecorder(num_replicas, output_dir=out.parent, block_size=block_size, chunk_rows=chunk_rows,
                          clock=lambda: 0.0, clock_name="simulated", engine="moetrace.replicas.simulate")
    rec.start_record()
    events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload)
    seq = 0
    ARRIVE, PREFILL_DONE, FINISH = 0, 1, 2
    for req in requests:
        events.append((req.arrival, seq, ARRIVE, req))
        seq += 1
    heapq.heapify(events)
    state: dict[str, list] = {}  # rid -> [request, replica, cached_tokens]

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def start_prefill(rep: _Replica, now: float) -> None:
        if rep.prefilling or not rep.prefill_queue:
            return
        req = rep.prefill_queue.popleft()
        matched = rep.cache.match(req.hashes)
        if matched:
            rep.cache.touch(req.hashes[:matched])
        cached = min(matched * block_size, req.input_tokens)
        state[req.rid][2] = cached
        rep.prefilling = True
        rec.on_start(req.rid, t=now)
        router.started(req.rid)
        push(now + cost.prefill(req.input_tokens - cached), PREFILL_DONE, req)

    def start_decode(rep: _Replica, req: TraceRequest, now: float) -> None:
        rep.decoding += 1
        push(now + max(req.output_tokens - 1, 0) * cost.decode_step(rep.decoding), FINISH, req)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        req = payload  # type: ignore[assignment]
        if kind == ARRIVE:
            route_req = RouteRequest(req.rid, req.input_tokens, req.hashes, req.session)
            rec.on_arrival(req.rid, req.input_tokens, session=req.session, t=now)
            decision = router.route(route_req)
            rec.on_decision(req.rid, decision.replica, policy, decision.reason, decision.candidates, t=now)
            if decision.migrated_from is not None:
                rec.on_migration(req.session or "", decision.migrated_from, decision.replica, t=now)
            router.assign(decision, route_req)
            rep = replicas[decision.replica]
            state[req.rid] = [req, rep, 0]
            rep.prefill_queue.append(req)
            start_prefill(rep, now)
        elif kind == PREFILL_DONE:
            rep = state[req.rid][1]
            rep.cache.insert(req.hashes)
            rep.prefilling = False
            router.prefilled(req.rid)
            rec.on_first_token(req.rid, t=now)
            if rep.decoding < cost.max_batch:
                start_decode(rep, req, now)
            else:
                rep.decode_queue.append(req)
            start_prefill(rep, now)
        else:
            _, rep, cached = state.pop(req.rid)
            rep.decoding -= 1
            router.finished(req.rid)
            rec.on_finish(req.rid, req.output_tokens, cached, t=now)
            if rep.decode_queue:
                start_decode(rep, rep.decode_queue.popleft(), now)
    try:
        path = rec.dump_record(out)
    finally:
        rec.close()
    return ReplayResult(path, policy, num_replicas, len(requests), cost, sum(r.cache.evictions for r in replicas))
