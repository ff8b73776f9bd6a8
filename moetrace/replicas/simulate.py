"""Request-trace simulation: a router in front of N simulated replicas under a cost model, in simulated time.

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

Everything is recorded through a :class:`~moetrace.replicas.ReplicaRecorder`
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
from .replica_recorder import ReplicaRecorder
from .router import CostModel, ReplicaRouter, RouterConfig, RouteRequest
from .workload import TraceRequest

__all__ = ["REFERENCE_COST", "SimulationResult", "offered_utilization", "scale_to_utilization", "simulate"]

#: Cost model fitted on live reference replicas (``moetrace replicas calibrate``; docs/replicas.md).
REFERENCE_COST = CostModel(prefill_fixed=7.1e-3, prefill_per_token=1.7e-5, decode_fixed=2.5e-3, decode_per_seq=1.6e-4, max_batch=8)


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """A finished simulation: where its replica trace is and what ran."""

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


_ARRIVE, _PREFILL_DONE, _FINISH = 0, 1, 2


class _EventLoop:
    """The discrete-event simulation of one policy: arrivals, prefill completions and finishes, in time order."""

    def __init__(self, replicas: list[_Replica], router: ReplicaRouter, rec: ReplicaRecorder, policy: str,
                 block_size: int, cost: CostModel) -> None:
        self.replicas, self.router, self.rec, self.policy = replicas, router, rec, policy
        self.block_size, self.cost = block_size, cost
        self.events: list[tuple[float, int, int, TraceRequest]] = []  # (time, seq, kind, request)
        self.seq = 0
        self.state: dict[str, list] = {}  # rid -> [request, replica, cached_tokens]

    def run(self, requests: Sequence[TraceRequest]) -> None:
        for req in requests:
            self.events.append((req.arrival, self.seq, _ARRIVE, req))
            self.seq += 1
        heapq.heapify(self.events)
        handlers = {_ARRIVE: self._arrive, _PREFILL_DONE: self._prefilled, _FINISH: self._finish}
        while self.events:
            now, _, kind, req = heapq.heappop(self.events)
            handlers[kind](req, now)

    def _push(self, t: float, kind: int, req: TraceRequest) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, req))
        self.seq += 1

    def _arrive(self, req: TraceRequest, now: float) -> None:
        route_req = RouteRequest(req.rid, req.input_tokens, req.hashes, req.session)
        self.rec.on_arrival(req.rid, req.input_tokens, session=req.session, t=now)
        decision = self.router.route(route_req)
        self.rec.on_decision(req.rid, decision.replica, self.policy, decision.reason, decision.candidates, t=now)
        if decision.migrated_from is not None:
            self.rec.on_migration(req.session or "", decision.migrated_from, decision.replica, t=now)
        self.router.assign(decision, route_req)
        rep = self.replicas[decision.replica]
        self.state[req.rid] = [req, rep, 0]
        rep.prefill_queue.append(req)
        self._start_prefill(rep, now)

    def _prefilled(self, req: TraceRequest, now: float) -> None:
        rep = self.state[req.rid][1]
        rep.cache.insert(req.hashes)
        rep.prefilling = False
        self.router.prefilled(req.rid)
        self.rec.on_first_token(req.rid, t=now)
        if rep.decoding < self.cost.max_batch:
            self._start_decode(rep, req, now)
        else:
            rep.decode_queue.append(req)
        self._start_prefill(rep, now)

    def _finish(self, req: TraceRequest, now: float) -> None:
        _, rep, cached = self.state.pop(req.rid)
        rep.decoding -= 1
        self.router.finished(req.rid)
        self.rec.on_finish(req.rid, req.output_tokens, cached, t=now)
        if rep.decode_queue:
            self._start_decode(rep, rep.decode_queue.popleft(), now)

    def _start_prefill(self, rep: _Replica, now: float) -> None:
        if rep.prefilling or not rep.prefill_queue:
            return
        req = rep.prefill_queue.popleft()
        matched = rep.cache.match(req.hashes)
        if matched:
            rep.cache.touch(req.hashes[:matched])
        cached = min(matched * self.block_size, req.input_tokens)
        self.state[req.rid][2] = cached
        rep.prefilling = True
        self.rec.on_start(req.rid, t=now)
        self.router.started(req.rid)
        self._push(now + self.cost.prefill(req.input_tokens - cached), _PREFILL_DONE, req)

    def _start_decode(self, rep: _Replica, req: TraceRequest, now: float) -> None:
        rep.decoding += 1
        self._push(now + max(req.output_tokens - 1, 0) * self.cost.decode_step(rep.decoding), _FINISH, req)


def simulate(requests: Sequence[TraceRequest], num_replicas: int, policy: str, *, block_size: int, cost: CostModel,
             cache_blocks: int | None = None, config: RouterConfig | None = None, out: str | Path | None = None,
             chunk_rows: int = 8192) -> SimulationResult:
    """Simulate ``requests`` (sorted by arrival, by their timestamps) through a :class:`ReplicaRouter`; write the replica trace.

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
    rec = ReplicaRecorder(num_replicas, output_dir=out.parent, block_size=block_size, chunk_rows=chunk_rows,
                          clock=lambda: 0.0, clock_name="simulated", engine="moetrace.replicas.simulate")
    rec.start_record()
    _EventLoop(replicas, router, rec, policy, block_size, cost).run(requests)
    try:
        path = rec.dump_record(out)
    finally:
        rec.close()
    return SimulationResult(path, policy, num_replicas, len(requests), cost, sum(r.cache.evictions for r in replicas))
