"""Analysis throughput: streaming ``analyze_trace`` vs a one-shot numpy pass, and placement speed.

1. Routing records per second. A ``per_token`` trace (OLMoE-like: 16 MoE
   layers, 64 experts, top-8, skewed routing) and a ``per_pass`` trace are
   analysed by ``moetrace.analysis.analyze_trace`` (chunked reads, bounded
   memory) and by a one-shot numpy baseline that loads the whole stream and
   computes the same counts (totals, co-activation, transitions, per-window
   counts) in vectorised passes. Both are timed interleaved in one process;
   the results are checked equal first. Peak traced memory (tracemalloc) of
   each is reported too.
2. Placement. ``plan_experts`` vs the greedy replicate-then-pack baseline
   on DeepSeek-V3 sizes (61 layers, 256 experts, 288 slots, 8 groups,
   4 nodes, 32 GPUs) and the predicted balancedness of both on the real OLMoE
   layers for several replica counts (the table in docs/analysis.md).

Run: ``.venv/bin/python benchmarks/analysis_throughput.py [--quick]``.
Writes ``benchmarks/results/analysis_throughput.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, write_results

from moetrace import balance
from moetrace.analysis import analyze_trace
from moetrace.data import olmoe_counts
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import plan_experts, predicted_gpu_load
from moetrace.trace import TraceHeader, TraceWriter

LAYERS, EXPERTS, TOP_K, EP = 16, 64, 8, 8
TOKENS_PER_PASS = 256


def _header(mode: str) -> TraceHeader:
    return TraceHeader(mode=mode, id_space="logical", num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=EP, layer_ids=np.arange(LAYERS), physical_to_logical=np.tile(np.arange(EXPERTS), (LAYERS, 1)), model="olmoe-like")


def _stat(writer: TraceWriter, counts: np.ndarray, passes: int, tokens: int, ep: int = EP) -> None:
    writer.write("stat/physical_count", counts[None])
    writer.write("stat/logical_count", counts[None])
    for name, shape in (("invalid_ids", (1, LAYERS)), ("dropped", (1, LAYERS)), ("send_count", (1, LAYERS, ep)), ("recv_count", (1, LAYERS, ep))):
        writer.write(f"stat/{name}", np.zeros(shape, np.int64))
    writer.write("stat/num_passes", np.array([passes]))
    writer.write("stat/num_tokens", np.array([tokens]))


def make_token_trace(path: Path, tokens: int, seed: int = 0) -> None:
    """Skewed top-8 routing with distinct experts per token (Gumbel top-k)."""
    logits = np.log(np.arange(1, EXPERTS + 1, dtype=np.float64) ** -1.2)
    write_token_trace(path, _header("per_token"), tokens, logits, np.random.default_rng(seed))


def write_token_trace(path: Path, header: TraceHeader, tokens: int, logits: np.ndarray, rng: np.random.Generator) -> None:
    """A ``per_token`` trace of ``tokens`` tokens (LAYERS x EXPERTS, top-TOP_K, TOKENS_PER_PASS a pass) and its ``/stat``.

    Each token takes TOP_K distinct experts per layer by Gumbel top-k on ``logits`` ``[EXPERTS]``.
    """
    writer = TraceWriter(path, header)
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    block = 16384
    for start in range(0, tokens, block):
        n = min(block, tokens - start)
        scores = logits[None, None, :] + rng.gumbel(size=(n, LAYERS, EXPERTS))
        ids = np.argpartition(-scores, TOP_K, axis=2)[:, :, :TOP_K].astype(np.int16)
        writer.append("tokens/topk_ids", ids)
        writer.append("tokens/pass_id", (np.arange(start, start + n) // TOKENS_PER_PASS).astype(np.int64))
        writer.append("tokens/position", (np.arange(start, start + n) % TOKENS_PER_PASS).astype(np.int32))
        for layer in range(LAYERS):
            counts[layer] += np.bincount(ids[:, layer].ravel(), minlength=EXPERTS)
    _stat(writer, counts, -(-tokens // TOKENS_PER_PASS), tokens, header.ep_size)
    writer.commit()


def make_pass_trace(path: Path, passes: int, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    p = np.arange(1, EXPERTS + 1, dtype=np.float64) ** -1.2
    writer = TraceWriter(path, _header("per_pass"))
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    block = 4096
    for start in range(0, passes, block):
        n = min(block, passes - start)
        c = rng.multinomial(TOKENS_PER_PASS * TOP_K, p / p.sum(), size=(n, LAYERS)).astype(np.int32)
        writer.append("passes/pass_id", np.arange(start, start + n, dtype=np.int64))
        writer.append("passes/timestamp", np.arange(start, start + n, dtype=np.float64))
        writer.append("passes/num_tokens", np.full(n, TOKENS_PER_PASS, np.int64))
        writer.append("passes/physical_count", c)
        writer.append("passes/invalid_ids", np.zeros((n, LAYERS), np.int32))
        writer.append("passes/send_count", np.zeros((n, LAYERS, EP), np.int32))
        writer.append("passes/recv_count", np.zeros((n, LAYERS, EP), np.int32))
        counts += c.sum(axis=0)
    _stat(writer, counts, passes, passes * TOKENS_PER_PASS)
    writer.commit()


# ---------------------------------------------------------------------------- one-shot baselines
def one_shot_tokens(path: Path, window: int) -> dict[str, np.ndarray]:
    """Load every token at once; same counts as analyze_trace, vectorised over the whole stream."""
    with h5py.File(path, "r") as f:
        ids = f["tokens/topk_ids"][()].astype(np.int64)
        pid = f["tokens/pass_id"][()]
    _, num_layers, k = ids.shape
    e = EXPERTS
    layer = np.arange(num_layers)[None, :]
    totals = np.bincount((layer[:, :, None] * e + ids).ravel(), minlength=num_layers * e).reshape(num_layers, e)
    co = np.zeros(num_layers * e * e, np.int64)
    for i in range(k):
        for j in range(i + 1, k):
            lo, hi = np.minimum(ids[:, :, i], ids[:, :, j]), np.maximum(ids[:, :, i], ids[:, :, j])
            co += np.bincount(((layer * e + lo) * e + hi).ravel(), minlength=num_layers * e * e)
    co = co.reshape(num_layers, e, e)
    co = co + co.transpose(0, 2, 1)
    hop = np.arange(num_layers - 1)[None, :, None]
    trans = np.bincount(((hop * e + ids[:, :-1]) * e + ids[:, 1:]).ravel(), minlength=(num_layers - 1) * e * e).reshape(num_layers - 1, e, e)
    pass_index = np.cumsum(np.concatenate([[0], pid[1:] != pid[:-1]]))
    win = pass_index // window
    per_window = np.bincount(((win[:, None, None] * num_layers + layer[:, :, None]) * e + ids).ravel(), minlength=(win[-1] + 1) * num_layers * e)
    return {"totals": totals, "coactivation": co, "transitions": trans, "windows": per_window.reshape(-1, num_layers, e)}


def one_shot_passes(path: Path, window: int) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        counts = f["passes/physical_count"][()].astype(np.int64)
    n = len(counts)
    starts = np.arange(0, n, window)
    per_window = np.add.reduceat(counts, starts, axis=0)
    js = [balance.js_divergence(per_window[i - 1], per_window[i]).mean() for i in range(1, len(per_window))]
    per_window_balance = [balance.balancedness(balance.rank_load(w, EP)) for w in per_window]
    return {"totals": counts.sum(axis=0), "windows": per_window, "js": np.array(js), "balance": np.array(per_window_balance)}


def _peak(fn) -> int:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def throughput(tmp: Path, tokens: int, passes: int, rounds: int) -> dict[str, object]:
    token_trace, pass_trace = tmp / "tokens.h5", tmp / "passes.h5"
    make_token_trace(token_trace, tokens)
    make_pass_trace(pass_trace, passes)
    window = 64
    # Same numbers first.
    report = analyze_trace(token_trace, window=window)
    ref = one_shot_tokens(token_trace, window)
    assert np.array_equal(report.logical_count, ref["totals"])
    assert np.array_equal(report.coactivation.coactivation, ref["coactivation"])
    assert np.array_equal(report.coactivation.transitions, ref["transitions"])
    expected = [balance.balancedness(balance.rank_load(w, EP)) for w in ref["windows"]]
    assert np.allclose(report.drift.balancedness, expected)
    report_p = analyze_trace(pass_trace, window=window)
    ref_p = one_shot_passes(pass_trace, window)
    assert np.array_equal(report_p.physical_count, ref_p["totals"])
    assert np.allclose(report_p.drift.js_mean[1:], ref_p["js"]) and np.allclose(report_p.drift.balancedness, ref_p["balance"])
    out: dict[str, object] = {}
    for name, path, unit, records, stream, once in (
        ("per_token", token_trace, "tokens", tokens, lambda: analyze_trace(token_trace, window=window), lambda: one_shot_tokens(token_trace, window)),
        ("per_pass", pass_trace, "passes", passes, lambda: analyze_trace(pass_trace, window=window), lambda: one_shot_passes(pass_trace, window)),
    ):
        times = interleaved({"streaming": stream, "one_shot": once}, rounds=rounds, warmup=1)
        with h5py.File(path, "r") as f:
            data = f["tokens/topk_ids" if unit == "tokens" else "passes/physical_count"]
            raw = int(data.size * data.dtype.itemsize)
        out[name] = {
            "records": records,
            "unit": unit,
            "raw_bytes": raw,
            "streaming_s": times["streaming"],
            "one_shot_s": times["one_shot"],
            "streaming_records_per_s": records / times["streaming"],
            "one_shot_records_per_s": records / times["one_shot"],
            "speed_ratio_streaming_over_one_shot": times["one_shot"] / times["streaming"],
            "streaming_peak_bytes": _peak(stream),
            "one_shot_peak_bytes": _peak(once),
        }
    return out


# ---------------------------------------------------------------------------- placement
def placement(rounds: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    weight = rng.lognormal(0, 1.0, size=(61, 256)) * 1000
    args = (288, 8, 4, 32)
    times = interleaved({"moetrace": lambda: plan_experts(weight, *args), "greedy": lambda: greedy_rebalance(weight, *args)}, rounds=rounds, warmup=1)
    plan = plan_experts(weight, *args)
    greedy = balance.balancedness(predicted_gpu_load(weight, greedy_rebalance(weight, *args), 32))
    dsv3 = {"shape": "61 layers x 256 experts, 288 slots, 8 groups, 4 nodes, 32 GPUs", "loads": "lognormal(0, 1)", "moetrace_s": times["moetrace"], "greedy_s": times["greedy"], "balancedness_moetrace": plan.balancedness, "balancedness_greedy": greedy}
    data = olmoe_counts()
    olmoe = np.concatenate([np.asarray(v, dtype=np.float64) for v in data["expert_counts"].values()])  # 18 x 64
    table = []
    for groups, nodes, gpus in ((8, 2, 8), (4, 1, 8), (8, 1, 16)):
        for replicas in (64, 72, 80, 96, 128):
            if replicas % gpus:
                continue
            ours = plan_experts(olmoe, replicas, groups, nodes, gpus)
            base = predicted_gpu_load(olmoe, greedy_rebalance(olmoe, replicas, groups, nodes, gpus), gpus)
            before = balance.balancedness(balance.rank_load(olmoe, gpus))
            table.append({"replicas": replicas, "groups": groups, "nodes": nodes, "gpus": gpus, "hierarchical": ours.hierarchical, "before": before, "greedy": balance.balancedness(base), "moetrace": ours.balancedness, "layers_better": int((ours.gpu_load.max(axis=1) < base.max(axis=1) * (1 - 1e-12)).sum()), "layers_equal": int(np.isclose(ours.gpu_load.max(axis=1), base.max(axis=1), rtol=1e-12).sum())})
    return {"deepseek_v3": dsv3, "olmoe": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller traces, fewer rounds")
    opts = parser.parse_args()
    tokens, passes, rounds = (65536, 4096, 2) if opts.quick else (524288, 32768, 3)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        results = {"throughput": throughput(Path(tmp), tokens, passes, rounds), "placement": placement(rounds)}
    print(f"analysis throughput ({time.perf_counter() - start:.0f} s)")
    print(f"{'trace':10} {'records':>9} {'raw MiB':>8} {'streaming rec/s':>16} {'one-shot rec/s':>15} {'ratio':>6} {'peak MiB s/1':>14}")
    for name, r in results["throughput"].items():
        print(f"{name:10} {r['records']:>9} {r['raw_bytes'] / 2**20:>8.1f} {r['streaming_records_per_s']:>16,.0f} {r['one_shot_records_per_s']:>15,.0f} {r['speed_ratio_streaming_over_one_shot']:>6.2f} {r['streaming_peak_bytes'] / 2**20:>6.1f}/{r['one_shot_peak_bytes'] / 2**20:.1f}")
    d = results["placement"]["deepseek_v3"]
    print(f"placement DeepSeek-V3 sizes: moetrace {d['moetrace_s'] * 1e3:.0f} ms (balancedness {d['balancedness_moetrace']:.4f}), greedy {d['greedy_s'] * 1e3:.0f} ms ({d['balancedness_greedy']:.4f})")
    print(f"{'replicas':>8} {'G/M/K':>8} {'before':>7} {'greedy':>7} {'moetrace':>8} {'better/equal layers':>20}")
    for row in results["placement"]["olmoe"]:
        print(f"{row['replicas']:>8} {row['groups']}/{row['nodes']}/{row['gpus']:<4} {row['before']:>7.4f} {row['greedy']:>7.4f} {row['moetrace']:>8.4f} {row['layers_better']:>10}/{row['layers_equal']}")
    print(f"wrote {write_results('analysis_throughput', {'quick': opts.quick, **results})}")


if __name__ == "__main__":
    main()
