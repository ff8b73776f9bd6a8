"""Replica evidence from a ``/requests`` table: per-policy summary, "why", plots.

One definition of each figure, used by ``moetrace replicas replay/compare``,
``moetrace analyze`` on a replica trace and the tests:

- ``hit_rate``: prompt tokens served from a prefix cache / prompt tokens
  (``cached_tokens`` as the replica counted them); ``block_hit_rate``: the same
  in blocks (``ceil(cached / block_size)`` of ``ceil(input / block_size)``).
- ``reused_tokens``: sum of ``cached_tokens``.
- ``regret_tokens``: sum over decisions of the best candidate's prefix match
  minus the chosen replica's (Dynamo's "regret": overlap lost by not picking the
  best-overlap replica), at decision time.
- ``load_max_mean``: requests of the busiest replica / mean requests per replica.
- ``wait_*`` / ``ttft_*``: percentiles (s) of queue wait (arrival to prefill start)
  and time to first token (arrival to first token), finished requests only.
- ``makespan``: last finish - first arrival (s); ``migrations``: session moves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..trace.replica_requests import RequestTable

__all__ = ["compare_table", "load_over_time", "plot_load", "plot_ttft_cdf", "summarize", "why", "why_text"]


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(table: RequestTable) -> dict[str, Any]:
    """The evidence of one recorded run (see the module docstring for each figure)."""
    q = table.requests
    done = q["finished"] == 1
    inp, cached = q["input_tokens"], np.where(done, q["cached_tokens"], 0)
    bs = table.block_size
    per_replica = np.bincount(q["replica"][q["replica"] >= 0], minlength=table.num_replicas)
    policies = sorted({table.policies[p] for p in q["policy"] if p >= 0})
    reasons = {table.reasons[c]: int(n) for c, n in zip(*np.unique(q["reason"][q["reason"] >= 0], return_counts=True), strict=True)}
    wait, ttft = q["queue_wait"][done], q["ttft"][done]
    out: dict[str, Any] = {
        "policy": "+".join(policies) or "-",
        "requests": len(table),
        "finished": int(done.sum()),
        "replicas": table.num_replicas,
        "input_tokens": int(inp.sum()),
        "reused_tokens": int(cached.sum()),
        "hit_rate": float(cached.sum() / max(inp[done].sum(), 1)),
        "block_hit_rate": float(np.ceil(cached / bs).sum() / max(np.ceil(inp[done] / bs).sum(), 1)) if bs else float("nan"),
        "regret_tokens": int((q["best_tokens"] - q["predicted_tokens"])[q["replica"] >= 0].sum()),
        "requests_per_replica": per_replica.tolist(),
        "load_max_mean": float(per_replica.max() / per_replica.mean()) if per_replica.sum() else float("nan"),
        "reasons": reasons,
        "migrations": len(table.migrations["time"]),
        "makespan": float(np.nanmax(q["finish"]) - np.nanmin(q["arrival"])) if done.any() else float("nan"),
        "ttft_mean": float(ttft.mean()) if len(ttft) else float("nan"),
        "clock": table.clock,
    }
    for name, values in (("wait", wait), ("ttft", ttft)):
        for p in (50, 95, 99):
            out[f"{name}_p{p}"] = _pct(values, p)
    return out


def _fmt_s(x: float) -> str:
    return "-" if x != x else (f"{x:.3g}" if x < 100 else f"{x:.0f}")


def compare_table(rows: list[dict[str, Any]]) -> str:
    """Two tables within 80 columns: cache evidence, then latency evidence (one row per run)."""
    lines = [f"{'policy':<21}{'hit%':>6}{'blk%':>6}{'reused tok':>11}{'regret tok':>12}{'ld max/mean':>12}{'migr':>6}{'reqs':>6}"]
    for r in rows:
        lines.append(f"{r['policy'][:20]:<21}{100 * r['hit_rate']:>6.1f}{100 * r['block_hit_rate']:>6.1f}{r['reused_tokens']:>11}"
                     f"{r['regret_tokens']:>12}{r['load_max_mean']:>12.2f}{r['migrations']:>6}{r['finished']:>6}")
    lines.append("")
    lines.append(f"{'policy (s)':<21}{'wait50':>7}{'wait95':>7}{'wait99':>7}{'ttft':>7}{'ttft50':>7}{'ttft95':>7}{'ttft99':>7}{'makespan':>9}")
    for r in rows:
        lines.append(f"{r['policy'][:20]:<21}" + "".join(f"{_fmt_s(r[k]):>7}" for k in ("wait_p50", "wait_p95", "wait_p99", "ttft_mean", "ttft_p50", "ttft_p95", "ttft_p99"))
                     + f"{_fmt_s(r['makespan']):>9}")
    return "\n".join(lines)


def why(table: RequestTable, request_id: str) -> dict[str, Any]:
    """Why ``request_id`` went where it went: its outcome, the rule, and every candidate's signals."""
    i = table.index_of(request_id)
    q, c = table.requests, table.candidates
    start, count = int(q["cand_start"][i]), int(q["cand_count"][i])
    cands = [{k: (v[j].item() if hasattr(v[j], "item") else v[j]) for k, v in c.items() if k != "request_seq"} for j in range(start, start + count)]
    row = {k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in q.items() if k not in ("cand_start", "cand_count")}
    row["policy"] = table.policies[row["policy"]] if row["policy"] >= 0 else None
    row["reason"] = table.reasons[row["reason"]] if row["reason"] >= 0 else None
    row["regret_tokens"] = row["best_tokens"] - row["predicted_tokens"]
    return {"request": row, "candidates": cands}


