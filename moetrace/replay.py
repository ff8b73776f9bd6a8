"""Routing replay: run a model's MoE layers on given expert ids instead of their own top-k.

Rollout routing replay (R3) trains on the experts the inference engine chose.
The replayed ids replace the router's *selection* only: the weights are still
computed from the live router scores, by the router's own code, so the
family's normalisation (softmax over all experts then top-k, renormalised
top-k, sigmoid + bias-free gather, scaling factors...) applies unchanged and
gradients reach the router. Megatron-Core's ``RouterReplay`` does the same by
replacing its top-k function; here the replacement is scoped with a
``TorchFunctionMode`` (:class:`TopKReplay`) active only while one MoE block
runs: inside it, a ``torch.topk`` / ``Tensor.topk`` call over ``[T, E]``
scores with ``k = top_k`` returns ``(scores.gather(-1, ids), ids)`` for the
replayed ``ids``. Every other call runs untouched.

Rows of ``-1`` (padding, a position without routes such as the last token of
a rollout, a prefix-cached token) keep the model's own top-k for that token.

Engines use :func:`attach_block_replay` per MoE block (see
:func:`moetrace.adapters.hf.replay` and :func:`moetrace.reference.replay`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .provenance import ProvenanceError, RouteProvenance, check_weight_version, read_provenance
from .replay_audit import ReplayAudit, ReplayAuditReport
from .routes import RoutesError, check_routes, load_routes, select_route_layers
from .wire import decode_routed_experts

__all__ = [
    "LayerRoutes",
    "ReplayError",
    "ReplayHandle",
    "ReplayState",
    "TopKReplay",
    "attach_block_replay",
    "audit_forwards",
    "check_not_replaying",
    "prepare_routes",
]


class ReplayError(RuntimeError):
    """Replay cannot be applied as asked; the message says why and what to do."""


class LayerRoutes:
    """One MoE layer's replayed ids for one forward shape, on the model's device.

    Attributes:
        ids: ``[T, k]`` int64 ids (``0`` where ``valid`` is false; never used there).
        valid: ``[T, 1]`` bool, rows that carry ids.
        partial: some rows are ``-1`` (the live top-k is needed for them).
        rows: rows that carry ids (host count, for the replay audit).
    """

    def __init__(self, ids: np.ndarray, device: torch.device) -> None:
        valid = (ids >= 0).all(-1, keepdims=True)
        self.partial = not bool(valid.all())
        self.rows = int(valid.sum())
        self.ids = torch.as_tensor(np.where(valid, ids, 0), dtype=torch.int64, device=device)
        self.valid = torch.as_tensor(valid, device=device)


class TopKReplay(TorchFunctionMode):
    """Answers ``topk`` over ``[T, num_experts]`` with ``k = top_k`` from :class:`LayerRoutes`.

    ``hits`` counts the calls answered (a router that never calls ``topk``
    this way cannot be replayed: the caller checks ``hits``).
    """

    def __init__(self, routes: LayerRoutes, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.routes, self.num_experts, self.top_k = routes, num_experts, top_k
        self.hits = 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            answer = self._replay(func, args, kwargs)
            if answer is not None:
                return answer
        return func(*args, **kwargs)

    def _replay(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        scores = args[0] if args else kwargs["input"]
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        routes = self.routes
        if (
            k != self.top_k or not largest or "out" in kwargs or scores.dim() < 1
            or dim % scores.dim() != scores.dim() - 1 or scores.shape[-1] != self.num_experts
            or scores.numel() != routes.ids.shape[0] * self.num_experts
        ):
            return None
        self.hits += 1
        flat = scores.reshape(-1, self.num_experts)
        ids = routes.ids if routes.ids.device == scores.device else routes.ids.to(scores.device)  # layers split over devices
        if routes.partial:
            live = func(*args, **kwargs).indices.reshape(-1, self.top_k)
            ids = torch.where(routes.valid.to(scores.device), ids, live)
        values = flat.gather(1, ids)
        shape = (*scores.shape[:-1], self.top_k)
        return torch.return_types.topk((values.reshape(shape), ids.reshape(shape)))


class ReplayState:
    """The routes of the latest forward, per MoE layer, built once per forward shape.

    ``routes`` is ``[B, S, L, k]``; a forward over ``[B, S]`` tokens uses them
    as they are, one over ``[B, S + 1]`` gets a ``-1`` last position (a
    rollout's final token has no routes). Tokens are batch-major, as MoE
    layers see them (``[B * S, H]``).
    """

    def __init__(self, routes: np.ndarray, device: torch.device) -> None:
        self.routes, self.device = routes, device
        self.by_length: dict[int, list[LayerRoutes]] = {}
        self.current: list[LayerRoutes] | None = None

    def begin(self, batch: int, length: int, cached: int = 0) -> None:
        """Select the routes of a forward over ``[batch, length]`` tokens after ``cached`` cached positions."""
        rows, seq = self.routes.shape[:2]
        if cached:
            raise ReplayError(
                f"this forward continues a KV cache of {cached} positions; replay covers a teacher-forced forward over "
                "the whole sequence (call the model without past_key_values)"
            )
        if batch != rows or length not in (seq, seq + 1):
            raise ReplayError(
                f"the forward has {batch} x {length} tokens but the routes are for {rows} x {seq} positions; give routes "
                f"[{batch}, {length}, layers, k] (or [{batch}, {length - 1}, ...] when the last token has none), -1 where a "
                "position has no routes (padding)"
            )
        if length not in self.by_length:
            routes = self.routes
            if length == seq + 1:
                routes = np.concatenate([routes, np.full((rows, 1, *routes.shape[2:]), -1, dtype=routes.dtype)], axis=1)
            flat = routes.reshape(rows * length, *routes.shape[2:])
            self.by_length[length] = [LayerRoutes(flat[:, layer], self.device) for layer in range(flat.shape[1])]
        self.current = self.by_length[length]

    def layer(self, index: int, name: str) -> LayerRoutes:
        """MoE layer ``index``'s routes for the latest forward.

        They stay valid after that forward returns: activation checkpointing
        runs the blocks again during ``backward()`` and must route them the same way.
        """
        if self.current is None:
            raise ReplayError(f"{name} ran before any forward of the model replay was installed on; call that model's forward")
        return self.current[index]


_REPLAYING: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def check_not_replaying(model: torch.nn.Module) -> None:
    """Raise :class:`ReplayError` when ``model`` already has a live replay (two would fight over each top-k)."""
    if model in _REPLAYING:
        raise ReplayError(f"{type(model).__name__} is already replaying routes; remove() that replay (or leave its with block) first")


class ReplayHandle:
    """A live replay: ``remove()`` (or leaving the ``with`` block) takes every hook off.

    Attributes:
        model: the model replay is installed on.
        routes: ``[B, S, L, k]`` int64 logical ids being replayed (``L`` = MoE layers).
        audit: the :class:`~moetrace.replay_audit.ReplayAudit` of this replay, or ``None``.
    """

    def __init__(self, model: torch.nn.Module, routes: np.ndarray, handles: list[Any], audit: ReplayAudit | None = None) -> None:
        check_not_replaying(model)
        self.model, self.routes, self.audit = model, routes, audit
        self._handles = list(handles)
        _REPLAYING.add(model)

    def audit_report(self) -> ReplayAuditReport:
        """What the replay audit saw so far: matched share per layer, routers never reached (reads device counters)."""
        if self.audit is None:
            raise ReplayError(f"this replay on {type(self.model).__name__} has no audit")
        return self.audit.report()

    @property
    def active(self) -> bool:
        """True until :meth:`remove`."""
        return bool(self._handles)

    def remove(self) -> None:
        """Remove every hook (newest first); the model routes by itself again. Removing twice is harmless."""
        while self._handles:
            self._handles.pop().remove()
        _REPLAYING.discard(self.model)

    def __enter__(self) -> ReplayHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def prepare_routes(
    routes: Any,
    *,
    num_moe_layers: int,
    layer_ids: Sequence[int],
    num_experts: int,
    top_k: int,
    weight_version: str | None = None,
    allow_other_weight_version: bool = False,
) -> np.ndarray:
    """Validate routes for replay and return ``[B, S, num_moe_layers, k]`` int64 logical ids.

    ``routes``: ``[B, S, L, k]`` or ``[S, L, k]`` (batch 1), a numpy array, a
    tensor, a wire payload (``{"data", "dtype", "shape"}``), or the path of a
    routes file / payload / ``.npy`` holding one request (:func:`moetrace.routes.load_routes`). ``L`` is either
    the MoE layers or the model layers (``-1`` rows for dense layers, as a
    capture gives them: the MoE layers ``layer_ids`` are picked).

    ``weight_version``: the weights being trained; routes whose provenance
    (:mod:`moetrace.provenance`) names another weight version are refused unless
    ``allow_other_weight_version``. Routes without provenance (arrays, tensors, files
    written before it) are assumed to be of ``weight_version`` (a logged warning).

    Raises:
        ReplayError: wrong shape, top-k or layer count, invalid rows (physical
            ids, duplicates, rows mixing ``-1`` and ids), or routes of another weight version.
    """
    provenance: RouteProvenance | None = None
    try:
        if isinstance(routes, (str, Path)):
            routes, provenance = _one_request(routes)
        if isinstance(routes, dict):
            provenance = read_provenance(routes, "the replayed routes")
            routes = decode_routed_experts(routes)
        check_weight_version(provenance, weight_version, allow_other=allow_other_weight_version, what="the replayed routes")
    except ProvenanceError as exc:
        raise ReplayError(f"cannot replay: {exc}") from None
    try:
        arr = check_routes(routes, num_experts)
    except RoutesError as exc:
        raise ReplayError(f"cannot replay: {exc}") from None
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ReplayError(f"routes must be [batch, seq, layers, top_k] or [seq, layers, top_k], got {list(arr.shape)}")
    if arr.shape[-1] != top_k:
        raise ReplayError(f"routes have top_k={arr.shape[-1]} but the model routes each token to {top_k} experts")
    layers = arr.shape[-2]
    if layers != num_moe_layers:
        model_layers = max(layer_ids) + 1
        if layers != model_layers:
            raise ReplayError(
                f"routes have {layers} layers; the model has {num_moe_layers} MoE layers (model layer ids {list(layer_ids)}): "
                f"give [.., {num_moe_layers}, {top_k}] (MoE layers) or [.., {model_layers}, {top_k}] (every model layer, -1 for dense ones)"
            )
        dense = np.setdiff1d(np.arange(layers), layer_ids)
        if (arr[..., dense, :] >= 0).any():
            raise ReplayError(f"routes hold expert ids in layers {dense.tolist()}, which are not MoE layers of this model (MoE layers: {list(layer_ids)})")
        arr = select_route_layers(arr, layer_ids)
    return arr


def audit_forwards(model: torch.nn.Module, audit: ReplayAudit, state: ReplayState) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks that open and close the audit of each replayed forward of ``model``.

    Register them after the hook that calls ``state.begin``: the audit's targets are
    the layers whose routes for this forward hold ids.
    """

    def begin(module: torch.nn.Module, args: Any) -> None:
        current = state.current or []
        audit.begin_forward([(index, routes.rows) for index, routes in enumerate(current)])

    def end(module: torch.nn.Module, args: Any, output: Any) -> None:
        audit.end_forward()

    return [model.register_forward_pre_hook(begin), model.register_forward_hook(end)]


def _one_request(path: str | Path) -> tuple[np.ndarray, RouteProvenance | None]:
    """The ``[S, L, k]`` routes of the one request in a routes file (logical ids, from position 0) and their provenance."""
    try:
        routeset = load_routes(path).logical()
    except RoutesError as exc:
        raise ReplayError(f"cannot replay: {exc}") from None
    if len(routeset.requests) != 1:
        raise ReplayError(
            f"{path} holds {len(routeset.requests)} requests; replay one forward's routes at a time: pass "
            "load_routes(path).requests[rid][1], or moetrace.routes.pad_routes over a batch's requests"
        )
    rid, (start, arr) = next(iter(routeset.requests.items()))
    if start:
        raise ReplayError(f"{path}: the request's routes start at position {start}; replay needs them from position 0 (a teacher-forced forward)")
    return arr, routeset.provenance.get(rid)


def attach_block_replay(
    block: torch.nn.Module,
    until: torch.nn.Module | None,
    layer: Callable[[], LayerRoutes | None],
    num_experts: int,
    top_k: int,
    name: str,
    reached: Callable[[], None] | None = None,
) -> list[torch.utils.hooks.RemovableHandle]:
    """Replay inside ``block``'s forward, from its start until ``until`` (the experts module) is called.

    A pre-hook on ``block`` enters :class:`TopKReplay`; a pre-hook on
    ``until`` (or, without one, the end of ``block``'s forward) leaves it, so
    the expert computation itself runs without the mode. ``layer()`` gives
    this block's :class:`LayerRoutes` for the current forward (``None``: no
    replay for this call). A block that did not call ``topk`` over ``[T, E]``
    with ``k = top_k`` before leaving raises :class:`ReplayError`; one that did calls
    ``reached()`` (the replay audit's reach count).
    """
    live: list[TopKReplay] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        routes = layer()
        if routes is None:
            return
        mode = TopKReplay(routes, num_experts, top_k)
        mode.__enter__()
        live.append(mode)

    def leave(*_: Any) -> None:
        if not live:
            return
        mode = live.pop()
        mode.__exit__(None, None, None)
        if mode.hits and reached is not None:
            reached()
        if mode.hits == 0:
            raise ReplayError(
                f"{name} ({type(block).__name__}) did not select experts with torch.topk over [tokens, {num_experts}] "
                f"scores with k={top_k}, so its routing cannot be replayed (see the replay coverage table in docs/integrations/hf.md)"
            )

    handles = [block.register_forward_pre_hook(enter)]
    if until is not None:
        handles.append(until.register_forward_pre_hook(leave))
    handles.append(block.register_forward_hook(leave, always_call=True))
    return handles
