"""Phase timing and stragglers: what each phase costs per rank, and who bounds the step.

Reads a trace's timing (schema v2, ``RecorderConfig(timing=True)``):
``/stat`` aggregates for totals and percentiles, ``/timing`` rows (one per pass
and rank) for the per-pass figures. ``F`` phases (:data:`moetrace.PHASES`),
``L`` layers, ``R`` ranks, ``N`` passes that every rank timed.

Attribution: in an all-to-all a fast rank's exchange time includes waiting for
the slow ones, so ranks are blamed by their **expert** time only; the time a
fast rank spends waiting shows up in its own ``dispatch``/``combine`` (reported
as ``exchange_excess_seconds``). See docs/analysis.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dispatch import exchanged_bytes, remote_copies
from ..timing import PHASES, bucket_quantile
from ..trace.reader import Trace
from ..trace.schema import Attr, Data

__all__ = ["analyze_timing", "per_pass_matrix", "received_tokens"]

_EXPERT, _DISPATCH, _COMBINE = PHASES.index("expert"), PHASES.index("dispatch"), PHASES.index("combine")


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def per_pass_matrix(rows: dict[str, np.ndarray], num_ranks: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``/timing`` rows -> ``(pass_ids [N], {name: [N, R, ...]})`` over the passes every rank timed.

    A per-rank file (``num_ranks == 1``) holds one rank whatever its number.
    """
    pass_ids, index = np.unique(rows["pass_id"], return_inverse=True)
    rank = rows["rank"].astype(np.int64) if num_ranks > 1 else np.zeros(len(index), dtype=np.int64)
    present = np.zeros((len(pass_ids), num_ranks), dtype=bool)
    present[index, rank] = True
    complete = present.all(axis=1)
    out = {}
    for name in ("step", "layer", "phase", "phase_start", "layer_start", "start_unix", "peak_memory"):
        values = rows[name]
        grid = np.full((len(pass_ids), num_ranks, *values.shape[1:]), np.nan)
        grid[index, rank] = values
        out[name] = grid[complete]
    return pass_ids[complete], out


