"""Rank functions for the Megatron tests: each runs on every gloo rank of one spawned launch.

One launch runs several checks (spawning a rank imports Megatron, ~5 s), and returns
plain figures that the test asserts on in the parent. Every check compares moetrace's
figures with an independent count of what Megatron computed: a test-side forward
pre-hook on each layer's experts module reads the ``tokens_per_expert`` Megatron hands
its experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..phase_ticks import counting_clock
from . import harness


def _ids(rank: int, batch: int = 2, seq: int = 6, vocab: int = 64, seed: int = 100) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + rank)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training micro-batch: forward, a loss, backward. Returns logits and every parameter's grad."""
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach().clone(), grads


class ExpertInputs:
    """Test-side count of what Megatron's experts receive: ``tokens_per_expert [E_local]`` per layer."""

    def __init__(self, model: harness.MoEStack) -> None:
        self.counts = np.zeros((len(model.layers), model.layers[0].num_local_experts), dtype=np.int64)
        self.handles = [layer.experts.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(model.layers)]

    def _hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
                self.counts[index] += np.asarray(args[1].cpu(), dtype=np.int64)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _all_sum(array: np.ndarray) -> np.ndarray:
    tensor = torch.tensor(np.asarray(array), dtype=torch.int64)
    torch.distributed.all_reduce(tensor)
    return tensor.numpy()


def _all_gather(array: np.ndarray) -> np.ndarray:
    tensor = torch.tensor(np.asarray(array), dtype=torch.int64)
    out = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, tensor)
    return torch.stack(out).numpy()


