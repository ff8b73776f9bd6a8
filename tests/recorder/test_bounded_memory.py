"""Streaming modes keep memory bounded however long the run."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import open_trace


def run(rec: ExpertDistributionRecorder, passes: int, ids: torch.Tensor) -> None:
    for _ in range(passes):
        with rec.with_forward_pass():
            for layer in range(4):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(ids)


@pytest.mark.parametrize(("mode", "tokens"), [("per_token", 512), ("per_pass", 8)])
def test_streaming_memory_does_not_grow(tmp_path, mode, tokens):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=4, num_physical_experts=64, top_k=8, mode=mode, output_dir=tmp_path, max_tokens_per_pass=512, stream_chunk_tokens=4096, stream_chunk_passes=32))
    ids = torch.randint(0, 64, (tokens, 8))
    process = psutil.Process()
    rec.start_record()
    run(rec, 400, ids)  # warm up allocator, HDF5 chunk caches and the writer thread
    gc.collect()
    warm = process.memory_info().rss
    run(rec, 2400, ids)
    rec._files.session.writer.drain()
    gc.collect()
    grown = process.memory_info().rss - warm
    streamed = 2400 * (tokens * 4 * 8 * 2 + tokens * 12) if mode == "per_token" else 2400 * 4 * (64 + 5) * 4
    # Far less than what was streamed: the data went to disk, not to memory.
    assert grown < 8 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB while streaming {streamed / 2**20:.1f} MiB"
    assert streamed > 3 * 8 * 2**20 or mode == "per_pass"
    path = rec.dump_record()
    with open_trace(path) as trace:
        rows = trace.num_rows("tokens/topk_ids" if mode == "per_token" else "passes/pass_id")
    assert rows == (2800 * tokens if mode == "per_token" else 2800)
