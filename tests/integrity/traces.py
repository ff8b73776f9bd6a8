"""One small trace of every kind moetrace writes, and the ways a disk or a copy damages them.

Every builder writes through moetrace's own writers (recorder, segments, checkpoint,
merge, recover, convert, routing replay), so the fuzz test damages exactly what users
get. ``corrupt`` applies one seeded mutation: a bit flip, a zeroed block, a truncation
or two chunks of one dataset swapped on disk.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace.convert import convert_jsonl, convert_sglang
from moetrace.trace.merge import merge_traces
from moetrace.trace.recover import recover
from tests.faults.recording import feed

LAYERS, EXPERTS, TOP_K = 3, 16, 2
MUTATIONS = ("bit_flip", "zero_block", "truncate", "swap_chunks")


def _config(mode: str, directory: Path, **extra: object) -> RecorderConfig:
    options: dict[str, object] = {"max_tokens_per_pass": 8, "stream_chunk_tokens": 64, "stream_chunk_passes": 8, "window": 16, "model": "fuzz-moe"}
    options.update(extra)
    return RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=directory, **options)  # type: ignore[arg-type]


def _record(directory: Path, mode: str, passes: int = 40, **extra: object) -> ExpertDistributionRecorder:
    rec = ExpertDistributionRecorder(_config(mode, directory, **extra))
    rec.start_record()
    for pass_id in range(passes):
        if extra.get("timing"):
            with rec.with_forward_pass(pass_id):
                for layer in range(LAYERS):
                    with rec.with_current_layer(layer), rec.with_phase("expert"):
                        rec.on_select_experts(torch.as_tensor(np.random.default_rng(pass_id).integers(-1, EXPERTS, (8, TOP_K))))
        else:
            feed(rec, pass_id)
        if "segment_seconds" in extra and pass_id % 8 == 7:
            time.sleep(0.06)  # let the writer close a segment / write a checkpoint
    rec.stop_record()
    return rec


def dumped(directory: Path, mode: str, **extra: object) -> Path:
    rec = _record(directory, mode, **extra)
    return rec.dump_record(directory / f"{mode}.h5")


def run_directory(directory: Path, mode: str) -> Path:
    """A crashed run's directory (closed segments or the stat checkpoint, and the journal), copied
    away from the live writer so nothing changes under the test."""
    live = directory / "live"
    _record(live, mode, segment_seconds=0.05, segment_bytes=1024)  # never dumped: the "crash"
    want = "-seg000002.h5" if mode != "stat" else "-checkpoint.h5"
    deadline = time.monotonic() + 30
    while not any(p.name.endswith(want) for p in live.iterdir()):  # the writer thread closes them
        assert time.monotonic() < deadline, sorted(p.name for p in live.iterdir())
        time.sleep(0.05)
    run = directory / "run"
    run.mkdir()
    for path in sorted(live.iterdir()):
        if path.name.startswith(".moetrace-") and not path.name.endswith(".journal"):
            shutil.copy(path, run / path.name)
    for path in live.glob("*.journal"):  # last, so that it names no segment the copy lacks
        shutil.copy(path, run / path.name)
    return run


def routing(directory: Path) -> Path:
    out = directory / "routing.h5"
    result = CliRunner().invoke(app, ["replicas", "replay", "mooncake", "--limit", "120", "--replicas", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def per_rank_pair(directory: Path) -> list[Path]:
    """Ranks 0 and 1 of one run, per_token, through ``convert`` of SGLang-shaped dumps."""
    paths = []
    for rank in (0, 1):
        rng = np.random.default_rng(rank)
        records = []
        for pass_id in range(6):
            ids = np.full((LAYERS, 5, 8), -1)
            ids[:, :, :TOP_K] = rng.integers(0, EXPERTS, (LAYERS, 5, TOP_K))
            records.append({"forward_pass_id": pass_id, "rank": rank, "topk_ids_of_layer": torch.as_tensor(ids, dtype=torch.int32),
                            "global_physical_count": torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)})
        src = directory / f"rank{rank}.pt"
        torch.save({"records": records, "last_physical_to_logical_map": torch.arange(EXPERTS).repeat(LAYERS, 1)}, src)
        paths.append(convert_sglang(src, directory / f"rank{rank}.h5", top_k=TOP_K, run_id="fuzzrun", world_size=2))
    return paths


def converted(directory: Path) -> Path:
    rng = np.random.default_rng(3)
    src = directory / "routes.jsonl"
    with src.open("w") as fh:
        for pass_id in range(5):
            for position in range(6):
                for layer in (1, 3, 5):
                    fh.write(json.dumps({"layer": layer, "pass_id": pass_id, "position": position, "topk_ids": rng.integers(0, 12, 2).tolist()}) + "\n")
    return convert_jsonl(src, directory / "converted.h5", num_experts=12)


def build(kind: str, directory: Path) -> tuple[Path, Path | None]:
    """``(trace, run directory or None)``: the run directory is what ``recover`` reads."""
    directory.mkdir(parents=True, exist_ok=True)
    builders: dict[str, Callable[[], tuple[Path, Path | None]]] = {
        "stat": lambda: (dumped(directory, "stat"), None),
        "per_pass": lambda: (dumped(directory, "per_pass"), None),
        "per_token": lambda: (dumped(directory, "per_token"), None),
        "timing": lambda: (dumped(directory, "per_pass", timing=True), None),
        "routing": lambda: (routing(directory), None),
        "merged": lambda: (merge_traces(per_rank_pair(directory), directory / "merged.h5"), None),
        "recovered": lambda: (_recovered(directory), None),
        "converted": lambda: (converted(directory), None),
        "segment": lambda: _in_run(run_directory(directory, "per_token"), "-seg000001.h5"),
        "checkpoint": lambda: _in_run(run_directory(directory, "stat"), "-checkpoint.h5"),
    }
    return builders[kind]()


def _recovered(directory: Path) -> Path:
    run = run_directory(directory, "per_token")
    (result,) = recover(run, directory / "recovered.h5", force=True)
    assert result.path is not None
    return result.path


def _in_run(run: Path, suffix: str) -> tuple[Path, Path]:
    (path,) = [p for p in run.iterdir() if p.name.endswith(suffix)]
    return path, run


# ----------------------------------------------------------------------------- damage
def _chunks(path: Path) -> list[list[tuple[int, int]]]:
    """Per chunked dataset, its stored chunks ``(byte offset, size)``."""
    found: list[list[tuple[int, int]]] = []
    with h5py.File(path, "r") as f:
        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                chunks: list[tuple[int, int]] = []
                obj.id.chunk_iter(lambda info: chunks.append((int(info.byte_offset), int(info.size))))
                found.append(chunks)
        f.visititems(visit)
    return found


def corrupt(data: bytes, mutation: str, rng: np.random.Generator, path: Path) -> bytes:
    """``data`` (the bytes of ``path``) with one seeded mutation applied."""
    out = bytearray(data)
    if mutation == "bit_flip":
        at = int(rng.integers(0, len(out)))
        out[at] ^= 1 << int(rng.integers(0, 8))
    elif mutation == "zero_block":
        size = 2048
        at = int(rng.integers(0, max(1, len(out) - size)))
        out[at : at + size] = bytes(min(size, len(out) - at))
    elif mutation == "truncate":
        out = out[: int(len(out) * rng.uniform(0.2, 0.99))]
    elif mutation == "swap_chunks":
        pairs = [(a, b) for chunks in _chunks(path) for a in chunks for b in chunks if a[0] < b[0] and a[1] == b[1]]
        if pairs:  # two chunks of one dataset, same stored size: Fletcher-32 alone would not notice
            (a, size), (b, _) = pairs[int(rng.integers(0, len(pairs)))]
        else:  # no such pair: two 4 KiB blocks
            size = 4096
            a, b = sorted(int(x) for x in rng.choice(max(2, len(out) // size), 2, replace=False) * size)
        out[a : a + size], out[b : b + size] = data[b : b + size], data[a : a + size]
    else:
        raise ValueError(mutation)
    return bytes(out)
