"""Live replicas: N reference replica processes behind a :class:`ReplicaRouter`, recorded.

Each replica is a separate process running the reference serving loop
(:class:`~moetrace.reference.ServingLoop`) with a prefix cache that really
skips the prefill of cached blocks. The router process sends requests over a
pipe per replica; replicas send back events on one queue, each stamped with
``time.monotonic()`` (one clock for every process of a machine): ``start``
(admitted: prefill begins), ``first`` (first token), ``finish`` (output ids and
the cached prompt tokens the replica counted) and KV events (blocks stored /
evicted), which keep the router's view of each replica's cache exact, as
Dynamo's KV events do. Everything goes through a :class:`ReplicaRecorder`.

:func:`run_sessions` drives multi-turn sessions (turn ``k+1``'s prompt is turn
``k``'s prompt + its output + new user tokens) and :func:`run_unrouted` runs
the same sessions on one plain serving loop, for the equality check.
:func:`calibrate_cost_model` fits the replay's cost model on a replica.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..replicas.prefix_cache import chain_hashes
from ..replicas.replica_recorder import ReplicaRecorder
from ..replicas.router import CostModel, ReplicaRouter, RouterConfig, RouteRequest
from .engine import REPLICA_LOOP, REPLICA_MODEL, build_loop, serve

__all__ = ["LiveCluster", "Session", "calibrate_cost_model", "run_sessions", "run_unrouted"]

@dataclasses.dataclass(frozen=True)
class Session:
    """A multi-turn session: a shared system prompt, then one user message per turn."""

    sid: str
    system: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]
    max_new_tokens: int


class _ReplicaEvents:
    """A replica's step events, sent on ``events`` and counted per request (sent with ``stats`` at the end)."""

    def __init__(self, index: int, events: Any) -> None:
        self.index, self.events = index, events
        self.arrival: dict[str, float] = {}
        self.counted: dict[str, dict[str, Any]] = {}

    def started(self, rid: str, t: float) -> None:
        self.events.put(("start", self.index, rid, t))
        self.counted[rid] = {"queue_wait": t - self.arrival[rid]}

    def kv(self, kind: str, hashes: list[int]) -> None:
        self.events.put((kind, self.index, hashes))

    def first_token(self, rid: str, t: float) -> None:
        self.events.put(("first", self.index, rid, t))
        self.counted[rid]["ttft"] = t - self.arrival[rid]

    def finished(self, result: Any, t: float) -> None:
        self.events.put(("finish", self.index, result.rid, result.output_ids, result.cached_tokens, t))
        self.counted[result.rid].update(cached_tokens=result.cached_tokens, output_tokens=len(result.output_ids), e2e=t - self.arrival.pop(result.rid))


def _replica_main(index: int, model_cfg: dict[str, Any], loop_cfg: dict[str, Any], cache_blocks: int, block_size: int,
                  inbox: Any, events: Any) -> None:
    """A replica process: serve what arrives on ``inbox``; report on ``events``."""
    from ..reference import Request

    loop = build_loop(model_cfg, loop_cfg, cache_blocks, block_size)
    report = _ReplicaEvents(index, events)

    def take(idle: bool) -> bool:
        if idle:
            inbox.poll(None)
        while inbox.poll(0):
            msg = inbox.recv()
            if msg[0] == "stop":
                events.put(("stats", index, report.counted))
                return False
            _, rid, prompt, max_new, t_arrival = msg
            report.arrival[rid] = t_arrival
            loop.submit([Request(rid, prompt, max_new)])
        return True

    serve(loop, take, report)


