"""One small trace of every kind moetrace writes, and the ways a disk or a copy damages them.

Every builder writes through moetrace's own writers (recorder, segments, checkpoint,
merge, recover, convert, routing replay), so the fuzz test damages exactly what users
get. ``corrupt`` applies one seeded mutation: a bit flip, a zeroed block anywhere, a zeroed
block over an HDF5 metadata structure (superblock, object headers, B-trees, fractal and global
heaps, free-space managers: found by their signatures, :func:`layout_of`), a zeroed block
inside a dataset's chunk, a truncation, or two chunks of one dataset swapped on disk.
"""

from __future__ import annotations

import dataclasses
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
MUTATIONS = ("bit_flip", "zero_block", "zero_metadata", "zero_data", "truncate", "swap_chunks")
#: Signatures of HDF5's metadata structures (file format spec): object headers and their
#: continuations, global heap collections, fractal heaps (header, direct and indirect blocks),
#: free-space managers, v2 B-trees, fixed and extensible array chunk indices, and the
#: version-1 structures (B-tree, local heap, symbol table node) moetrace never writes.
SIGNATURES = (b"OHDR", b"OCHK", b"GCOL", b"FRHP", b"FHDB", b"FHIB", b"FSHD", b"FSSE", b"BTHD", b"BTIN", b"BTLF",
              b"FAHD", b"FADB", b"EAHD", b"EAIB", b"EADB", b"EASB", b"TREE", b"HEAP", b"SNOD")


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
    # never dumped: the "crash". Streaming modes close a segment at every hand-off (8 passes: 5 segments,
    # whatever the machine's load; by time, a loaded machine closed one per pass and recover read 40);
    # stat writes its checkpoint by time (the only schedule it has).
    rotation = {"segment_seconds": 0.05} if mode == "stat" else {"segment_seconds": 0, "segment_bytes": 1}
    _record(live, mode, **rotation)
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


def sglang_dump(directory: Path, rank: int) -> Path:
    """An SGLang per_token expert-distribution dump (``.pt``) of ``rank``, as SGLang saves it."""
    rng = np.random.default_rng(rank)
    records = []
    for pass_id in range(6):
        ids = np.full((LAYERS, 5, 8), -1)
        ids[:, :, :TOP_K] = rng.integers(0, EXPERTS, (LAYERS, 5, TOP_K))
        records.append({"forward_pass_id": pass_id, "rank": rank, "topk_ids_of_layer": torch.as_tensor(ids, dtype=torch.int32),
                        "global_physical_count": torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)})
    src = directory / f"rank{rank}.pt"
    torch.save({"records": records, "last_physical_to_logical_map": torch.arange(EXPERTS).repeat(LAYERS, 1)}, src)
    return src


def per_rank_pair(directory: Path) -> list[Path]:
    """Ranks 0 and 1 of one run, per_token, through ``convert`` of SGLang-shaped dumps."""
    return [convert_sglang(sglang_dump(directory, rank), directory / f"rank{rank}.h5", top_k=TOP_K, run_id="fuzzrun", world_size=2)
            for rank in (0, 1)]


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
        "sglang_pt": lambda: (sglang_dump(directory, 0), None),
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
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a file's structures lie: ``metadata`` byte offsets (0, the superblock, and every
    signature of :data:`SIGNATURES`) and, per chunked dataset, its stored chunks ``(offset, size)``."""

    metadata: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, int], ...], ...]


def layout_of(path: Path) -> Layout:
    """The :class:`Layout` of ``path`` (an HDF5 file; other files: the signature scan only)."""
    data = path.read_bytes()
    found = {0}
    for signature in SIGNATURES:
        at = data.find(signature)
        while at != -1:
            found.add(at)
            at = data.find(signature, at + 1)
    chunks: list[tuple[tuple[int, int], ...]] = []
    if data.startswith(b"\x89HDF"):
        with h5py.File(path, "r") as f:
            def visit(name: str, obj: object) -> None:
                if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
                    stored: list[tuple[int, int]] = []
                    obj.id.chunk_iter(lambda info: stored.append((int(info.byte_offset), int(info.size))))
                    chunks.append(tuple(stored))
            f.visititems(visit)
    return Layout(tuple(sorted(found)), tuple(c for c in chunks if c))


def corrupt(data: bytes, mutation: str, rng: np.random.Generator, layout: Layout) -> bytes:
    """``data`` (a file's bytes, its :class:`Layout`) with one seeded mutation applied."""
    out = bytearray(data)
    if mutation == "bit_flip":
        at = int(rng.integers(0, len(out)))
        out[at] ^= 1 << int(rng.integers(0, 8))
    elif mutation == "zero_block":
        size = 2048
        at = int(rng.integers(0, max(1, len(out) - size)))
        out[at : at + size] = bytes(min(size, len(out) - at))
    elif mutation == "zero_metadata":  # a structure's signature kept or not, a field or the whole of it
        start = layout.metadata[int(rng.integers(0, len(layout.metadata)))]
        at = start + int(rng.choice([0, 4, 8, 16, int(rng.integers(0, 64))]))
        size = int(rng.choice([8, 64, 512, 2048]))
        out[at : at + size] = bytes(max(0, min(size, len(out) - at)))
    elif mutation == "zero_data":
        stored = [c for chunks in layout.chunks for c in chunks]
        if stored:
            offset, size = stored[int(rng.integers(0, len(stored)))]
            at = offset + int(rng.integers(0, size))
        else:  # not an HDF5 file: anywhere past its first 64 bytes
            at = int(rng.integers(min(64, len(out) - 1), len(out)))
        width = int(rng.choice([4, 64, 2048]))
        out[at : at + width] = bytes(max(0, min(width, len(out) - at)))
    elif mutation == "truncate":
        out = out[: int(len(out) * rng.uniform(0.2, 0.99))]
    elif mutation == "swap_chunks":
        pairs = [(a, b) for chunks in layout.chunks for a in chunks for b in chunks if a[0] < b[0] and a[1] == b[1]]
        if pairs:  # two chunks of one dataset, same stored size: Fletcher-32 alone would not notice
            (a, size), (b, _) = pairs[int(rng.integers(0, len(pairs)))]
        else:  # no such pair: two 4 KiB blocks
            size = 4096
            a, b = sorted(int(x) for x in rng.choice(max(2, len(out) // size), 2, replace=False) * size)
        out[a : a + size], out[b : b + size] = data[b : b + size], data[a : a + size]
    else:
        raise ValueError(mutation)
    return bytes(out)
