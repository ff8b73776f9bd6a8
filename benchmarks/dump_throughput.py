"""Streaming and dump throughput, per mode and per compression, side by side with numpy.save and a memory copy.

Run: ``.venv/bin/python benchmarks/dump_throughput.py [--quick] [--checksums]``

``--checksums`` measures only what checksums cost (``moetrace.trace.integrity``): each
per_token variant and the stat dump with and without them, interleaved, side by side.

Everything is measured in one process, one variant after the other, against
baselines taken in the same run on the same array:

- ``per_token``: every token's ``[L, k]`` ids (L=16, k=8, E=64: int8 ids; Zipf-skewed
  routing, which is what compression sees in practice) recorded through the hooks,
  streamed by the background writer into rotating segments and dumped; timed from the
  first pass to the trace in place. Per compression, plus: rotation into many segments
  (``segment_bytes`` 8 MiB, the dump joins them), ``on_overflow="drop"`` (what the
  forward keeps when the writer cannot), and the hooks alone (``stat`` mode, nothing
  streamed) as the ceiling. Figures: million ids/s, MB/s of raw ids as int16 (the unit
  of the issue's 26 MB/s and 150 MB/s figures: 2 bytes per id) and as stored (int8),
  file size, segments, RSS growth (bounded memory); variants interleaved over 3 rounds,
  the median kept. ``--versus DIR`` also times the default ``per_token`` path of an
  older moetrace source tree (``git archive <commit> | tar -x -C DIR``) against this one,
  alternating fresh processes (median of 5).
- baselines for the same ``[M, L, k]`` int8 array: ``numpy.save`` (no fsync) and a raw
  memory copy (``numpy.copyto`` into a preallocated array).
- ``per_pass``: ``[L, P]`` counts per pass (DeepSeek-V3-like L=61, P=256), per compression.
- ``stat`` dump: a full window ``[W, L, P]`` int32 plus totals, per compression, against
  ``numpy.save`` of the window array without and with ``fsync`` (the dump fsyncs):
  medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import interleaved, write_results

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import open_trace
from moetrace.trace.integrity import unsealed

LAYERS, EXPERTS, TOP_K, PER_PASS = 16, 64, 8, 2048


def zipf_ids(rng: np.random.Generator, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """``[tokens, top_k]`` distinct expert ids drawn with Zipf-like popularity."""
    weights = 1.0 / np.arange(1, experts + 1)
    keys = rng.random((tokens, experts)) ** (1.0 / weights)  # weighted sampling without replacement
    return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int64)


def compressions() -> list[str]:
    names = ["none", "lzf", "gzip:1"]
    try:
        import hdf5plugin  # noqa: F401
    except ImportError:
        return names
    return [*names, "zstd:1", "blosc2:5"]


def token_stream(tmp: Path, tokens_total: int, mode: str = "per_token", checksums: bool = True, **config: object) -> dict[str, float]:
    """Record ``tokens_total`` tokens through the hooks (and the writer) and dump; returns the figures.
    ``checksums=False`` writes without them (``moetrace.trace.integrity.unsealed``), for the cost ratio."""
    with contextlib.nullcontext() if checksums else unsealed():
        return _token_stream(tmp, tokens_total, mode, **config)


def _token_stream(tmp: Path, tokens_total: int, mode: str, **config: object) -> dict[str, float]:
    rng = np.random.default_rng(1)
    routes = [torch.as_tensor(zipf_ids(rng, PER_PASS, EXPERTS, TOP_K)) for _ in range(LAYERS)]
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp, max_tokens_per_pass=PER_PASS, **config))  # type: ignore[arg-type]
    passes = tokens_total // PER_PASS
    process = psutil.Process()
    gc.collect()
    rss0 = process.memory_info().rss
    rec.start_record()
    start = time.perf_counter()
    for _ in range(passes):
        with rec.with_forward_pass():
            for layer in range(LAYERS):
                rec.on_select_experts(routes[layer], layer=layer)
    recorded = time.perf_counter()
    segments = len(list(tmp.glob(".moetrace-*-seg*.h5")))
    path = rec.dump_record(tmp / f"{mode}.h5")
    total = time.perf_counter() - start
    rss = process.memory_info().rss - rss0
    ids = passes * PER_PASS * LAYERS * TOP_K
    with open_trace(path) as trace:
        kept = int(trace.num_passes().sum())
    out = {
        "seconds": total, "record_seconds": recorded - start, "dump_seconds": total - (recorded - start),
        "mids_per_s": ids / total / 1e6, "mb_s_int16": 2 * ids / total / 1e6, "mb_s_stored": ids / total / 1e6,
        "file_mb": path.stat().st_size / 1e6, "raw_mb_stored": ids / 1e6, "segments_at_dump": segments + 1,
        "rss_growth_mb": rss / 1e6, "dropped_passes": rec.dropped_passes, "kept_passes": kept, "passes": passes,
    }
    path.unlink()
    return out


def baselines(tmp: Path, tokens_total: int) -> dict[str, float]:
    """numpy.save and a memory copy of the same ``[M, L, k]`` int8 array."""
    rng = np.random.default_rng(1)
    routes = np.stack([zipf_ids(rng, PER_PASS, EXPERTS, TOP_K) for _ in range(LAYERS)], axis=1).astype(np.int8)
    array = np.tile(routes, (tokens_total // PER_PASS, 1, 1))
    ids = array.size
    start = time.perf_counter()
    np.save(tmp / "tokens.npy", array)
    save_s = time.perf_counter() - start
    (tmp / "tokens.npy").unlink()
    target = np.empty_like(array)
    np.copyto(target, array)  # touch the pages first
    start = time.perf_counter()
    np.copyto(target, array)
    copy_s = time.perf_counter() - start
    return {"numpy_save_mids_per_s": ids / save_s / 1e6, "numpy_save_mb_s_int16": 2 * ids / save_s / 1e6,
            "memcpy_mids_per_s": ids / copy_s / 1e6, "memcpy_mb_s_int16": 2 * ids / copy_s / 1e6}


def pass_stream(tmp: Path, passes: int, compression: str) -> dict[str, float]:
    layers, experts = 61, 256
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=experts, top_k=8, mode="per_pass", output_dir=tmp, compression=compression))
    ids = torch.as_tensor(zipf_ids(np.random.default_rng(0), 256, experts, 8))
    rec.start_record()
    start = time.perf_counter()
    for _ in range(passes):
        with rec.with_forward_pass():
            for layer in range(layers):
                rec.on_select_experts(ids, layer=layer)
    path = rec.dump_record(tmp / "passes.h5")
    total = time.perf_counter() - start
    raw = passes * layers * experts * 4  # the [N, L, P] int32 counts
    out = {"passes_per_s": passes / total, "mb_s": raw / total / 1e6, "raw_mb": raw / 1e6, "file_mb": path.stat().st_size / 1e6}
    path.unlink()
    return out


def stat_dump(tmp: Path, window: int, compression: str, rounds: int) -> dict[str, float]:
    """Median of ``rounds`` interleaved dumps of one full window vs ``numpy.save`` (with and without fsync)."""
    layers, experts = 61, 256
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=experts, top_k=8, window=window, output_dir=tmp, compression=compression, segment_seconds=0))
    rec.start_record()
    ids = torch.as_tensor(zipf_ids(np.random.default_rng(0), 256, experts, 8))
    for _ in range(window):
        with rec.with_forward_pass():
            for layer in range(layers):
                rec.on_select_experts(ids, layer=layer)
    array = rec._sink.counts.numpy()

    def save(sync: bool) -> None:
        with open(tmp / "stat.npy", "wb") as fh:
            np.save(fh, array)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())

    def dump_unsealed() -> None:
        with unsealed():
            rec.dump_record(tmp / "stat.h5")

    times = interleaved({"dump": lambda: rec.dump_record(tmp / "stat.h5"), "dump_no_checksums": dump_unsealed, "save": lambda: save(False), "save_fsync": lambda: save(True)}, rounds=rounds, warmup=1)
    mb = array.nbytes / 1e6
    out = {"raw_mb": mb, "file_mb": (tmp / "stat.h5").stat().st_size / 1e6, "moetrace_mb_s": mb / times["dump"], "numpy_mb_s": mb / times["save"],
           "numpy_fsync_mb_s": mb / times["save_fsync"], "ratio": times["save"] / times["dump"], "ratio_fsync": times["save_fsync"] / times["dump"],
           "no_checksums_mb_s": mb / times["dump_no_checksums"], "checksum_ratio": times["dump_no_checksums"] / times["dump"]}
    (tmp / "stat.h5").unlink()
    return out


def default_per_token(tokens: int) -> dict[str, float]:
    """The per_token workload with the recorder's defaults only (an API every moetrace version has)."""
    rng = np.random.default_rng(1)
    routes = [torch.as_tensor(zipf_ids(rng, PER_PASS, EXPERTS, TOP_K)) for _ in range(LAYERS)]
    with tempfile.TemporaryDirectory() as name:
        rec = ExpertDistributionRecorder(RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode="per_token", output_dir=name, max_tokens_per_pass=PER_PASS))
        rec.start_record()
        start = time.perf_counter()
        for _ in range(tokens // PER_PASS):
            with rec.with_forward_pass():
                for layer in range(LAYERS):
                    rec.on_select_experts(routes[layer], layer=layer)
        path = rec.dump_record(Path(name) / "t.h5")
        seconds = time.perf_counter() - start
        ids = tokens // PER_PASS * PER_PASS * LAYERS * TOP_K
        return {"mb_s_int16": 2 * ids / seconds / 1e6, "file_mb": path.stat().st_size / 1e6}


def versus(source: Path, tokens: int, rounds: int) -> dict[str, object]:
    """``default_per_token`` of the moetrace at ``source`` (e.g. an older checkout) and of this one,
    alternating in fresh processes round by round; medians."""
    figures: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    here = Path(__file__).resolve()
    for _ in range(rounds):
        for label, path in (("before", source), ("now", here.parents[1])):
            env = {**os.environ, "PYTHONPATH": str(path)}
            out = subprocess.run([sys.executable, str(here), "--child-default", str(tokens)], env=env, capture_output=True, text=True, check=True)
            figures[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {label: float(np.median([f["mb_s_int16"] for f in runs])) for label, runs in figures.items()}
    return {"source": str(source), "rounds": rounds, "tokens": tokens, "runs": figures, "median_mb_s_int16": median, "speedup": median["now"] / median["before"]}


def checksum_cost(quick: bool) -> None:
    """Every per_token variant with and without checksums, interleaved over rounds (median), and
    the stat dump; prints throughput with / without (1.00 = free)."""
    tokens, window = (131072, 64) if quick else (524288, 256)
    variants: dict[str, dict[str, object]] = {spec: {"compression": spec} for spec in compressions()}
    variants["none, 8 MiB segments"] = {"compression": "none", "segment_bytes": 8 * 2**20}
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {(name, c): [] for name in variants for c in (True, False)}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        keys = list(runs)
        for r in range(3 if quick else 5):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                runs[key].append(token_stream(tmp, tokens, checksums=key[1], **variants[key[0]]))  # type: ignore[arg-type]
        stat = {spec: stat_dump(tmp, window, spec, rounds=5 if quick else 9) for spec in ("none", "gzip:1")}
    median = {key: float(np.median([f["mb_s_int16"] for f in r])) for key, r in runs.items()}
    results: dict[str, object] = {"workload": {"tokens": tokens, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K}, "per_token_mb_s_int16": {
        name: {"with": median[(name, True)], "without": median[(name, False)], "ratio": median[(name, True)] / median[(name, False)]} for name in variants}, "stat_dump": stat}
    print(f"{'per_token (MB/s, int16)':<26}{'with':>8}{'without':>9}{'ratio':>7}")
    for name, r in results["per_token_mb_s_int16"].items():  # type: ignore[union-attr]
        print(f"{name:<26}{r['with']:>8.0f}{r['without']:>9.0f}{r['ratio']:>7.2f}")
    for name, r in stat.items():
        print(f"stat dump {name:<16}{r['moetrace_mb_s']:>8.0f}{r['no_checksums_mb_s']:>9.0f}{r['checksum_ratio']:>7.2f}")
    print(f"wrote {write_results('dump_throughput_checksums', results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller arrays")
    parser.add_argument("--versus", type=Path, help="also time the default per_token path of the moetrace source tree at this path (an older checkout) against this one")
    parser.add_argument("--checksums", action="store_true", help="only the cost of checksums: each variant with and without them, interleaved (results: dump_throughput_checksums.json)")
    parser.add_argument("--child-default", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child_default:
        print(json.dumps(default_per_token(args.child_default)))
        return
    if args.checksums:
        checksum_cost(args.quick)
        return
    tokens, passes, window = (131072, 256, 64) if args.quick else (524288, 1024, 256)
    results: dict[str, object] = {"workload": {"tokens": tokens, "layers": LAYERS, "experts": EXPERTS, "top_k": TOP_K, "tokens_per_pass": PER_PASS}}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        results["baselines"] = baselines(tmp, tokens)
        variants: dict[str, dict[str, object]] = {"hooks only (stat mode)": {"mode": "stat", "segment_seconds": 0}}
        variants.update({spec: {"compression": spec} for spec in compressions()})
        variants["lzf, 8 MiB segments"] = {"compression": "lzf", "segment_bytes": 8 * 2**20}
        variants["none, 8 MiB segments"] = {"compression": "none", "segment_bytes": 8 * 2**20}
        variants["gzip:1, on_overflow=drop"] = {"compression": "gzip:1", "on_overflow": "drop"}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for r in range(1 if args.quick else 3):  # interleaved rounds, rotated order; the median round is kept
            names = list(variants)
            for variant in names[r % len(names) :] + names[: r % len(names)]:
                rounds[variant].append(token_stream(tmp, tokens, **variants[variant]))  # type: ignore[arg-type]
        per_token = {name: sorted(runs, key=lambda f: f["mids_per_s"])[len(runs) // 2] for name, runs in rounds.items()}
        results["per_token"] = per_token
        results["per_pass"] = {spec: pass_stream(tmp, passes, spec) for spec in ("none", "lzf", "gzip:1")}
        results["stat_dump"] = {spec: stat_dump(tmp, window, spec, rounds=3 if args.quick else 7) for spec in ("none", "lzf", "gzip:1")}
    base = results["baselines"]
    print(f"baselines: numpy.save {base['numpy_save_mb_s_int16']:.0f} MB/s, memory copy {base['memcpy_mb_s_int16']:.0f} MB/s (int16-equivalent)")  # type: ignore[index]
    print(f"{'per_token':<28}{'M ids/s':>9}{'MB/s i16':>10}{'file MB':>9}{'segments':>9}{'dump s':>8}{'dropped':>9}{'RSS MB':>8}")
    for name, r in per_token.items():
        print(f"{name:<28}{r['mids_per_s']:>9.1f}{r['mb_s_int16']:>10.0f}{r['file_mb']:>9.1f}{r['segments_at_dump']:>9.0f}{r['dump_seconds']:>8.2f}{r['dropped_passes']:>9.0f}{r['rss_growth_mb']:>8.0f}")
    for name, r in results["per_pass"].items():  # type: ignore[union-attr]
        print(f"per_pass {name:<19}{r['passes_per_s']:>9.0f} passes/s {r['mb_s']:>7.0f} MB/s  file {r['file_mb']:.1f} of {r['raw_mb']:.1f} MB")
    for name, r in results["stat_dump"].items():  # type: ignore[union-attr]
        print(f"stat dump {name:<18}{r['moetrace_mb_s']:>9.0f} MB/s vs numpy.save {r['numpy_mb_s']:.0f} MB/s = {r['ratio']:.2f}x, "
              f"vs numpy.save + fsync {r['numpy_fsync_mb_s']:.0f} MB/s = {r['ratio_fsync']:.2f}x  file {r['file_mb']:.1f} of {r['raw_mb']:.1f} MB")
    if args.versus:
        results["versus"] = v = versus(args.versus, tokens // 2, rounds=3 if args.quick else 5)
        print(f"default per_token path, before ({args.versus}) vs now: {v['median_mb_s_int16']['before']:.0f} vs {v['median_mb_s_int16']['now']:.0f} MB/s = {v['speedup']:.1f}x")  # type: ignore[index]
    print(f"wrote {write_results('dump_throughput', results)}")


if __name__ == "__main__":
    main()