class LiveCluster:
    """``num_replicas`` replica processes behind a :class:`ReplicaRouter`, recorded by ``recorder``.

    Args:
        policy: the router's policy.
        recorder: a started :class:`ReplicaRecorder` (``None``: not recorded).
        cache_blocks: each replica's prefix-cache capacity in blocks.
        block_size: prefix block size in tokens.
    """

    def __init__(self, num_replicas: int, policy: str, *, recorder: ReplicaRecorder | None = None, cache_blocks: int = 256,
                 block_size: int = 16, model: dict[str, Any] | None = None, loop: dict[str, Any] | None = None,
                 config: RouterConfig | None = None, cost: CostModel | None = None) -> None:
        self.router = ReplicaRouter(num_replicas, policy, block_size=block_size, config=config, cost=cost)
        self.policy, self.block_size, self.recorder = policy, block_size, recorder
        ctx = mp.get_context("spawn")
        self._events = ctx.Queue()
        self._pipes = []
        self._procs = []
        for i in range(num_replicas):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_replica_main, args=(i, model or REPLICA_MODEL, loop or REPLICA_LOOP, cache_blocks, block_size, child, self._events),
                               name=f"moetrace-replica-{i}", daemon=True)
            proc.start()
            self._pipes.append(parent)
            self._procs.append(proc)
        self._lock = threading.Lock()
        self._waiters: dict[str, tuple[threading.Event, list]] = {}
        self.stats: dict[int, dict[str, dict[str, Any]]] = {}
        self.predicted: dict[str, tuple[int, int]] = {}  # rid -> (router-predicted cached tokens, replica-counted)
        self._stats_done = threading.Event()
        self._reader = threading.Thread(target=self._read_events, name="moetrace-router-events", daemon=True)
        self._reader.start()

    def submit(self, rid: str, prompt: Sequence[int], max_new_tokens: int, session: str | None = None) -> tuple[threading.Event, list]:
        """Route and send one request; returns ``(done, [output_ids])`` filled when it finishes."""
        t = time.monotonic()
        prompt = list(prompt)
        req = RouteRequest(rid, len(prompt), chain_hashes(prompt[: len(prompt) - 1], self.block_size), session)
        rec = self.recorder
        done: tuple[threading.Event, list] = (threading.Event(), [])
        with self._lock:
            if rec is not None:
                rec.on_arrival(rid, len(prompt), session=session, t=t)
            decision = self.router.route(req)
            self.router.assign(decision, req)
            self._waiters[rid] = done
            self.predicted[rid] = (decision.chosen.match_tokens, -1)
            if rec is not None:
                rec.on_decision(rid, decision.replica, self.policy, decision.reason, decision.candidates, t=time.monotonic())
                if decision.migrated_from is not None:
                    rec.on_migration(session or "", decision.migrated_from, decision.replica)
            self._pipes[decision.replica].send(("req", rid, prompt, max_new_tokens, t))
        return done

    def _read_events(self) -> None:
        pending_stats = len(self._procs)
        while pending_stats:
            try:
                ev = self._events.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in self._procs):
                    break
                continue
            kind, replica = ev[0], ev[1]
            rec = self.recorder
            with self._lock:
                if kind == "start":
                    self.router.started(ev[2])
                    if rec is not None:
                        rec.on_start(ev[2], t=ev[3])
                elif kind == "first":
                    self.router.prefilled(ev[2])
                    if rec is not None:
                        rec.on_first_token(ev[2], t=ev[3])
                elif kind == "stored":
                    self.router.stored(replica, ev[2])
                elif kind == "evicted":
                    self.router.evicted(replica, ev[2])
                elif kind == "finish":
                    _, _, rid, output, cached, t = ev
                    self.router.finished(rid)
                    self.predicted[rid] = (self.predicted[rid][0], cached)
                    if rec is not None:
                        rec.on_finish(rid, len(output), cached, t=t)
                    event, box = self._waiters.pop(rid)
                    box.append(output)
                    event.set()
                elif kind == "stats":
                    self.stats[replica] = ev[2]
                    pending_stats -= 1
        self._stats_done.set()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the replicas (they report their own counts into :attr:`stats`) and join them."""
        for pipe in self._pipes:
            try:
                pipe.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        self._stats_done.wait(timeout)
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)

    def __enter__(self) -> LiveCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _turn_prompt(session: Session, turn: int, history: list[int]) -> list[int]:
    return [*history, *session.turns[turn]] if turn else [*session.system, *session.turns[0]]


def run_sessions(cluster: LiveCluster, sessions: Sequence[Session], timeout: float = 120.0) -> dict[str, list[int]]:
    """Serve every session's turns through ``cluster`` (sessions concurrently, turns in order); ``{rid: output_ids}``."""
    outputs: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def one(session: Session) -> None:
        try:
            history: list[int] = []
            for turn in range(len(session.turns)):
                prompt = _turn_prompt(session, turn, history)
                rid = f"{session.sid}-t{turn}"
                done, box = cluster.submit(rid, prompt, session.max_new_tokens, session=session.sid)
                if not done.wait(timeout):
                    raise TimeoutError(f"request {rid} did not finish within {timeout} s")
                outputs[rid] = box[0]
                history = prompt + box[0]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return outputs


