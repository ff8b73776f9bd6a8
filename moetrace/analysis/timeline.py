"""Chrome trace-event JSON of a timed trace, for ui.perfetto.dev and chrome://tracing.

Layout (``R`` ranks, pass ids ``A <= p < B``):

- one process per rank (``pid = rank``, ``process_name`` "rank r");
- tracks (threads) per process: ``step`` (tid 0), ``layer`` (tid 1), then one
  per phase kind in :data:`moetrace.PHASES` order (tid 2..);
- complete (``X``) events: one per (pass, rank) on ``step``, per (pass, layer)
  on ``layer`` and per (pass, layer, phase) on the phase's track, with ``args``
  ``pass``, ``layer`` (model layer id), ``tokens`` (token copies routed to
  this rank's experts in that layer, all source ranks) and ``bytes``
  (``tokens · H · b``, the activations received in dispatch and returned in
  combine; 0 when H is unknown);
- counter (``C``) events "tokens": per (pass, rank), the copies routed to the
  rank in the pass, at the pass start.

One clock for every rank: each pass's device or host offsets are anchored to
the host's unix time at that pass start (``start_unix``), and ``ts`` is
microseconds since the earliest pass start shown (``otherData.epoch_unix``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..timing import PHASES
from ..trace.reader import Trace
from ..trace.schema import Attr
from .timing import per_pass_matrix, received_tokens

__all__ = ["PHASE_TID", "build_timeline"]

#: Track (tid) of each kind of event inside a rank's process.
PHASE_TID = {"step": 0, "layer": 1, **{name: 2 + i for i, name in enumerate(PHASES)}}


def build_timeline(trace: Trace, first: int | None = None, stop: int | None = None) -> dict[str, Any]:
    """The trace-event document for passes ``first <= pass_id < stop`` (either bound may be ``None``).

    Raises:
        ValueError: the trace holds no timing, or no pass in the range was timed on every rank.
    """
    if not trace.has_timing:
        raise ValueError(f"{trace.path}: holds no phase timing; record with RecorderConfig(timing=True) to get a timeline")
    rows = trace.timing_rows()
    keep = np.ones(len(rows["pass_id"]), dtype=bool)
    if first is not None:
        keep &= rows["pass_id"] >= first
    if stop is not None:
        keep &= rows["pass_id"] < stop
    rows = {name: array[keep] for name, array in rows.items()}
    num_ranks = trace.timing_stat()["phase_seconds_sum"].shape[0]
    labels = list(range(num_ranks)) if num_ranks > 1 else [max(int(trace.attrs[Attr.RANK]), 0)]  # a per-rank file: its rank
    pass_ids, grid = per_pass_matrix(rows, num_ranks)
    if not len(pass_ids):
        raise ValueError(f"{trace.path}: no pass in [{first}, {stop}) was timed on every rank; widen --passes")
    layers = trace.layers
    received = received_tokens(trace, pass_ids, num_ranks) if num_ranks == trace.ep_size else None
    per_token_bytes = int(trace.attrs.get(Attr.HIDDEN_SIZE, 0)) * int(trace.attrs.get(Attr.DTYPE_BYTES, 0))
    epoch = float(np.min(grid["start_unix"]))
    events: list[dict[str, Any]] = []
    for pid in labels:
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for name, tid in PHASE_TID.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for n, pass_id in enumerate(pass_ids):
        pid = int(pass_id)
        for r, rank in enumerate(labels):
            base = (grid["start_unix"][n, r] - epoch) * 1e6
            tokens = received[n, :, r] if received is not None else None
            events.append({"name": f"pass {pid}", "cat": "step", "ph": "X", "pid": rank, "tid": PHASE_TID["step"],
                           "ts": base, "dur": grid["step"][n, r] * 1e6, "args": {"pass": pid}})
            if tokens is not None:
                events.append({"name": "tokens", "ph": "C", "pid": rank, "tid": 0, "ts": base, "args": {"tokens": float(tokens.sum())}})
            for i, layer_id in enumerate(layers):
                args = {"pass": pid, "layer": int(layer_id)}
                if tokens is not None:
                    args.update(tokens=int(tokens[i]), bytes=int(tokens[i]) * per_token_bytes)
                start = grid["layer_start"][n, r, i]
                if np.isfinite(start):
                    events.append({"name": f"layer {int(layer_id)}", "cat": "layer", "ph": "X", "pid": rank, "tid": PHASE_TID["layer"],
                                   "ts": base + start * 1e6, "dur": grid["layer"][n, r, i] * 1e6, "args": args})
                for f, phase in enumerate(PHASES):
                    start = grid["phase_start"][n, r, i, f]
                    if np.isfinite(start):
                        events.append({"name": phase, "cat": "phase", "ph": "X", "pid": rank, "tid": PHASE_TID[phase],
                                       "ts": base + start * 1e6, "dur": grid["phase"][n, r, i, f] * 1e6, "args": args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "trace": str(trace.path), "run_id": trace.run_id, "clock": str(trace.attrs.get(Attr.TIMING_CLOCK, "")),
            "epoch_unix": epoch, "passes": [int(pass_ids[0]), int(pass_ids[-1])], "ranks": num_ranks,
        },
    }
