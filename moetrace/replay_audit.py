"""Replay audit: did a replayed forward really use the requested experts, and was every router reached?

A replay that silently does nothing (a router never patched, a layer skipped, a fused
kernel that bypasses the hook) trains on the wrong routes without a sign. The audit
reads, for every replay moetrace does (Hugging Face, reference runtime, Megatron-Core),
the experts each (token, layer) row *actually used* from a point the replay does not
write, the layer's own downstream input:

- Hugging Face: the experts module's ``top_k_index`` (its forward pre-hook);
- reference runtime: the ids the router hands its MoE layer (the router's output);
- Megatron-Core: the ``routing_map [T, E]`` the token dispatcher dispatches by.

and compares it with the requested row (the same set of ``k`` experts; order is not
compared, weights come from the live scores). Rows of ``-1`` are not requested. Counting
is on the device (no host sync) into ``[L]`` buffers; :meth:`ReplayAudit.report` reads
them. A forward in which a targeted layer's router was never reached raises
:class:`~moetrace.replay.ReplayError` at the end of that forward (:meth:`end_forward`).
A recomputed forward (activation checkpointing inside ``backward()``) is not counted again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["ReplayAudit", "ReplayAuditReport", "ReplayUnreachedError"]


class ReplayUnreachedError(RuntimeError):
    """A replayed forward never reached the router of a layer it was asked to replay."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class ReplayAuditReport:
    """What the audit saw over every replayed forward.

    Attributes:
        layers: name of each replayed MoE layer ``[L]``.
        requested: ``[L]`` (token, layer) rows with requested ids.
        matched: ``[L]`` of those whose experts actually used equal the requested set.
        unreached: names of layers whose router a forward never reached (each such
            forward also raised).
        forwards: replayed forwards audited.
    """

    layers: tuple[str, ...]
    requested: np.ndarray
    matched: np.ndarray
    unreached: tuple[str, ...] = ()
    forwards: int = 0
    engine: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def layer_share(self) -> np.ndarray:
        """``[L]`` matched / requested (NaN for a layer with nothing requested)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.requested > 0, self.matched / np.maximum(self.requested, 1), np.nan)

    @property
    def share(self) -> float:
        """Matched share of every requested (token, layer) row (1.0 when nothing was requested)."""
        total = int(self.requested.sum())
        return float(self.matched.sum()) / total if total else 1.0

    @property
    def ok(self) -> bool:
        """Every requested row used exactly its requested experts and every targeted router was reached."""
        return not self.unreached and int(self.matched.sum()) == int(self.requested.sum())

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "forwards": self.forwards,
            "share": self.share,
            "ok": self.ok,
            "unreached": list(self.unreached),
            "layers": [
                {"layer": name, "requested": int(r), "matched": int(m), "share": None if r == 0 else float(m) / float(r)}
                for name, r, m in zip(self.layers, self.requested, self.matched, strict=True)
            ],
            **self.extra,
        }

    def check(self) -> ReplayAuditReport:
        """Return ``self`` when :attr:`ok`, else raise :class:`ReplayUnreachedError` / ``AssertionError`` naming the layers."""
        if self.unreached:
            raise ReplayUnreachedError(f"replay never reached the router of {list(self.unreached)}; those layers routed by themselves")
        bad = [f"{name}: {int(m)}/{int(r)}" for name, r, m in zip(self.layers, self.requested, self.matched, strict=True) if m != r]
        if bad:
            raise AssertionError(f"replayed rows that did not use the requested experts (matched/requested): {', '.join(bad)}")
        return self


class ReplayAudit:
    """Device counters of requested and matched rows per MoE layer, and per-forward reach checks.

    Args:
        layers: a name per replayed MoE layer (compact order).
        device: where the counters live (the model's device).
        engine: label for reports.
        observable: per layer, whether an independent point reads the experts it used
            (default: all). An unobservable layer is checked for reach only; its rows are
            not counted as requested, and reports list it under ``unobserved``.
    """

    def __init__(self, layers: Sequence[str], device: torch.device | str, engine: str = "", observable: Sequence[bool] | None = None) -> None:
        self.layers = tuple(layers)
        self.engine = engine
        self.observable = tuple(observable) if observable is not None else (True,) * len(self.layers)
        self._requested = np.zeros(len(self.layers), dtype=np.int64)
        self._matched = torch.zeros(len(self.layers), dtype=torch.int64, device=device)
        self._reached = [0] * len(self.layers)
        self._at_begin: list[int] | None = None
        self._targets: list[tuple[int, int]] = []
        self._unreached: list[str] = []
        self.forwards = 0

    # ---------------------------------------------------------------- per forward (host bookkeeping)
    def begin_forward(self, targets: Sequence[tuple[int, int]]) -> None:
        """A replayed forward starts: ``targets`` are ``(layer, requested rows)`` of the layers it replays."""
        if _in_backward():
            return
        self._targets = [(layer, rows) for layer, rows in targets if rows > 0]
        for layer, rows in self._targets:
            if self.observable[layer]:
                self._requested[layer] += rows
        self._at_begin = list(self._reached)

    def reached(self, layer: int) -> None:
        """The replay answered layer ``layer``'s router (host counter, no device work)."""
        self._reached[layer] += 1

    def end_forward(self) -> None:
        """The forward ended: raise :class:`ReplayUnreachedError` if a targeted router was never reached."""
        if self._at_begin is None or _in_backward():
            return
        before, self._at_begin = self._at_begin, None
        self.forwards += 1
        missed = [self.layers[layer] for layer, _ in self._targets if self._reached[layer] == before[layer]]
        if missed:
            self._unreached.extend(name for name in missed if name not in self._unreached)
            raise ReplayUnreachedError(
                f"this replayed forward never reached the router of {missed}: those layers were not replayed (their "
                "tokens were routed by the model itself, or the layer did not run). Check that the routes' layers are "
                "the model's MoE layers and that each router selects experts through the hook replay installs"
            )

    # ---------------------------------------------------------------- observations (device, no sync)
    def observe_ids(self, layer: int, used: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Layer ``layer`` used ``used [T, k]``; requested ``ids [T, k]`` where ``valid [T, 1]``."""
        if _in_backward():
            return
        same = (used.sort(-1).values == ids.sort(-1).values).all(-1, keepdim=True) & valid
        self._matched[layer] += same.sum()

    def observe_map(self, layer: int, routing_map: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, top_k: int) -> None:
        """Layer ``layer`` dispatched by ``routing_map [T, E]`` (bool); requested ``ids [T, k]`` where ``valid [T, 1]``."""
        if _in_backward():
            return
        chosen = routing_map.gather(1, ids).all(-1, keepdim=True)
        exact = routing_map.sum(-1, keepdim=True) == top_k
        self._matched[layer] += (chosen & exact & valid).sum()

    # ---------------------------------------------------------------- result
    def report(self) -> ReplayAuditReport:
        """The figures so far (reads the device counters)."""
        return ReplayAuditReport(
            layers=self.layers,
            requested=self._requested.copy(),
            matched=self._matched.cpu().numpy().copy(),
            unreached=tuple(self._unreached),
            forwards=self.forwards,
            engine=self.engine,
            extra={"unobserved": [name for name, seen in zip(self.layers, self.observable, strict=True) if not seen]},
        )