def received_tokens(trace: Trace, pass_ids: np.ndarray, num_ranks: int) -> np.ndarray | None:
    """Token copies routed to each rank's experts ``[N, L, R]`` for ``pass_ids`` (all source ranks), or ``None``.

    From ``/window`` (``stat``), ``/passes`` (``per_pass``) or ``/tokens`` (``per_token``).
    """
    num_layers, experts = trace.num_layers, trace.num_physical_experts
    per_rank = experts // num_ranks
    out = np.zeros((len(pass_ids), num_layers, num_ranks))

    def add(pids: np.ndarray, counts: np.ndarray) -> None:  # counts [M, L, P]
        pos = np.searchsorted(pass_ids, pids)
        ok = (pos < len(pass_ids)) & (pass_ids[np.minimum(pos, len(pass_ids) - 1)] == pids)
        load = counts[ok].reshape(int(ok.sum()), num_layers, num_ranks, per_rank).sum(axis=3)
        np.add.at(out, pos[ok], load)

    if trace.has(Data.WINDOW_PASS_ID):
        window = trace.window()
        for r in range(window.pass_id.shape[0]):
            filled = window.pass_id[r] >= 0
            add(window.pass_id[r][filled], window.physical_count[r][filled])
    elif trace.has(Data.PASSES_PASS_ID):
        for chunk in trace.iter_passes():
            add(chunk.pass_id, chunk.physical_count)
    elif trace.has(Data.TOKENS_TOPK_IDS):
        for chunk in trace.iter_tokens():
            ids = chunk.topk_ids.astype(np.int64)  # [M, L, k]
            pos = np.searchsorted(pass_ids, chunk.pass_id)
            ok = (pos < len(pass_ids)) & (pass_ids[np.minimum(pos, len(pass_ids) - 1)] == chunk.pass_id)
            valid = (ids >= 0) & (ids < experts) & ok[:, None, None]
            m, layer, _ = np.nonzero(valid)
            np.add.at(out, (pos[m], layer, ids[valid] // per_rank), 1)
    else:
        return None
    return out


def _corr(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return _finite(float(np.corrcoef(x, y)[0, 1]))


def _phase_table(stat: dict[str, np.ndarray], labels: list[int]) -> list[dict[str, Any]]:
    """Per rank and phase: total, layer-passes, mean and P50/P95/P99 (from the fixed-bucket histograms)."""
    table = []
    total = stat["phase_seconds_sum"].sum(axis=1)  # [R, F]
    count = stat["phase_count"].sum(axis=1)
    hist = stat["phase_histogram"].sum(axis=1)  # [R, F, B]
    edges = stat["histogram_edges"]
    quantiles = {q: bucket_quantile(hist, q / 100, edges) for q in (50, 95, 99)}
    for r in range(total.shape[0]):
        for f, name in enumerate(PHASES):
            if not count[r, f]:
                continue
            table.append({
                "rank": labels[r], "phase": name, "total_seconds": float(total[r, f]), "layer_passes": int(count[r, f]),
                "mean_seconds": float(total[r, f] / count[r, f]),
                **{f"p{q}_seconds": _finite(float(v[r, f])) for q, v in quantiles.items()},
            })
    return table


def analyze_timing(trace: Trace) -> dict[str, Any] | None:
    """The ``timing`` section of ``moetrace analyze`` (see docs/analysis.md), or ``None`` without timing."""
    if not trace.has_timing:
        return None
    stat = trace.timing_stat()
    rows = trace.timing_rows()
    num_ranks = stat["phase_seconds_sum"].shape[0]
    labels = list(range(num_ranks)) if num_ranks > 1 else [max(int(trace.attrs[Attr.RANK]), 0)]
    pass_ids, grid = per_pass_matrix(rows, num_ranks) if len(rows.get("pass_id", ())) else (np.zeros(0, np.int64), None)
    out: dict[str, Any] = {
        "clock": str(trace.attrs.get(Attr.TIMING_CLOCK, "")),
        "phases": list(PHASES),
        "ranks": num_ranks,
        "passes": len(pass_ids),
        "dropped_passes": [int(x) for x in np.atleast_1d(stat["timing_dropped_passes"])],
        "peak_memory_bytes": [_finite(float(x)) for x in np.atleast_1d(stat["peak_memory_bytes"])],
        "rank_labels": labels,
        "phase_table": _phase_table(stat, labels),
        # [R][L][F] total seconds of each phase in each layer (the /stat sums): where a rank's time goes
        "phase_seconds_by_layer": np.asarray(stat["phase_seconds_sum"], dtype=np.float64).tolist(),
    }
    hidden, width = int(trace.attrs.get(Attr.HIDDEN_SIZE, 0)), int(trace.attrs.get(Attr.DTYPE_BYTES, 0))
    if trace.has(Data.STAT_SEND_COUNT) and hidden and width and num_ranks == trace.ep_size:
        send = trace.send_count()  # [R, L, R]
        exchange_s = stat["phase_seconds_sum"][:, :, [_DISPATCH, _COMBINE]].sum(axis=(1, 2))
        gbps = []
        for r in range(num_ranks):
            sent = exchanged_bytes(int(remote_copies(send[r], r).sum()), hidden, width)
            gbps.append(_finite(sent / exchange_s[r] / 1e9) if exchange_s[r] > 0 else None)
        out["alltoall_gbps"] = gbps
    out["expert_timed"] = bool(stat["phase_count"][..., _EXPERT].any())
    if grid is None or not len(pass_ids) or not out["expert_timed"]:
        return out  # no per-pass rows on every rank, or no expert phase: stragglers cannot be judged
    phase = np.nan_to_num(grid["phase"])  # [N, R, L, F]
    expert = phase[..., _EXPERT]  # [N, R, L]
    step = grid["step"].max(axis=1)  # [N] the slowest rank bounds the step
    expert_pass = expert.sum(axis=2)  # [N, R]
    slowest = np.argmax(expert_pass, axis=1)
    wait = (expert.max(axis=1, keepdims=True) - expert)  # [N, R, L] idle of each rank per layer
    layer_time = np.nan_to_num(grid["layer"]).sum(axis=(0, 2))  # [R]
    out.update({
        "step_seconds": {
            "total": float(step.sum()), "mean": float(step.mean()),
            **{f"p{q}": float(np.percentile(step, q)) for q in (50, 95, 99)},
        },
        "slowest_rank_share": [float(x) for x in np.bincount(slowest, minlength=num_ranks) / len(slowest)],
        "expert_seconds_by_rank": [float(x) for x in expert_pass.sum(axis=0)],
        "wait_seconds": float(wait.mean(axis=1).sum()),
        "wait_share": float(wait.mean(axis=1).sum() / step.sum()) if step.sum() > 0 else None,
        "expert_wait_seconds_by_rank": [float(x) for x in wait.sum(axis=(0, 2))],
        "dispatch_seconds_by_rank": [float(x) for x in phase[..., _DISPATCH].sum(axis=(0, 2))],
        "combine_seconds_by_rank": [float(x) for x in phase[..., _COMBINE].sum(axis=(0, 2))],
        "phase_coverage_by_rank": [_finite(float(p / t)) if t > 0 else None for p, t in zip(phase.sum(axis=(0, 2, 3)), layer_time, strict=True)],
    })
    exchange = phase[..., [_DISPATCH, _COMBINE]].sum(axis=(0, 2, 3))  # [R]
    out["exchange_excess_seconds_by_rank"] = [float(x) for x in exchange - exchange.min()]
    jitter = {}
    for name, f in (("dispatch", _DISPATCH), ("combine", _COMBINE)):
        values = phase[..., f]  # [N, R, L]
        mean = values.mean(axis=(0, 1))
        jitter[name] = [_finite(float(s / m)) if m > 0 else None for s, m in zip(values.std(axis=(0, 1)), mean, strict=True)]
    out["jitter_cv_by_layer"] = jitter
    received = received_tokens(trace, pass_ids, num_ranks) if num_ranks == trace.ep_size else None
    if received is not None:
        out["tokens_vs_expert_corr_by_rank"] = [
            _corr(received[:, :, r].ravel(), expert[:, r, :].ravel()) for r in range(num_ranks)
        ]
    return out
