"""Per-request routed-experts capture: which experts each token of a request went to.

The request-level chain of DESIGN.md. During a forward pass every MoE layer
calls :meth:`RoutedExpertsCapturer.capture` with its ``topk_ids``; the ids go
into a device buffer ``[max_tokens_per_pass, L, k]`` (row = token of the pass,
``L`` = model layers). At the end of the pass :meth:`~RoutedExpertsCapturer.on_forward_end`
starts ONE asynchronous device-to-host copy of the pass's rows into a staging
buffer (pinned on CUDA, an event marks completion); the rows are scattered
into the host buffer ``[num_kv_slots, L, k]`` at the KV slots the tokens
occupy only when that copy is needed (or its staging buffer is reused).
:meth:`~RoutedExpertsCapturer.get_routed_experts` slices one request's rows
through ``req_to_token`` and waits only for the copies it needs.

Layers never captured (dense layers) read ``-1``, never ``0``.

Token convention (see docs/capture.md): a request with a prompt of ``P``
tokens and ``N`` generated tokens has routing for its ``P + max(N - 1, 0)``
positions that went through a forward pass: every prompt token and every
generated token but the last (the final sampled token is never fed back).

The wire format the captured rows are handed out in is :mod:`moetrace.wire`
(:func:`~moetrace.wire.encode_routed_experts`), which loads no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .config import CaptureConfig
from .devices import resolve_device
from .provenance import RouteProvenance
from .route_checks import RowCheckCounts, row_faults
from .wire import CaptureError

__all__ = ["RoutedExpertsCapturer"]


class _Staged:
    """One pass's rows on their way to the host buffer."""

    __slots__ = ("event", "locs", "rows", "seq")

    def __init__(self, seq: int, rows: torch.Tensor, locs: torch.Tensor, event: Any) -> None:
        self.seq, self.rows, self.locs, self.event = seq, rows, locs, event


