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
decoding's verify and draft passes, extend lists kept on the device only) get no batch: their
rows are recorded without requests.

DP attention without an all-to-all backend gathers every DP rank's rows into one MoE input
(``sglang.srt.layers.dp_attention``): the ranks' rows lie back to back in DP-rank order, each
rank's padded to ``global_num_tokens_cpu[r]`` (all equal to the largest under ``MAX_LEN``
padding, each rank's own count aligned to the attention TP size under ``SUM_LEN``), in a buffer of
``global_dp_buffer_len`` rows. :func:`gathered_pass_batch` moves this rank's batch to its rows
there. SGLang pads those lists in ``prepare_mlp_sync_batch``, inside the pass, so they are read at
the pass end; a pass run as a CUDA graph replay pads inside the graph runner and leaves them
unset: its rows are recorded without requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moetrace.batch import PassBatch

__all__ = ["gathered_pass_batch", "sglang_pass_batch"]


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


def gathered_pass_batch(local: PassBatch, forward_batch: Any, dp_rank: int) -> PassBatch | None:
    """``local`` (this DP rank's batch, from :func:`sglang_pass_batch` at the pass start) placed at its rows of the
    gathered MoE input: rank ``dp_rank``'s rows start after the padded rows of the ranks before it. Host fields
    only (``global_num_tokens_cpu``, ``global_dp_buffer_len``), read after SGLang padded them; ``None`` when they
    are unset (a CUDA graph replay) or do not describe a buffer that holds the batch."""
    sizes, total = getattr(forward_batch, "global_num_tokens_cpu", None), getattr(forward_batch, "global_dp_buffer_len", None)
    if sizes is None or total is None or not 0 <= dp_rank < len(sizes):
        return None
    sizes = [int(n) for n in sizes]
    extent = int((local.row + local.count).max()) if len(local.count) else 0
    if sum(sizes) != int(total) or extent > sizes[dp_rank]:
        return None
    if local.num_requests == 0:
        return PassBatch.idle(int(total))
    return PassBatch.of(local.request_ids, local.start, local.count, prefill=local.prefill, row=local.row + sum(sizes[:dp_rank]), num_rows=int(total))