def run_unrouted(sessions: Sequence[Session], model: dict[str, Any] | None = None, loop: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """The same sessions on one plain serving loop (no router, no prefix cache), turn by turn; ``{rid: output_ids}``."""
    from ..reference import Request

    serving = build_loop(model or REPLICA_MODEL, loop or REPLICA_LOOP, None, 16)
    outputs: dict[str, list[int]] = {}
    history = {s.sid: [] for s in sessions}
    for turn in range(max(len(s.turns) for s in sessions)):
        batch = []
        for s in sessions:
            if turn < len(s.turns):
                prompt = _turn_prompt(s, turn, history[s.sid])
                batch.append(Request(f"{s.sid}-t{turn}", prompt, s.max_new_tokens))
                history[s.sid] = prompt
        for res in serving.run(batch):
            outputs[res.rid] = res.output_ids
            sid = res.rid.rsplit("-t", 1)[0]
            history[sid] = history[sid] + res.output_ids
    return outputs


def calibrate_cost_model(model: dict[str, Any] | None = None, loop: dict[str, Any] | None = None, repeats: int = 3) -> CostModel:
    """Fit :class:`CostModel` on a reference replica: prefill time vs uncached tokens, decode step time vs batch.

    Least squares over prompts of 16..192 tokens (prefill) and decode batches of
    1..8 requests; best of ``repeats`` timings each (a quiet-machine figure).
    """
    import numpy as np

    from ..reference import Request

    serving = build_loop(model or REPLICA_MODEL, loop or REPLICA_LOOP, None, 16)
    rng = np.random.default_rng(0)
    vocab = (model or REPLICA_MODEL)["vocab_size"]
    rid = iter(range(1 << 30))

    def best(requests_fn: Any, measure: Any) -> float:
        return min(measure(requests_fn()) for _ in range(repeats))

    def prefill_time(reqs: list) -> float:
        serving.submit(reqs)
        t = time.perf_counter()
        serving.step()
        elapsed = time.perf_counter() - t
        while serving.step() is not None:
            pass
        return elapsed

    sizes = [16, 64, 128, 192]
    pre = [best(lambda n=n: [Request(f"c{next(rid)}", rng.integers(0, vocab, n).tolist(), 1)], prefill_time) for n in sizes]
    a = np.vstack([np.ones(len(sizes)), sizes]).T
    p_fixed, p_tok = np.linalg.lstsq(a, np.array(pre), rcond=None)[0]

    def decode_time(reqs: list) -> float:
        serving.submit(reqs)
        serving.step()  # prefill
        t = time.perf_counter()
        steps = 0
        while serving.step() is not None:
            steps += 1
        return (time.perf_counter() - t) / max(steps, 1)

    batches = [1, 2, 4, 8]
    dec = [best(lambda b=b: [Request(f"c{next(rid)}", rng.integers(0, vocab, 8).tolist(), 17) for _ in range(b)], decode_time) for b in batches]
    a = np.vstack([np.ones(len(batches)), batches]).T
    d_fixed, d_seq = np.linalg.lstsq(a, np.array(dec), rcond=None)[0]
    return CostModel(prefill_fixed=max(float(p_fixed), 0.0), prefill_per_token=max(float(p_tok), 0.0), decode_fixed=max(float(d_fixed), 0.0),
                     decode_per_seq=max(float(d_seq), 0.0), max_batch=(loop or REPLICA_LOOP)["max_running"])