class RoutedExpertsCapturer:
    """Device-side capture of top-k ids per token and layer, host buffer indexed by KV slot.

    Args:
        num_layers: model layers ``L`` (model layer ids, dense ones included).
        top_k: ``k``.
        max_tokens_per_pass: largest pass in tokens.
        num_kv_slots: KV-cache slots (host buffer rows).
        device: device of the ``topk_ids`` given to :meth:`capture`.
        staging: passes whose copies may be in flight at once (ring of staging buffers).
        dtype: integer dtype of the buffers (``int16`` holds up to 32767 experts).
        num_experts: experts per layer, for the ``out_of_range`` row check (``None``: not checked).
        routed_layers: the model layers that route (MoE layers), for the ``missing_layer``
            row check (``None``: not checked; dense layers read ``-1``).
        provenance: what the routes handed out come from (run, rank, weight version;
            :mod:`moetrace.provenance`); change it with :meth:`set_provenance` (e.g. after
            a weight update).

    Every request's rows are checked on the host when :meth:`get_routed_experts` hands
    them out (:func:`moetrace.route_checks.row_faults`); :attr:`row_checks` counts the
    rows failing each check (``row_checks.snapshot()``; Prometheus:
    :mod:`moetrace.exporters.route_checks`).
    """

    def __init__(
        self,
        num_layers: int,
        top_k: int,
        max_tokens_per_pass: int,
        num_kv_slots: int,
        device: torch.device | str = "cpu",
        *,
        staging: int = 2,
        dtype: torch.dtype = torch.int16,
        num_experts: int | None = None,
        routed_layers: Sequence[int] | None = None,
        provenance: RouteProvenance | None = None,
    ) -> None:
        self.config = CaptureConfig(num_layers, top_k, max_tokens_per_pass, num_kv_slots, device)
        cfg = self.config
        if staging <= 0:
            raise ValueError(f"staging must be positive, got {staging}")
        if dtype.is_floating_point or dtype.is_complex or not dtype.is_signed:
            raise ValueError(f"dtype must be a signed integer dtype (ids use -1), got {dtype}")
        device = resolve_device(cfg.device)  # "cuda" -> cuda:<current>, as real tensors report it
        self.device = device
        self._cuda = device.type == "cuda"
        shape = (cfg.max_tokens_per_pass, cfg.num_layers, cfg.top_k)
        # Normal tensors even when built under torch.inference_mode(), so they can be updated outside it.
        with torch.inference_mode(False):
            self._device_buf = torch.full(shape, -1, dtype=dtype, device=device)
            self._host = torch.full((cfg.num_kv_slots, cfg.num_layers, cfg.top_k), -1, dtype=dtype, pin_memory=self._cuda)
            self._staging = [torch.full(shape, -1, dtype=dtype, pin_memory=self._cuda) for _ in range(staging)]
        self._pending: list[_Staged | None] = [None] * staging
        self._slot_pass = np.full(cfg.num_kv_slots, -1, dtype=np.int64)  # capture seq that last wrote a slot
        self._seq = 0  # passes ended so far
        self._pass_rows = 0  # largest T captured in the current pass
        if routed_layers is not None and any(not 0 <= layer < cfg.num_layers for layer in routed_layers):
            raise ValueError(f"routed_layers {list(routed_layers)} name layers outside [0, num_layers={cfg.num_layers})")
        self.num_experts = num_experts
        self.routed_layers = None if routed_layers is None else tuple(int(x) for x in routed_layers)
        self.provenance = provenance if provenance is not None else RouteProvenance()
        self.row_checks = RowCheckCounts()

    # ------------------------------------------------------------------ hot path
    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Write one layer's ids ``[T, k]`` for the current pass (device copy; no host sync)."""
        cfg = self.config
        if not 0 <= layer_id < cfg.num_layers:
            raise CaptureError(f"layer_id {layer_id} is outside [0, num_layers={cfg.num_layers})")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != cfg.top_k:
            raise CaptureError(f"topk_ids must be [T, top_k={cfg.top_k}], got {list(topk_ids.shape)}")
        tokens = topk_ids.shape[0]
        if tokens > cfg.max_tokens_per_pass:
            raise CaptureError(f"pass of {tokens} tokens exceeds max_tokens_per_pass={cfg.max_tokens_per_pass}; raise it")
        if topk_ids.device != self.device:
            raise CaptureError(f"topk_ids is on {topk_ids.device}; the capturer was built for {self.device}")
        self._device_buf[:tokens, layer_id].copy_(topk_ids)
        self._pass_rows = max(self._pass_rows, tokens)

    def on_forward_end(self, out_cache_loc: torch.Tensor | Sequence[int]) -> None:
        """End the pass: start the copy of its rows toward KV slots ``out_cache_loc [T]``.

        ``out_cache_loc`` is the scheduler's host copy (a CPU tensor or a list)
        of the KV slot of each token of the pass, in pass order.
        """
        if isinstance(out_cache_loc, torch.Tensor):
            if out_cache_loc.device.type != "cpu":
                raise CaptureError("out_cache_loc must be the scheduler's host copy (a CPU tensor or list); the capturer never reads device values")
            host = out_cache_loc.detach().to(torch.int64).reshape(-1).numpy()
        else:
            host = np.asarray(out_cache_loc, dtype=np.int64).reshape(-1)  # checked in numpy: no tensor value read
        tokens = host.size
        if self._pass_rows > tokens:
            raise CaptureError(f"the pass captured {self._pass_rows} tokens but out_cache_loc has {tokens}")
        cfg = self.config
        if tokens > cfg.max_tokens_per_pass:
            raise CaptureError(f"pass of {tokens} tokens exceeds max_tokens_per_pass={cfg.max_tokens_per_pass}")
        if tokens and (int(host.min()) < 0 or int(host.max()) >= cfg.num_kv_slots):
            raise CaptureError(f"out_cache_loc holds slots outside [0, num_kv_slots={cfg.num_kv_slots})")
        self._pass_rows = 0
        if tokens == 0:
            return
        ring = self._seq % len(self._staging)
        if self._pending[ring] is not None:
            self._land(ring)
        rows = self._staging[ring][:tokens]
        rows.copy_(self._device_buf[:tokens], non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        self._device_buf[:tokens].fill_(-1)  # stream-ordered after the copy
        self._pending[ring] = _Staged(self._seq, rows, torch.from_numpy(host.copy()), event)
        self._slot_pass[host] = self._seq
        self._seq += 1

    def _land(self, ring: int) -> None:
        staged = self._pending[ring]
        assert staged is not None
        if staged.event is not None and not staged.event.query():
            staged.event.synchronize()  # the device is `staging` passes behind: wait (raise staging to wait less)
        self._host.index_copy_(0, staged.locs, staged.rows)
        self._pending[ring] = None

    def _land_upto(self, seq: int) -> None:
        """Scatter every pending pass with sequence number <= ``seq``, oldest first."""
        ready = sorted((s.seq, i) for i, s in enumerate(self._pending) if s is not None and s.seq <= seq)
        for _, ring in ready:
            self._land(ring)

    # ------------------------------------------------------------------ lookup
    def get_routed_experts(self, req_to_token: Any, req_pool_idx: int, seq_len: int, start: int = 0) -> np.ndarray:
        """Routed experts ``[seq_len - start, L, k]`` of positions ``start .. seq_len-1`` of one request.

        Args:
            req_to_token: a :class:`~moetrace.reference.kv.ReqToTokenPool` (checks
                that the slot is live and that ``seq_len`` positions were
                written), or a raw ``[max_requests, max_len]`` tensor (bounds
                checks only: the caller vouches that the slot is live).
            req_pool_idx: the request's slot.
            seq_len: positions with routing (see the token convention).
            start: first position wanted (multi-turn: only the new part).
        """
        table = getattr(req_to_token, "req_to_token", req_to_token)
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise CaptureError("req_to_token must be a ReqToTokenPool or a [max_requests, max_len] tensor")
        if not 0 <= req_pool_idx < table.shape[0]:
            raise CaptureError(f"req_pool_idx {req_pool_idx} is outside [0, {table.shape[0]})")
        if hasattr(req_to_token, "check_live"):
            if not req_to_token.is_live(req_pool_idx):
                raise CaptureError(f"request slot {req_pool_idx} is not live; its rows may belong to another request")
            written = req_to_token.written(req_pool_idx)
            if seq_len > written:
                raise CaptureError(f"seq_len={seq_len} is beyond the {written} positions written for request slot {req_pool_idx}")
        if not 0 <= seq_len <= table.shape[1]:
            raise CaptureError(f"seq_len={seq_len} is outside [0, max_len={table.shape[1]}]")
        if not 0 <= start <= seq_len:
            raise CaptureError(f"start={start} is past the end (seq_len={seq_len}); pass 0 <= start <= seq_len")
        slots = table[req_pool_idx, start:seq_len].cpu()
        cfg = self.config
        if slots.numel() == 0:
            return np.empty((0, cfg.num_layers, cfg.top_k), dtype=self._host.numpy().dtype)
        if int(slots.min()) < 0 or int(slots.max()) >= cfg.num_kv_slots:
            raise CaptureError(f"positions {start}..{seq_len - 1} of request slot {req_pool_idx} hold KV slots outside [0, {cfg.num_kv_slots})")
        writers = self._slot_pass[slots.numpy()]
        if (writers < 0).any():
            raise CaptureError(f"some positions of request slot {req_pool_idx} were never written by a captured pass")
        self._land_upto(int(writers.max()))
        rows = self._host[slots].numpy()
        self.row_checks.add(row_faults(rows, num_experts=self.num_experts, routed_layers=self.routed_layers), rows.shape[0] * rows.shape[1])
        return rows

    def set_provenance(self, **fields: Any) -> RouteProvenance:
        """Change what the routes handed out from now on come from (e.g. ``weight_version="step-12"``)."""
        self.provenance = self.provenance.replace(**fields)
        return self.provenance

    # ------------------------------------------------------------------ introspection
    def nbytes(self) -> int:
        """Bytes held by the device, staging and host buffers (constant for the capturer's life)."""
        tensors = [self._device_buf, self._host, *self._staging]
        return sum(t.numel() * t.element_size() for t in tensors) + self._slot_pass.nbytes

    @property
    def pending(self) -> int:
        """Passes whose rows are not yet in the host buffer (at most ``staging``)."""
        return sum(s is not None for s in self._pending)
