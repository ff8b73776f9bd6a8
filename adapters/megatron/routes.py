"""Read the routes ``[B, S, L, k]`` a Megatron-Core forward took (for ``moetrace diff`` and replay).

::

    with mt.record_routes(model) as rec:
        model(input_ids)                   # input_ids [B, S]
    routes = rec.routes()                  # [B, S, L, k] logical ids, in top-k order

The ids are read at the router's ``router_replay`` slot (as instrumentation reads them),
after any replay: under :func:`~moetrace.adapters.megatron.replay` they are the replayed ids.
Only the latest forward is kept (references to its ``[T, k]`` tensors; read on the host by
:meth:`RoutesRecording.routes`). Megatron's token order ``[S, B]`` is turned back into
batch-major ``[B, S]``. A forward recomputed inside ``backward()`` is ignored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base import HookRegistry
from .hooks import TopKSlot, in_backward
from .layers import find_moe_layers

__all__ = ["RoutesRecording", "record_routes"]


class RoutesRecording:
    """The routes of the latest forward of a model; :meth:`remove` (or the ``with`` block's end) detaches."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = find_moe_layers(model)
        self._ids: list[torch.Tensor | None] = [None] * len(self.layers)
        self._shape: tuple[int, int] | None = None
        self._hooks = HookRegistry()
        for layer in self.layers:
            self._hooks.patch(layer.router, "router_replay", TopKSlot(layer.router.router_replay, on_ids=self._keeper(layer.index)))
        handle = model.register_forward_pre_hook(self._begin, with_kwargs=True)
        self._hooks.on_remove("routes recording", lambda: handle.remove())

    def _keeper(self, index: int) -> Any:
        def keep(ids: torch.Tensor) -> None:
            if not in_backward():
                self._ids[index] = ids

        return keep

    def _begin(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        self._shape = (int(ids.shape[0]), int(ids.shape[1])) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        self._ids = [None] * len(self.layers)

    def routes(self) -> np.ndarray:
        """``[B, S, L, k]`` int64 ids of the latest forward (``-1`` for a layer that did not run)."""
        if self._shape is None:
            raise RuntimeError("no forward with input_ids [B, S] ran since record_routes() was attached")
        batch, seq = self._shape
        k = self.layers[0].top_k
        out = np.full((seq, batch, len(self.layers), k), -1, dtype=np.int64)
        for index, ids in enumerate(self._ids):
            if ids is not None:
                out[:, :, index] = ids.detach().cpu().numpy().reshape(seq, batch, k)
        return np.ascontiguousarray(out.transpose(1, 0, 2, 3))

    def remove(self) -> None:
        self._hooks.remove_all()

    def __enter__(self) -> RoutesRecording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def record_routes(model: torch.nn.Module) -> RoutesRecording:
    """Start keeping the routes of ``model``'s forwards (see the module docstring)."""
    return RoutesRecording(model)