def instrument_checks(rank: int, world: int, dispatcher: str) -> dict[str, Any]:
    """Counts vs Megatron's own, identical outputs and gradients, hooks without host sync, aux losses, removal."""
    from moetrace.adapters import megatron as mt

    from moetrace.testing import HostSyncError, assert_no_host_sync

    harness.setup_parallel(world)
    model = harness.build(harness.StackSpec(dispatcher=dispatcher))
    ids = _ids(rank)
    base_logits, base_grads = _step(model, ids)

    handle = mt.instrument(model)
    same_handle = mt.instrument(model) is handle
    rec = handle.recorder
    rec.start_record()
    seen = ExpertInputs(model)
    steps = 3
    identical = True
    for _ in range(steps):
        logits, grads = _step(model, ids)
        identical &= torch.equal(logits, base_logits) and grads.keys() == base_grads.keys()
        identical &= all(torch.equal(grads[name], base_grads[name]) for name in grads)
    # the hooks, run under assert_no_host_sync during a real forward
    guarded = []
    for tap in handle.taps:
        for name in ("topk", "dispatched", "received"):
            method = getattr(tap, name)

            def under_guard(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                with assert_no_host_sync():
                    return _method(*args, **kwargs)

            setattr(tap, name, under_guard)
            guarded.append((tap, name))
    _step(model, ids)
    steps += 1
    # negative control: the same guard around a hook that reads a count on the host fails
    sync_caught = False
    tap = handle.taps[0]
    inner = tap.topk

    def syncing(ids_: torch.Tensor) -> None:
        inner(ids_)
        int(ids_.max())

    tap.topk = syncing
    try:
        with assert_no_host_sync():
            syncing(torch.zeros(2, 2, dtype=torch.int64))
    except HostSyncError:
        sync_caught = True
    for tap_, name in guarded:
        del tap_.__dict__[name]
    rec.stop_record()
    snap = rec.snapshot()
    report = handle.training_report()
    layer0 = handle.layers[0]
    local = slice(layer0.local_experts[0], layer0.local_experts[-1] + 1)
    routed_global = _all_sum(np.asarray(snap.logical_count, dtype=np.int64))
    send = np.asarray(snap.send_count, dtype=np.int64)
    recv = np.asarray(snap.recv_count, dtype=np.int64)
    sends, recvs = _all_gather(send), _all_gather(recv)  # [R, L, R]
    seen.remove()
    result = {
        "rank": rank,
        "same_handle": same_handle,
        "identical": bool(identical),
        "sync_caught": sync_caught,
        "passes": rec.num_passes,
        "steps": steps,
        "tokens": int(ids.numel()),
        "routed_local_experts": routed_global[:, local].tolist(),  # moetrace, from the routers of every rank
        "expert_tokens": handle.expert_tokens().tolist(),  # moetrace, from the dispatcher
        "megatron_tokens_per_expert": seen.counts.tolist(),  # Megatron's experts' input
        "rank_routed": np.asarray(snap.logical_count).sum(1).tolist(),  # [L] copies routed from this rank's tokens
        "send_matches_recv": bool((sends == recvs.transpose(2, 1, 0)).all()),
        "recv_total": recv.sum(1).tolist(),
        "aux_loss": report.get("load_balancing_loss", np.array([np.nan])).tolist(),
        "z_loss": report.get("z_loss", np.array([np.nan])).tolist(),
        "balancedness": report["balancedness"].tolist(),
    }
    problems = handle.uninstrument()
    after_logits, _ = _step(model, ids)
    result.update(
        problems=problems,
        hooks_left=handle.num_hooks,
        slot_restored=all(layer.router.router_replay is None for layer in model.layers),
        identical_after=bool(torch.equal(after_logits, base_logits)),
    )
    harness.teardown_parallel()
    return result


def recompute_checks(rank: int, world: int) -> dict[str, Any]:
    """``recompute_modules=["moe"]``: the forward recomputed in backward is seen by the taps but counted once."""
    from moetrace.adapters import megatron as mt

    harness.setup_parallel(world)
    model = harness.build(harness.StackSpec(recompute_moe=True))
    ids = _ids(rank)
    handle = mt.instrument(model)
    calls = {"forward": 0, "backward": 0}
    tap = handle.taps[0]
    inner = tap.topk

    def counting(ids_: torch.Tensor) -> None:
        calls["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
        inner(ids_)

    tap.topk = counting
    seen = ExpertInputs(model)
    handle.recorder.start_record()
    _step(model, ids)
    handle.recorder.stop_record()
    snap = handle.recorder.snapshot()
    out = {
        "router_calls": calls,  # the router really ran again inside backward
        "routed": np.asarray(snap.logical_count).sum(1).tolist(),  # [L] copies counted: tokens x k, once
        "tokens_x_k": int(ids.numel() * model.spec.top_k),
        "expert_tokens": handle.expert_tokens().tolist(),
        "megatron_tokens_per_expert": seen.counts.tolist(),
    }
    handle.uninstrument()
    harness.teardown_parallel()
    return out


def capacity_checks(rank: int, world: int) -> dict[str, Any]:
    """``moe_expert_capacity_factor``: dropped copies equal routed copies less what the experts received."""
    from moetrace.adapters import megatron as mt

    harness.setup_parallel(world)
    model = harness.build(harness.StackSpec(capacity_factor=0.5))
    ids = _ids(rank)
    handle = mt.instrument(model)
    seen = ExpertInputs(model)
    handle.recorder.start_record()
    for _ in range(2):
        _step(model, ids)
    handle.recorder.stop_record()
    snap = handle.recorder.snapshot()
    routed = np.asarray(snap.logical_count, dtype=np.int64).sum(1)
    out = {
        "dropped_global": _all_sum(np.asarray(snap.dropped, dtype=np.int64)).tolist(),  # moetrace, per layer
        "routed_global": _all_sum(routed).tolist(),
        "received_global": _all_sum(seen.counts.sum(1)).tolist(),  # Megatron's experts' input
        "expert_tokens": handle.expert_tokens().tolist(),
        "megatron_tokens_per_expert": seen.counts.tolist(),
    }
    handle.uninstrument()
    harness.teardown_parallel()
    return out


def timing_and_trace(rank: int, world: int, path: str) -> dict[str, Any]:
    """Phase timing on Megatron's boundaries, and a trace dumped with the rank axis, read back."""
    from moetrace.adapters import megatron as mt

    from moetrace import PHASES

    harness.setup_parallel(world)
    model = harness.build(harness.StackSpec())
    ids = _ids(rank)
    with counting_clock():  # phase durations in ticks (tests/phase_ticks.py)
        handle = mt.instrument(model, timing=True)
    handle.recorder.start_record()
    for _ in range(2):
        _step(model, ids)
    handle.recorder.stop_record()
    timing = handle.recorder.snapshot().timing
    written = str(handle.recorder.dump_record(path))
    counts = np.asarray(handle.recorder.snapshot().logical_count).tolist()
    handle.uninstrument()
    harness.teardown_parallel()
    assert timing is not None
    return {
        "phases": list(PHASES),
        "phase_count": np.asarray(timing["phase_count"]).tolist(),  # [L, phases] passes that entered each phase
        "phase_seconds": np.asarray(timing["phase_seconds_sum"]).tolist(),  # [L, phases] ticks of the counting clock
        "path": written,
        "counts": counts,
    }


def run(rank: int, world: int, checks: list[tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
    """Run several checks in one launch (one Megatron import per rank); results by check name."""
    return {name: globals()[name](rank, world, *args) for name, args in checks}


def refusal_checks(rank: int, world: int) -> dict[str, str]:
    """Feature detection refuses what it cannot observe, naming the version and what is missing."""
    from moetrace.adapters import AdapterError
    from moetrace.adapters import megatron as mt

    harness.setup_parallel(world)
    model = harness.build(harness.StackSpec(num_layers=1))
    messages = {}
    for name, damage in (
        ("no_moe", lambda: torch.nn.Linear(2, 2)),
        ("no_router_replay", lambda: _without_router_replay(model)),
        ("flex", lambda: _with_dispatcher(model, object())),
    ):
        try:
            mt.instrument(damage())
        except AdapterError as exc:
            messages[name] = str(exc)
    harness.teardown_parallel()
    return messages


def _without_router_replay(model: harness.MoEStack) -> harness.MoEStack:
    del model.layers[0].router.router_replay
    return model


def _with_dispatcher(model: harness.MoEStack, dispatcher: object) -> harness.MoEStack:
    model.layers[0].router.router_replay = None
    model.layers[0].token_dispatcher = dispatcher
    return model


def _forced_routes(rank: int, batch: int, seq: int, layers: int, experts: int, top_k: int, seed: int = 7) -> np.ndarray:
    """``[B, S, L, k]`` distinct random ids per row, different per rank."""
    gen = np.random.default_rng(seed + rank)
    return np.argsort(gen.random((batch, seq, layers, experts)), axis=-1)[..., :top_k].astype(np.int64)


def _expected_local(routes: np.ndarray, local: slice, experts: int) -> np.ndarray:
    """``[L, E_local]`` copies the local experts must receive when every rank's routes are used (all-reduced)."""
    counts = np.stack([np.bincount(routes[:, :, layer].ravel(), minlength=experts) for layer in range(routes.shape[2])])
    return _all_sum(counts)[:, local]


def _router_grads(model: harness.MoEStack) -> list[torch.Tensor]:
    return [layer.router.weight.grad.detach().clone() for layer in model.layers]


def replay_checks(rank: int, world: int) -> dict[str, Any]:
    """Forced routes are used exactly (Megatron's experts' input), audit 100%, both mechanisms; own routes reproduce."""
    from moetrace.adapters import megatron as mt

    from moetrace.replay_audit import ReplayUnreachedError

    out: dict[str, Any] = {}
    harness.setup_parallel(world)
    ids = _ids(rank)
    batch, seq = ids.shape
    for routing_replay in (False, True):
        model = harness.build(harness.StackSpec(routing_replay=routing_replay))
        spec = model.spec
        local = slice(model.layers[0].local_expert_indices[0], model.layers[0].local_expert_indices[-1] + 1)
        routes = _forced_routes(rank, batch, seq, spec.num_layers, spec.num_experts, spec.top_k)
        seen = ExpertInputs(model)
        with mt.replay(model, routes) as handle:
            _step(model, ids)
            report = handle.audit_report()
        seen.remove()
        grads = _router_grads(model)
        out[f"forced_{routing_replay}"] = {
            "mechanism": handle.mechanism,
            "received": seen.counts.tolist(),  # Megatron's experts' input
            "expected": _expected_local(routes, local, spec.num_experts).tolist(),  # what the forced routes ask
            "audit": report.to_dict(),
            "router_grad_norms": [float(g.norm()) for g in grads],
        }
    # replaying a run's own routes (recorded by Megatron's RouterReplay) reproduces loss and router gradients
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    harness.shims.reset_megatron_state()
    recorder_model = harness.build(harness.StackSpec(routing_replay=True))
    plain = harness.build(harness.StackSpec())  # same seed: the same weights, no RouterReplay
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    own_logits, _ = _step(recorder_model, ids)
    own_grads = _router_grads(recorder_model)
    recorded = [t.clone() for t in RouterReplay.get_recorded_data()]  # [S*B, k] per layer, sequence-major
    RouterReplay.clear_global_router_replay_action()
    own = torch.stack(recorded, 1).reshape(seq, batch, len(recorded), -1).transpose(0, 1).numpy()  # [B, S, L, k]
    base_logits, _ = _step(plain, ids)
    base_grads = _router_grads(plain)
    with mt.replay(plain, own) as handle:
        replay_logits, _ = _step(plain, ids)
        replayed = _router_grads(plain)
        own_report = handle.audit_report()
    with mt.replay(recorder_model, own) as handle:
        rr_logits, _ = _step(recorder_model, ids)
        rr_grads = _router_grads(recorder_model)
        rr_mechanism = handle.mechanism
    out["own"] = {
        "same_weights_same_run": bool(torch.equal(own_logits, base_logits)),
        "logits_equal": bool(torch.equal(replay_logits, base_logits)) and bool(torch.equal(rr_logits, own_logits)),
        "router_grads_equal": all(torch.equal(a, b) for a, b in zip(replayed, base_grads, strict=True))
        and all(torch.equal(a, b) for a, b in zip(rr_grads, own_grads, strict=True)),
        "max_grad_diff": max(float((a - b).abs().max()) for a, b in zip(replayed, base_grads, strict=True)),
        "audit": own_report.to_dict(),
        "router_replay_mechanism": rr_mechanism,
    }
    # negative controls: a skipped layer, and a router that selects without the hook, are never reached
    unreached = {}
    for name, damage in (("skipped_layer", "skip"), ("own_topk_router", "router")):
        model = harness.build(harness.StackSpec())
        if damage == "skip":
            model.skip = {1}
        else:
            _route_without_hook(model.layers[0].router)
        routes = _forced_routes(rank, batch, seq, model.spec.num_layers, model.spec.num_experts, model.spec.top_k)
        with mt.replay(model, routes) as handle:
            try:
                model(ids)
                raised = ""
            except ReplayUnreachedError as exc:
                raised = str(exc)
            report = handle.audit_report()
        unreached[name] = {"raised": raised, "audit": report.to_dict()}
    out["unreached"] = unreached
    # the audit can fail: over capacity, dropped copies are not used, and the share says so
    model = harness.build(harness.StackSpec(capacity_factor=0.5))
    routes = _forced_routes(rank, batch, seq, model.spec.num_layers, model.spec.num_experts, model.spec.top_k)
    with mt.replay(model, routes) as handle:
        _step(model, ids)
        out["capacity_audit"] = handle.audit_report().to_dict()
    # a routes file (one request [S, L, k], batch 1), as SGLang's routed_experts are saved
    import tempfile

    from moetrace.provenance import RouteProvenance
    from moetrace.replay import ReplayError
    from moetrace.routes import save_routes

    with tempfile.TemporaryDirectory() as tmp:
        model = harness.build(harness.StackSpec())
        one = _forced_routes(rank, 1, seq, model.spec.num_layers, model.spec.num_experts, model.spec.top_k)[0]
        path = save_routes(f"{tmp}/routes-{rank}.json", {"req-0": one}, num_experts=model.spec.num_experts,
                           provenance=RouteProvenance(run_id="rollout", rank=rank, weight_version="step-5"))
        try:  # routes of another weight version are refused before anything is installed
            mt.replay(model, str(path), weight_version="step-6")
            out["other_weight_version"] = ""
        except ReplayError as exc:
            out["other_weight_version"] = str(exc)
        seen = ExpertInputs(model)
        with mt.replay(model, str(path), weight_version="step-5") as handle:
            _step(model, ids[:1])
        seen.remove()
        local = slice(model.layers[0].local_expert_indices[0], model.layers[0].local_expert_indices[-1] + 1)
        out["file"] = {
            "audit": handle.audit_report().to_dict(),
            "received": seen.counts.tolist(),
            "expected": _expected_local(one[None], local, model.spec.num_experts).tolist(),
        }
    # partial routes: -1 rows keep the router's own choice and are not audited
    model = harness.build(harness.StackSpec())
    routes = _forced_routes(rank, batch, seq, model.spec.num_layers, model.spec.num_experts, model.spec.top_k)
    routes[:, -1] = -1
    with mt.replay(model, routes) as handle:
        _step(model, ids)
        out["partial"] = {"mechanism": handle.mechanism, "audit": handle.audit_report().to_dict()}
    harness.teardown_parallel()
    return out


def hidden_state_checks(rank: int, world: int) -> dict[str, Any]:
    """Replay into a ``MoELayer`` stack called with hidden states ``[S, B, H]`` positionally, both
    mechanisms: forced routes used exactly (Megatron's experts' input); one token fewer than the
    routes hold is refused at the router, naming it."""
    from moetrace.adapters import megatron as mt

    from moetrace.replay import ReplayError

    harness.setup_parallel(world)
    batch, seq = 2, 6
    out: dict[str, Any] = {}
    for routing_replay in (False, True):
        model = harness.build(harness.StackSpec(routing_replay=routing_replay))
        spec, stack = model.spec, harness.HiddenStack(model.layers)
        local = slice(model.layers[0].local_expert_indices[0], model.layers[0].local_expert_indices[-1] + 1)
        routes = _forced_routes(rank, batch, seq, spec.num_layers, spec.num_experts, spec.top_k, seed=21)
        hidden = torch.randn(seq, batch, spec.hidden, generator=torch.Generator().manual_seed(rank))
        seen = ExpertInputs(model)
        with mt.replay(stack, routes) as handle:
            stack(hidden).sum().backward()
            report = handle.audit_report()
        seen.remove()
        with mt.replay(stack, routes):
            try:
                stack(hidden[:-1])  # [S-1, B, H]: the routers route 10 tokens, the routes hold 12
                refused = ""
            except ReplayError as exc:
                refused = str(exc)
        out[f"hidden_{routing_replay}"] = {
            "mechanism": handle.mechanism,
            "hidden_numel": int(hidden.numel()),
            "received": seen.counts.tolist(),
            "expected": _expected_local(routes, local, spec.num_experts).tolist(),
            "audit": report.to_dict(),
            "refused": refused,
        }
    harness.teardown_parallel()
    return out


def _route_without_hook(router: torch.nn.Module) -> None:
    """A router whose routing picks its top-k itself, never through ``router_replay`` (a custom router)."""

    def routing(logits: torch.Tensor, padding_mask: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.view(-1, router.config.num_moe_experts)
        values, top = torch.topk(logits, router.topk, dim=1)
        probs = torch.zeros_like(logits).scatter(1, top, torch.softmax(values, -1))
        return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)

    router.routing = routing


def _target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` log-probability of each next token (fp32)."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def rollout_divergence(rank: int, world: int) -> dict[str, Any]:
    """One set of weights: routes of a bf16 eval forward (the rollout) against the fp32 training forward, before and after replay."""
    from moetrace.adapters import megatron as mt

    from moetrace.analysis.divergence import route_divergence

    harness.setup_parallel(world)
    spec = harness.StackSpec(num_layers=4, num_experts=8, top_k=2, hidden=64, ffn=64, vocab=128)
    train = harness.build(spec)
    rollout = harness.build(spec, dtype=torch.bfloat16)
    rollout.load_state_dict(train.state_dict())  # the same weights, cast to bf16
    ids = _ids(rank, batch=16, seq=128, vocab=spec.vocab, seed=11)
    rollout.eval()
    with torch.no_grad(), mt.record_routes(rollout) as rec:
        rollout_lp = _target_logprobs(rollout(ids), ids)
        rollout_routes = rec.routes()
    train.train()
    with mt.record_routes(train) as rec:
        train_lp = _target_logprobs(train(ids), ids).detach()
        train_routes = rec.routes()
    before = route_divergence(rollout_routes, train_routes)
    with mt.replay(train, rollout_routes) as handle, mt.record_routes(train) as rec:
        replay_lp = _target_logprobs(train(ids), ids).detach()
        replayed_routes = rec.routes()
        audit = handle.audit_report()
    after = route_divergence(rollout_routes, replayed_routes)
    harness.teardown_parallel()
    gap_before, gap_after = (train_lp - rollout_lp).abs(), (replay_lp - rollout_lp).abs()
    # positions whose routes differed in some layer: the stack has no attention, so the log-prob
    # of token t+1 depends on position t alone
    differ = torch.as_tensor((np.sort(rollout_routes, -1) != np.sort(train_routes, -1)).any(-1).any(-1))  # [B, S]
    affected = differ[:, :-1]
    return {
        "affected_tokens": int(affected.sum()),
        "logprob_gap_affected_before": float(gap_before[affected].mean()) if affected.any() else None,
        "logprob_gap_affected_after": float(gap_after[affected].mean()) if affected.any() else None,
        "tokens": int(ids.numel()),
        "before": {"set_agreement": before.set_agreement.tolist(), "router_agreement": before.router_agreement,
                   "tokens_any_differ": before.tokens_any_differ},
        "after": {"set_agreement": after.set_agreement.tolist(), "router_agreement": after.router_agreement,
                  "tokens_any_differ": after.tokens_any_differ},
        "logprob_gap_before": {"mean": float(gap_before.mean()), "max": float(gap_before.max())},
        "logprob_gap_after": {"mean": float(gap_after.mean()), "max": float(gap_after.max())},
        "audit": audit.to_dict(),
    }