_RULES = {
    "round_robin": "next replica in turn", "random": "uniform random draw",
    "shortest_queue": "fewest requests waiting + running",
    "prefix_match": "longest prefix match, match rate above cache_threshold",
    "smallest_cache": "match rate at or below cache_threshold: replica with the fewest cached blocks",
    "imbalance_fallback": "load imbalance past both thresholds: least loaded replica",
    "session_owner": "the session's replica", "new_session": "new session: shortest queue",
    "session_migrated": "owner overloaded past migrate_threshold: session moved to the least loaded replica",
    "min_est_ttft": "smallest estimated TTFT = queue wait + prefill of the uncached part",
    "min_kv_cost": "smallest w * prefill blocks + decode blocks", "other": "an external router's decision",
}


def why_text(answer: dict[str, Any]) -> str:
    """``why`` as text within 80 columns."""
    r = answer["request"]
    lines = [
        f"request {r['id']} -> replica {r['replica']}  policy={r['policy']} reason={r['reason']}",
        f"  rule: {_RULES.get(r['reason'] or '', '-')}",
        f"  input {r['input_tokens']} tok, cached {r['cached_tokens']} tok (as the replica counted)",
        f"  prefix match: chosen {r['predicted_tokens']}, best {r['best_tokens']}, regret {r['regret_tokens']} tok",
        f"  wait {_fmt_s(r['queue_wait'])} s, TTFT {_fmt_s(r['ttft'])} s, e2e {_fmt_s(r['e2e'])} s, output {r['output_tokens']} tok"
        + (f", session {r['session']}" if r["session"] else ""),
        f"{'':2}{'replica':>7}{'queue':>7}{'run':>5}{'inflight':>10}{'match blk':>10}{'match tok':>10}{'owner':>6}{'est ttft':>10}{'score':>10}",
    ]
    for c in answer["candidates"]:
        mark = "*" if c["replica"] == r["replica"] else " "
        lines.append(f"{mark:2}{c['replica']:>7}{c['queue']:>7}{c['running']:>5}{c['inflight_tokens']:>10}{c['match_blocks']:>10}"
                     f"{c['match_tokens']:>10}{'yes' if c['session_owner'] else '-':>6}{_fmt_s(c['est_ttft']):>10}{_fmt_s(c['score']):>10}")
    return "\n".join(lines)


def load_over_time(table: RequestTable, bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Requests in each replica (routed, not finished) over time: ``(times [bins], load [R, bins])``."""
    q = table.requests
    ok = q["replica"] >= 0
    arr, fin, rep = q["arrival"][ok], q["finish"][ok], q["replica"][ok]
    end = float(np.nanmax(fin)) if np.isfinite(fin).any() else float(arr.max())
    fin = np.where(np.isfinite(fin), fin, end)
    times = np.linspace(float(arr.min()), end, bins)
    load = np.zeros((table.num_replicas, bins), np.int64)
    for r in range(table.num_replicas):
        m = rep == r
        load[r] = np.searchsorted(np.sort(arr[m]), times, side="right") - np.searchsorted(np.sort(fin[m]), times, side="right")
    return times, load


def plot_load(table: RequestTable, path: str | Path) -> Path:
    """Per-replica load over time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times, load = load_over_time(table)
    fig, ax = plt.subplots(figsize=(9, 4))
    for r in range(load.shape[0]):
        ax.plot(times - times[0], load[r], lw=0.8, label=f"replica {r}")
    ax.set_xlabel(f"time ({table.clock} s)")
    ax.set_ylabel("requests in replica")
    ax.set_title(f"Per-replica load ({summarize(table)['policy']})")
    if load.shape[0] <= 16:
        ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_ttft_cdf(tables: dict[str, RequestTable], path: str | Path) -> Path:
    """TTFT CDF per policy (PNG, log time axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, table in tables.items():
        q = table.requests
        ttft = np.sort(q["ttft"][q["finished"] == 1])
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
