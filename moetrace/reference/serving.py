"""A continuous-batching serving loop over :class:`ReferenceMoEModel`, with routed-experts capture.

Requests arrive over time (``arrival_step``) with a prompt and
``max_new_tokens``. Each step the loop admits arrived requests while request
slots, KV slots and ``max_running`` allow, then builds one pass: one decode
token for every request past its prompt, then prompt chunks (at most
``chunk_size`` tokens of one request per pass) until ``max_tokens_per_pass``.
Each new token gets a KV slot from :class:`KVSlotAllocator` and its position
is recorded in the :class:`ReqToTokenPool`; finished requests free their slots,
which later requests reuse.

Token convention: positions with routing are every prompt token plus every
generated token that went through a forward, i.e. ``P + max(N - 1, 0)`` for a
prompt of ``P`` tokens and ``N = max_new_tokens`` (the last sampled token is
never fed back). ``max_new_tokens=0`` is a prefill-only request: all ``P``
prompt positions are computed and returned, no token is sampled. Sampling is
greedy.

Prefix cache (``prefix_cache_blocks``): the KV slots of a finished request's
full ``block_size``-token blocks (prompt and fed-back output) stay in a
block-level LRU :class:`~moetrace.replicas.prefix_cache.PrefixCache`; a later
request whose prompt starts with the same blocks maps them into its
``req_to_token`` row and skips their prefill (at least one prompt token is
always computed, for its logits). ``RequestResult.cached_tokens`` says how many
prompt tokens were reused; :attr:`ServingLoop.kv_events` lists blocks stored
and evicted (Dynamo-style KV events for a router). Routed-experts capture of
cached positions is not supported with the prefix cache.

Expert parallelism: build one loop per rank around an EP model. Each rank
serves its own requests (data-parallel attention, expert-parallel MoE); the
ranks step in lockstep (a small ``all_reduce`` per step) and a rank with
nothing to do joins every collective with an empty batch. :meth:`stop` ends
all ranks at the next step, cleanly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..batch import PassBatch
from ..capturer import RoutedExpertsCapturer
from ..label_load import LabelLoad, check_labels
from ..process_recorder import get_recorder
from ..provenance import RouteProvenance
from ..replicas.prefix_cache import PrefixCache, chain_hashes
from .kv import KVSlotAllocator, ReqToTokenPool
from .model import ForwardBatch, ReferenceMoEModel, Segment

__all__ = ["Progress", "Request", "RequestResult", "ServingLoop", "routed_positions"]


def routed_positions(prompt_len: int, max_new_tokens: int) -> int:
    """Positions of a finished request that have routing: ``P + max(N - 1, 0)``."""
    return prompt_len + max(max_new_tokens - 1, 0)


@dataclasses.dataclass(frozen=True)
class Request:
    """A generation request.

    Args:
        rid: unique id.
        prompt: token ids (at least one).
        max_new_tokens: tokens to generate (0 = prefill only).
        arrival_step: loop step at which the request becomes visible.
        return_routed_experts: return ``[n, L, k]`` routed experts with the result.
        routed_experts_start_len: first position to return (multi-turn: only the new part).
        labels: who sent it and why (``{"tenant": "a", "workload": "code"}``; bounded:
            :func:`moetrace.label_load.check_labels`), returned with the result and counted by
            the loop's ``label_load``.
    """

    rid: str
    prompt: Sequence[int]
    max_new_tokens: int
    arrival_step: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass
class RequestResult:
    """What a request gets back.

    Attributes:
        rid, prompt_len: the request's id and prompt length.
        output_ids: generated tokens.
        routed_experts: ``[n, L, k]`` expert ids of positions
            ``routed_experts_start .. routed_experts_start+n-1`` (``-1`` for
            dense layers), or ``None`` when not asked for.
        routed_experts_start: first position of ``routed_experts``.
        forward_pass_ids: the passes the request took part in (the recorder's pass ids).
        finish_reason: ``"length"`` or ``"stopped"`` (the loop was stopped first).
        rank: the EP rank that served it.
        cached_tokens: prompt tokens taken from the prefix cache (their prefill was skipped).
        labels: the request's labels.
        provenance: where ``routed_experts`` come from (run: the recorder's ``run_id`` when
            one was recording, rank, the loop's weight version, attempt 0), or ``None``
            when not asked for.
    """

    rid: str
    prompt_len: int
    output_ids: list[int]
    routed_experts: np.ndarray | None
    routed_experts_start: int
    forward_pass_ids: list[int]
    finish_reason: str
    rank: int
    cached_tokens: int = 0
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    provenance: RouteProvenance | None = None


@dataclasses.dataclass(frozen=True)
class Progress:
    """One step of the loop: what ran and how far the run is."""

    step: int
    forward_pass_id: int | None
    batch_tokens: int
    finished: int
    total: int
    running: int
    waiting: int
    new_results: tuple[RequestResult, ...]
    admitted: tuple[str, ...] = ()
    first_tokens: tuple[str, ...] = ()


@dataclasses.dataclass
class _Live:
    request: Request
    pool_idx: int
    tokens: list[int]
    computed: int = 0
    kv_slots: list[int] = dataclasses.field(default_factory=list)
    output: list[int] = dataclasses.field(default_factory=list)
    pass_ids: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0
    matched: list = dataclasses.field(default_factory=list)  # pinned prefix-cache blocks

    @property
    def needed(self) -> int:
        """KV slots of its own (cached positions use the cache's slots)."""
        return routed_positions(len(self.request.prompt), self.request.max_new_tokens) - self.cached


def _pass_batch(plan: Sequence[tuple[_Live, int]]) -> PassBatch:
    """The recorder's view of a pass: each request's rows, in plan (= ``input_ids``) order."""
    if not plan:
        return PassBatch.idle()
    return PassBatch.of([live.request.rid for live, _ in plan], [live.computed for live, _ in plan], [n for _, n in plan],
                        prefill=[live.computed < len(live.request.prompt) for live, _ in plan])


class ServingLoop:
    """Continuous batching with a KV-slot pool, ``req_to_token`` and routed-experts capture.

    Args:
        model: the reference model (dense, or this rank's EP model).
        max_running: requests in flight at once (request slots).
        max_tokens_per_pass: token budget of one pass (``<=`` the EP padded ``max_tokens``).
        chunk_size: largest prompt chunk of one request per pass (``None``: the budget).
        num_kv_slots: KV-cache slots.
        max_len: longest request in positions.
        capture: keep a :class:`RoutedExpertsCapturer` (needed for ``return_routed_experts``).
        recorder: recorder given to the model (``None``: the global one at forward time).
        rank: this rank (reported in results).
        prefix_cache_blocks: prefix-cache capacity in blocks (``None``: no prefix cache).
        block_size: tokens per prefix-cache block.
        label_load: live per-label expert load (:class:`moetrace.label_load.LabelLoad`): each
            finished request that returns routed experts is added under its labels.
        weight_version: the model weights' version, written into the provenance of the
            routes the loop returns (:mod:`moetrace.provenance`).
    """

    def __init__(
        self,
        model: ReferenceMoEModel,
        *,
        max_running: int = 8,
        max_tokens_per_pass: int = 64,
        chunk_size: int | None = None,
        num_kv_slots: int = 1024,
        max_len: int = 256,
        capture: bool = True,
        recorder: Any = None,
        rank: int | None = None,
        prefix_cache_blocks: int | None = None,
        block_size: int = 16,
        label_load: LabelLoad | None = None,
        weight_version: str = "",
    ) -> None:
        ep = model.ep
        if ep is not None and ep.mode == "padded" and max_tokens_per_pass > (ep.max_tokens or 0):
            raise ValueError(f"max_tokens_per_pass={max_tokens_per_pass} exceeds the padded exchange's max_tokens={ep.max_tokens}")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive or None, got {chunk_size}")
        if max_tokens_per_pass < max_running:
            raise ValueError(f"max_tokens_per_pass={max_tokens_per_pass} must be >= max_running={max_running} so every running request can decode")
        self.model = model
        self.max_running, self.max_tokens_per_pass = max_running, max_tokens_per_pass
        self.chunk_size = chunk_size or max_tokens_per_pass
        self.recorder = recorder
        self.rank = ep.ep_rank if ep is not None else (rank or 0)
        self._distributed = ep is not None and ep.ep_size > 1
        self._group = ep.group if ep is not None else None
        device = model.device_
        self.device = device
        self.pool = ReqToTokenPool(max_running, max_len, device)
        self.allocator = KVSlotAllocator(num_kv_slots)
        self.cache = model.new_kv_cache(num_kv_slots)
        c = model.config
        self.capturer = RoutedExpertsCapturer(
            c.num_layers, c.top_k, max_tokens_per_pass, num_kv_slots, device, num_experts=c.num_experts,
            routed_layers=model.moe_layer_ids, provenance=RouteProvenance(rank=self.rank, weight_version=weight_version),
        ) if capture else None
        self._waiting: list[Request] = []
        self._running: list[_Live] = []
        self._reserved = 0
        self._stop = False
        self._step = 0
        self._next_pass_id = 0
        self._finished = 0
        self._total = 0
        self._rids: set[str] = set()
        self._halted = False
        self._admitted: list[str] = []
        self._first: list[str] = []
        self.block_size = block_size
        #: ``("stored" | "evicted", [block hashes])`` since the last :meth:`take_kv_events`.
        self.kv_events: list[tuple[str, list]] = []
        self.prefix_cache = PrefixCache(prefix_cache_blocks, on_evict=self._on_evict) if prefix_cache_blocks else None
        self.label_load = label_load

    # ------------------------------------------------------------------ requests
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests (validated now; errors name the request)."""
        for req in requests:
            prompt_len = len(req.prompt)
            needed = routed_positions(prompt_len, req.max_new_tokens)
            if req.rid in self._rids:
                raise ValueError(f"request id {req.rid!r} was already submitted")
            if prompt_len == 0:
                raise ValueError(f"request {req.rid!r} has an empty prompt; give at least one token")
            if req.max_new_tokens < 0:
                raise ValueError(f"request {req.rid!r}: max_new_tokens must be >= 0")
            if needed > self.pool.max_len or needed > self.allocator.num_slots:
                raise ValueError(f"request {req.rid!r} needs {needed} positions; max_len={self.pool.max_len}, num_kv_slots={self.allocator.num_slots}")
            if req.return_routed_experts and self.prefix_cache is not None:
                raise ValueError(f"request {req.rid!r} asks for routed experts, which the loop does not return with a prefix cache; build it with prefix_cache_blocks=None")
            if req.return_routed_experts and self.capturer is None:
                raise ValueError(f"request {req.rid!r} asks for routed experts but the loop was built with capture=False")
            if not 0 <= req.routed_experts_start_len <= needed:
                raise ValueError(f"request {req.rid!r}: routed_experts_start_len={req.routed_experts_start_len} is outside [0, {needed}] (positions with routing)")
            check_labels(req.labels, f"request {req.rid!r}")
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt):
                raise ValueError(f"request {req.rid!r} has token ids outside [0, vocab_size={vocab})")
            self._rids.add(req.rid)
            self._waiting.append(req)
            self._total += 1
        self._waiting.sort(key=lambda r: r.arrival_step)

    def stop(self) -> None:
        """Ask the loop to stop at the next step (all ranks stop together; running requests end as ``"stopped"``)."""
        self._stop = True

    # ------------------------------------------------------------------ running
    def run(self, requests: Iterable[Request] = (), on_progress: Callable[[Progress], Any] | None = None) -> list[RequestResult]:
        """Submit ``requests``, run until every rank is done (or stopped); return this rank's results."""
        self.submit(requests)
        results: list[RequestResult] = []
        for progress in self.steps():
            results.extend(progress.new_results)
            if on_progress is not None:
                on_progress(progress)
        return results

    def steps(self) -> Iterator[Progress]:
        """Run step by step, yielding a :class:`Progress` after each (drive a progress bar with it).

        Call :meth:`stop` to end early; under EP do not abandon the iterator on
        one rank only (the others would wait in a collective).
        """
        while (progress := self.step()) is not None:
            yield progress

    @property
    def pending(self) -> bool:
        """Requests waiting or running on this rank."""
        return bool(self._waiting or self._running)

    def step(self) -> Progress | None:
        """One step (admit, schedule, forward); ``None`` when every rank is idle or after a stop.

        A server calls it in a loop, :meth:`submit`-ting requests between steps.
        """
        if self._halted:
            return None
        with torch.inference_mode():
            self._admit()
            batch, plan, locs = self._schedule()
            tokens = batch.input_ids.numel()
            any_tokens, any_pending, stop = self._agree(tokens > 0, self.pending, self._stop)
            if stop:
                self._halted = True
                return self._progress(None, tokens, self._stop_all())
            if not any_pending:
                return None
            pass_id = None
            done: list[RequestResult] = []
            if any_tokens:
                pass_id = self._next_pass_id
                self._next_pass_id += 1
                done = self._forward(batch, plan, locs, pass_id)
            self._step += 1
            return self._progress(pass_id, tokens, done)

    def _agree(self, has_tokens: bool, pending: bool, stop: bool) -> tuple[bool, bool, bool]:
        """OR of the three flags over all ranks (one small all_reduce under EP)."""
        if not self._distributed:
            return has_tokens, pending, stop
        flags = torch.tensor([has_tokens, pending, stop], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        has_tokens, pending, stop = (bool(v) for v in flags.tolist())
        return has_tokens, pending, stop

    def _admit(self) -> None:
        cache = self.prefix_cache
        while self._waiting and self._waiting[0].arrival_step <= self._step:
            req = self._waiting[0]
            if len(self._running) >= self.max_running:
                return
            matched = chain_hashes(req.prompt[: len(req.prompt) - 1], self.block_size) if cache is not None else []
            matched = matched[: cache.match(matched)] if cache is not None else []
            cached = len(matched) * self.block_size
            needed = routed_positions(len(req.prompt), req.max_new_tokens) - cached
            if cache is not None:
                cache.pin(matched)
                short = needed - (self.allocator.available - self._reserved)
                if short > 0:
                    cache.evict(-(-short // self.block_size))
            if self.allocator.available - self._reserved < needed:
                if cache is not None:
                    cache.pin(matched, -1)
                return
            self._waiting.pop(0)
            self._reserved += needed
            live = _Live(req, self.pool.alloc(), list(req.prompt), computed=cached, cached=cached, matched=matched)
            if cached:
                assert cache is not None
                cache.touch(matched)
                slots = [s for block in cache.payloads(matched) for s in block]
                self.pool.assign(live.pool_idx, 0, torch.tensor(slots, dtype=torch.int64, device=self.device))
                self.pool.mark_written(live.pool_idx, cached)
            self._admitted.append(req.rid)
            self._running.append(live)

    def _schedule(self) -> tuple[ForwardBatch, list[tuple[_Live, int]], list[int]]:
        """The next pass: batch, ``(request, new tokens)`` plan and the tokens' KV slots (host)."""
        budget = self.max_tokens_per_pass
        plan: list[tuple[_Live, int]] = []
        decoding = [live for live in self._running if live.computed >= len(live.request.prompt)]
        prefilling = [live for live in self._running if live.computed < len(live.request.prompt)]
        for live in decoding:
            plan.append((live, 1))
            budget -= 1
        for live in prefilling:
            if budget <= 0:
                break
            n = min(len(live.request.prompt) - live.computed, self.chunk_size, budget)
            plan.append((live, n))
            budget -= n
        if not plan:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return ForwardBatch(empty, empty, [], self.pool.req_to_token), plan, []
        ids: list[int] = []
        locs: list[int] = []
        segments = []
        for live, n in plan:
            slots = self.allocator.alloc(n)
            self._reserved -= n
            live.kv_slots.extend(slots)
            self.pool.assign(live.pool_idx, live.computed, torch.tensor(slots, dtype=torch.int64, device=self.device))
            segments.append(Segment(live.pool_idx, live.computed, n))
            ids.extend(live.tokens[live.computed : live.computed + n])
            locs.extend(slots)
        batch = ForwardBatch(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(locs, dtype=torch.int64, device=self.device),
            segments,
            self.pool.req_to_token,
        )
        return batch, plan, locs

    def _forward(self, batch: ForwardBatch, plan: list[tuple[_Live, int]], locs: list[int], pass_id: int) -> list[RequestResult]:
        # Capture only passes that carry a request asking for its routed experts.
        capturer = self.capturer if any(live.request.return_routed_experts for live, _ in plan) else None
        logits = self.model.forward_batch(batch, self.cache, recorder=self.recorder, capturer=capturer, forward_pass_id=pass_id,
                                          pass_batch=_pass_batch(plan))
        if capturer is not None:
            capturer.on_forward_end(locs)
        sampled = logits.argmax(-1).tolist() if plan else []
        done = []
        for (live, n), token in zip(plan, sampled, strict=True):
            live.computed += n
            live.pass_ids.append(pass_id)
            self.pool.mark_written(live.pool_idx, live.computed)
            if live.computed == len(live.tokens) and len(live.output) < live.request.max_new_tokens:
                live.output.append(token)
                live.tokens.append(token)
                if len(live.output) == 1:
                    self._first.append(live.request.rid)
            if len(live.output) == live.request.max_new_tokens and live.computed >= len(live.request.prompt):
                done.append(self._finish(live, "length"))
        return done

    def _finish(self, live: _Live, reason: str) -> RequestResult:
        req = live.request
        experts, start, provenance = None, min(req.routed_experts_start_len, live.computed), None
        if req.return_routed_experts:
            assert self.capturer is not None
            experts = self.capturer.get_routed_experts(self.pool, live.pool_idx, live.computed, start)
            recorder = get_recorder() if self.recorder is None else self.recorder
            run_id = recorder.run_id if getattr(recorder, "recording", False) else ""
            provenance = self.capturer.provenance.replace(run_id=run_id)
        self._reserved -= live.needed - len(live.kv_slots)
        self.allocator.free(self._keep_prefix(live) if self.prefix_cache is not None else live.kv_slots)
        self.pool.free(live.pool_idx)
        self._running.remove(live)
        self._finished += 1
        if self.label_load is not None and experts is not None:
            self.label_load.add(req.labels, experts)
        return RequestResult(req.rid, len(req.prompt), list(live.output), experts, start, list(live.pass_ids), reason, self.rank,
                             live.cached, dict(req.labels), provenance)

    def _keep_prefix(self, live: _Live) -> list[int]:
        """Move ``live``'s full computed blocks into the prefix cache; returns the slots to free."""
        cache, bs = self.prefix_cache, self.block_size
        assert cache is not None
        cache.pin(live.matched, -1)
        hashes = chain_hashes(live.tokens[: live.computed], bs)
        own = live.kv_slots  # positions live.cached .. live.computed-1
        payloads = [own[i * bs - live.cached : (i + 1) * bs - live.cached] if i * bs >= live.cached else None for i in range(len(hashes))]
        inserted = cache.insert(hashes, payloads)
        if inserted:
            self.kv_events.append(("stored", [hashes[i] for i in inserted]))
        kept = {s for i in inserted for s in payloads[i]}
        return [s for s in own if s not in kept]

    def _on_evict(self, block: object, slots: list[int]) -> None:
        self.allocator.free(slots)
        if self.kv_events and self.kv_events[-1][0] == "evicted":
            self.kv_events[-1][1].append(block)
        else:
            self.kv_events.append(("evicted", [block]))

    def take_kv_events(self) -> list[tuple[str, list]]:
        """The KV events since the last call (and forget them)."""
        events, self.kv_events = self.kv_events, []
        return events

    def _stop_all(self) -> list[RequestResult]:
        """Release everything; running requests end as ``"stopped"`` with what was computed."""
        results = [self._finish(live, "stopped") for live in list(self._running)]
        self._waiting.clear()
        return results

    def _progress(self, pass_id: int | None, tokens: int, done: list[RequestResult]) -> Progress:
        admitted, self._admitted = tuple(self._admitted), []
        first, self._first = tuple(self._first), []
        return Progress(self._step, pass_id, tokens, self._finished, self._total, len(self._running), len(self._waiting), tuple(done), admitted, first)
