"""SGLang's ``ForwardBatch`` as the recorder reads it: each request's rows of the pass, from host fields only.

The model runner hands its recorder the ``ForwardBatch`` of every pass
(``with_forward_pass(forward_pass_id, forward_batch)``). Its host-side fields say which
request owns which rows of the MoE input, in batch order:

- ``rids``: the engine's request ids (``meta_info["id"]`` of each answer);
- extend (prefill, chunked or not; a prefix-cache hit starts after the cached tokens):
  request ``i`` computes ``extend_seq_lens_cpu[i]`` positions from ``extend_prefix_lens_cpu[i]``;
- decode: one row per request, at position ``seq_lens_cpu[i] - 1``;
- mixed (``--enable-mixed-chunk``): extend lists that also cover the running requests' one
  decode token each; rows of one position after a prefix are counted as decode rows;
- idle (a DP-attention rank with nothing to run): no request rows.

Nothing is read from the device; rows past the requests' own (a CUDA graph's padded batch)
belong to no request. Passes this module cannot describe from host fields (speculative
decoding's verify and draft passes, extend lists kept on the device only, a batch whose
MoE input is gathered from other DP-attention ranks) get no batch: their rows are recorded
without requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moetrace.batch import PassBatch

__all__ = ["sglang_pass_batch"]


def _mode(forward_batch: Any) -> str | None:
    mode = getattr(forward_batch, "forward_mode", None)
    for name in ("idle", "decode", "mixed", "extend"):
        check = getattr(mode, f"is_{name}", None)
        if callable(check) and check():
            return name
    return None


def _rows(forward_batch: Any) -> int:
    ids = getattr(forward_batch, "input_ids", None)
    shape = getattr(ids, "shape", None)
    return int(shape[0]) if shape else 0


def sglang_pass_batch(forward_batch: Any) -> PassBatch | None:
    """The :class:`~moetrace.batch.PassBatch` of an SGLang ``ForwardBatch`` (``None``: not describable from the host)."""
    mode = _mode(forward_batch)
    if mode == "idle":
        return PassBatch.idle(_rows(forward_batch))
    rids = getattr(forward_batch, "rids", None)
    if mode is None or rids is None:
        return None
    rows = _rows(forward_batch)
    if mode == "decode":
        seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
        if seq_lens is None or len(seq_lens) < len(rids):
            return None
        start = np.asarray(seq_lens, dtype=np.int64)[: len(rids)] - 1  # a CPU tensor: a host read, no device sync
        return PassBatch.of(rids, start, np.ones(len(rids), dtype=np.int64), prefill=False, num_rows=max(rows, len(rids)))
    prefix, lengths = getattr(forward_batch, "extend_prefix_lens_cpu", None), getattr(forward_batch, "extend_seq_lens_cpu", None)
    if prefix is None or lengths is None or len(lengths) < len(rids):
        return None
    start = np.asarray(prefix[: len(rids)], dtype=np.int64)
    count = np.asarray(lengths[: len(rids)], dtype=np.int64)
    prefill = True if mode == "extend" else (count > 1) | (start == 0)
    return PassBatch.of(rids, start, count, prefill=prefill, num_rows=max(rows, int(count.sum())))
