"""The batch of a Hugging Face forward as the recorder reads it: batch row = request.

Each ``model.forward`` of a ``generate`` call sees ``[B, S]`` tokens: the prompt (left
padded) at the first pass, one token per row at each decode step. Row ``b * S + s`` of the
pass's MoE input is batch row ``b``'s cache position ``start + s`` (``start``: the cache
length before the pass, a host integer). :class:`RequestNames` turns that and the host
``attention_mask`` into a :class:`~moetrace.batch.PassBatch`: batch row ``b`` is one request,
its position ``p`` is the ``p``-th token its mask keeps (left padding is no position: those
rows belong to no request).

Request ids: the ones given to :meth:`HFInstrumentation.name_requests` for the next
generation (a pass with an empty cache starts one), else ``hf-<generation>-<row>``.

Host only: the mask is read when it is a CPU tensor (a model on CPU, or a mask kept on the
host). A mask on an accelerator is never read (that would synchronise the host with the
device every pass): give the padding then (``name_requests(ids, padding=...)``), or rows
are recorded without requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from moetrace.batch import PassBatch

from ..base import AdapterError

__all__ = ["RequestNames", "cache_length"]

log = logging.getLogger(__name__)


def cache_length(kwargs: dict[str, Any]) -> int:
    """Cache positions before this forward (a host integer: the cache's own length), 0 without a cache."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


def _shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    ids = args[0] if args else kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    shape = ids.shape if isinstance(ids, torch.Tensor) else (embeds.shape[:2] if isinstance(embeds, torch.Tensor) else None)
    return None if shape is None or len(shape) < 2 else (int(shape[0]), int(shape[1]))


class RequestNames:
    """Names batch rows as requests and builds each pass's :class:`PassBatch` from host values."""

    def __init__(self) -> None:
        self._generation = -1
        self._ids: tuple[str, ...] = ()
        self._padding: np.ndarray | None = None
        self._next: tuple[tuple[str, ...], np.ndarray | None] | None = None
        self._warned = False

    def name(self, request_ids: Sequence[object], padding: Sequence[int] | None = None) -> None:
        """Name the rows of the next generation (``padding``: left-pad tokens of each row, when the mask is not on the host)."""
        ids = tuple(str(r) for r in request_ids)
        if len(set(ids)) != len(ids):
            raise AdapterError(f"request ids must be distinct within a batch, got {list(ids)}")
        pads = None if padding is None else np.asarray(padding, dtype=np.int64)
        if pads is not None and (pads.shape != (len(ids),) or (pads < 0).any()):
            raise AdapterError(f"padding must give one count >= 0 per request ({len(ids)}), got {list(np.asarray(padding).tolist())}")
        self._next = (ids, pads)

    def batch_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PassBatch | None:
        """The pass's batch, or ``None`` when its rows cannot be told from host values."""
        shape = _shape(args, kwargs)
        if shape is None:
            return None
        rows, length = shape
        start = cache_length(kwargs)
        if start == 0:
            self._begin(rows)
        if len(self._ids) != rows:
            raise AdapterError(f"name_requests gave {len(self._ids)} request ids but the batch has {rows} rows")
        mask = kwargs.get("attention_mask")
        pad = self._padding
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.device.type == "cpu":
            keep = mask.detach().numpy().astype(bool)
            pad = keep.shape[1] - keep.sum(axis=1)  # left padding: the tokens a row's mask drops come first
        elif isinstance(mask, torch.Tensor) and pad is None:
            if not self._warned:
                log.warning("moetrace: the attention mask is on %s; per_token rows are recorded without their requests "
                            "(give the padding with name_requests(ids, padding=...) to keep them)", mask.device)
                self._warned = True
            return None
        pad = np.zeros(rows, dtype=np.int64) if pad is None else np.asarray(pad, dtype=np.int64)
        first = np.maximum(pad - start, 0).clip(max=length)  # rows of this pass that are padding, at the front
        count = length - first
        return PassBatch.of(self._ids, np.where(count > 0, start + first - pad, 0), count, row=np.arange(rows) * length + first,
                            prefill=start == 0 or length > 1, num_rows=rows * length)

    def _begin(self, rows: int) -> None:
        self._generation += 1
        if self._next is not None:
            self._ids, self._padding = self._next
            self._next = None
        else:
            self._ids = tuple(f"hf-{self._generation}-{row}" for row in range(rows))
            self._padding = None
