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
        "phase_seconds": np.asarray(timing["phase_seconds_sum"]).tolist(),
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
