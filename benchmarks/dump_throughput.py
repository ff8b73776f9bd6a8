"""Trace write throughput (MB/s of raw array bytes) vs a raw ``numpy.save`` of the same array.

Run: ``.venv/bin/python benchmarks/dump_throughput.py [--quick]``

- ``stat`` dump: a full window of per-pass counts ``[W, L, P]`` int32 (DeepSeek-V3-like
  L=61, P=256) plus totals; timed ``dump_record`` (temp file, gzip+shuffle, fsync,
  rename) against ``numpy.save`` of the window array (no fsync).
- ``per_token`` stream + dump: every token's ``[L, k]`` ids streamed by the background
  writer while passes run, then ``dump_record``; timed from the first pass to the file
  in place, against ``numpy.save`` of the same ``[M, L, k]`` int16 array. The routing is
  skewed (Zipf) like real routing, which is what compression sees in practice.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_results

from moetrace import ExpertDistributionRecorder, RecorderConfig


def zipf_ids(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """``[tokens, top_k]`` distinct expert ids drawn with Zipf-like popularity."""
    weights = 1.0 / np.arange(1, experts + 1)
    keys = rng.random((tokens, experts)) ** (1.0 / weights)  # weighted sampling without replacement
    return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int64)


def timed_numpy_save(array: np.ndarray, path: Path) -> float:
    start = time.perf_counter()
    np.save(path, array)
    return time.perf_counter() - start


def stat_dump(tmp: Path, window: int) -> dict[str, float]:
    layers, experts = 61, 256
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=experts, top_k=8, window=window, output_dir=tmp))
    rec.start_record()
    ids = torch.as_tensor(zipf_ids(np.random.default_rng(0), 256, experts, 8))
    for _ in range(window):
        with rec.with_forward_pass():
            for layer in range(layers):
                rec.on_select_experts(ids, layer=layer)
    start = time.perf_counter()
    path = rec.dump_record(tmp / "stat.h5")
    dump_s = time.perf_counter() - start
    array = rec._window.counts.numpy()
    raw = array.nbytes
    save_s = timed_numpy_save(array, tmp / "stat.npy")
    return {"raw_mb": raw / 1e6, "file_mb": path.stat().st_size / 1e6, "moetrace_mb_s": raw / 1e6 / dump_s, "numpy_mb_s": raw / 1e6 / save_s, "ratio": save_s / dump_s}


def token_stream(tmp: Path, tokens_total: int) -> dict[str, float]:
    layers, experts, top_k, per_pass = 16, 64, 8, 2048
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=experts, top_k=top_k, mode="per_token", output_dir=tmp, max_tokens_per_pass=per_pass))
    rng = np.random.default_rng(1)
    routes = [torch.as_tensor(zipf_ids(rng, per_pass, experts, top_k)) for _ in range(layers)]
    passes = tokens_total // per_pass
    rec.start_record()
    start = time.perf_counter()
    for _ in range(passes):
        with rec.with_forward_pass():
            for layer in range(layers):
                rec.on_select_experts(routes[layer], layer=layer)
    path = rec.dump_record(tmp / "tokens.h5")
    total_s = time.perf_counter() - start
    array = np.tile(np.stack([r.numpy() for r in routes], axis=1).astype(np.int16), (passes, 1, 1))
    raw = array.nbytes
    save_s = timed_numpy_save(array, tmp / "tokens.npy")
    return {"raw_mb": raw / 1e6, "file_mb": path.stat().st_size / 1e6, "moetrace_mb_s": raw / 1e6 / total_s, "numpy_mb_s": raw / 1e6 / save_s, "ratio": save_s / total_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller arrays")
    args = parser.parse_args()
    window, tokens = (64, 65536) if args.quick else (256, 262144)
    with tempfile.TemporaryDirectory() as tmp:
        results = {"stat_dump": stat_dump(Path(tmp), window), "per_token_record_stream_dump": token_stream(Path(tmp), tokens)}
    print(f"{'what':<28}{'raw MB':>9}{'file MB':>9}{'moetrace MB/s':>15}{'numpy.save MB/s':>17}{'moetrace/numpy':>16}")
    for name, r in results.items():
        print(f"{name:<28}{r['raw_mb']:>9.1f}{r['file_mb']:>9.1f}{r['moetrace_mb_s']:>15.1f}{r['numpy_mb_s']:>17.1f}{r['ratio']:>16.2f}")
    print(f"wrote {write_results('dump_throughput', results)}")


if __name__ == "__main__":
    main()
