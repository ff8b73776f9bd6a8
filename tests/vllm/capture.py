"""An independent record of a vLLM model's routing, to check moetrace's counts against.

It uses none of moetrace's hook points: it wraps each router's public
``select_experts`` on the instance and keeps the ids it returns (with the
router logits they came from), and it counts model forwards with a forward
pre-hook, which also keeps each pass's token ids and positions (so that a
row can be matched with the same token of a reference forward). moetrace taps ``capture_fn`` inside ``_select_experts`` and wraps
``model.forward``, so the two see the same routing through different doors.

In a worker process (plugin tests) it is driven through ``llm.apply_model``
with the module-level :func:`install` / :func:`collect` / :func:`remove`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RoutingCapture", "collect", "install", "remove"]


class RoutingCapture:
    """Per forward pass and MoE layer: the top-k ids ``[T, k]`` and router logits ``[T, E]``."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        self.passes = 0
        self.rows: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # per pass: token ids [T], positions [T]
        self._undo: list[Any] = []
        for module in model.modules():
            if isinstance(module, MoERunner):
                self._wrap(module.router, int(module.layer_id))
        self._undo.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True).remove)

    def _on_forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.passes += 1
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        self.inputs.append((ids.detach().to(torch.int64).clone(), positions.detach().to(torch.int64).clone()))

    def _wrap(self, router: Any, layer_id: int) -> None:
        select = router.select_experts

        def select_experts(*args: Any, **kwargs: Any) -> Any:
            weights, ids = select(*args, **kwargs)
            logits = kwargs["router_logits"] if "router_logits" in kwargs else args[1]
            self.rows.append((self.passes - 1, layer_id, ids.detach().to(torch.int64).clone(), logits.detach().float().clone()))
            return weights, ids

        router.select_experts = select_experts
        self._undo.append(lambda: delattr(router, "select_experts"))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def counts(self, layer_ids: tuple[int, ...], num_experts: int) -> np.ndarray:
        """``[passes, L, E]`` tokens routed to each expert, per pass and MoE layer."""
        out = np.zeros((self.passes, len(layer_ids), num_experts), dtype=np.int64)
        column = {layer: i for i, layer in enumerate(layer_ids)}
        for pass_idx, layer, ids, _ in self.rows:
            out[pass_idx, column[layer]] += np.bincount(ids.reshape(-1).numpy(), minlength=num_experts)
        return out

    def tokens(self) -> np.ndarray:
        """``[passes]`` tokens routed in each pass (rows of the first MoE layer)."""
        out = np.zeros(self.passes, dtype=np.int64)
        first = min(layer for _, layer, _, _ in self.rows)
        for pass_idx, layer, ids, _ in self.rows:
            if layer == first:
                out[pass_idx] += ids.shape[0]
        return out

    def topk_violations(self, num_experts: int) -> int:
        """Tokens whose chosen experts are not a top-k of their router logits (0 for real routing)."""
        bad = 0
        for _, _, ids, all_logits in self.rows:
            logits = all_logits[:, :num_experts]  # a fused shared-expert gate may add a column
            chosen = logits.gather(1, ids)
            others = logits.scatter(1, ids, float("-inf"))
            bad += int((chosen.min(dim=1).values < others.max(dim=1).values).sum())
        return bad

    def routes(self, num_experts: int) -> list[dict[str, np.ndarray]]:
        """Every routed row: ``layer``, ``token`` and ``position`` ``[T]`` (the pass's inputs), ``ids [T, k]``
        and the router ``logits [T, E]`` (float32), in the order the routers ran."""
        out = []
        for pass_idx, layer, ids, logits in self.rows:
            token, position = self.inputs[pass_idx]
            out.append({"layer": layer, "token": token[: len(ids)].numpy(), "position": position[: len(ids)].numpy(),
                        "ids": ids.numpy(), "logits": logits[:, :num_experts].numpy()})
        return out

    def summary(self, layer_ids: tuple[int, ...], num_experts: int) -> dict[str, Any]:
        """Plain arrays (picklable) for a test in another process."""
        return {
            "passes": self.passes,
            "counts": self.counts(layer_ids, num_experts),
            "tokens": self.tokens(),
            "topk_violations": self.topk_violations(num_experts),
            "routes": self.routes(num_experts),
        }


_live: RoutingCapture | None = None


def install(model: torch.nn.Module) -> int:
    """Start an independent capture on ``model`` (in the worker); returns its number of MoE routers."""
    global _live
    _live = RoutingCapture(model)
    return len(_live._undo) - 1


def collect(layer_ids: tuple[int, ...], num_experts: int) -> Any:
    """A function for ``llm.apply_model`` that returns the live capture's :meth:`RoutingCapture.summary`."""
    return _Collect(layer_ids, num_experts)


class _Collect:
    def __init__(self, layer_ids: tuple[int, ...], num_experts: int) -> None:
        self.layer_ids, self.num_experts = layer_ids, num_experts

    def __call__(self, model: torch.nn.Module) -> dict[str, Any]:
        assert _live is not None, "install() was not run in this process"
        return _live.summary(self.layer_ids, self.num_experts)


def remove(model: torch.nn.Module) -> None:
    """Remove the live capture's hooks."""
    global _live
    if _live is not None:
        _live.remove()
        _live = None
