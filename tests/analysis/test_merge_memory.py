"""merge holds one read per input and one merged column at a time: its memory does not grow with the ranks.

Per-rank ``per_pass`` traces written by the real recorder (each rank's id and layout, one run
id; :mod:`tests.exporters.fleet`), merged under ``tracemalloc`` (numpy's arrays are traced).
The full-size figures (DeepSeek-V3 at 8, 32 and 72 ranks) are ``benchmarks/fleet_traces.py``'s.
"""

from __future__ import annotations

import tracemalloc

import h5py
import numpy as np

from moetrace.trace.merge import merge_traces
from tests.exporters import fleet

SHAPE = fleet.FleetShape("wide", layers=8, first_layer=0, experts=256, slots=256, top_k=4, ep=16, tokens=8)
PASSES = 32
ROW = SHAPE.layers * SHAPE.slots * 4  # bytes of one /passes/physical_count row (int32)


def write_ranks(out, ranks: int) -> list:
    shape = fleet.FleetShape(f"wide{ranks}", SHAPE.layers, SHAPE.first_layer, SHAPE.experts, SHAPE.slots, SHAPE.top_k, ranks, SHAPE.tokens)
    return fleet.write_rank_traces(shape, PASSES, out, f"mem{ranks}", stream_chunk_passes=16)


def traced_peak(paths, out, memory_bytes: int) -> int:
    """Most bytes traced at once while ``merge_traces`` ran (what was imported or cached before is not counted)."""
    tracemalloc.start()
    try:
        merge_traces(paths, out, memory_bytes=memory_bytes)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_merge_memory_is_flat_in_ranks(tmp_path):
    budget = 320 << 10  # reads of 8 rows a rank at 4 ranks, of 2 rows at 16 (a row: 8 KiB of counts + 1.4 KiB)
    peaks = {}
    for ranks in (4, 16):
        d = tmp_path / f"r{ranks}"
        d.mkdir()
        paths = write_ranks(d, ranks)
        with h5py.File(paths[0], "r") as f:
            assert f["passes/physical_count"].dtype.itemsize * SHAPE.layers * SHAPE.slots == ROW
        whole = ranks * PASSES * ROW
        assert whole >= 3 * budget  # the data is several budgets: the merge has to stream
        if ranks == 4:  # negative control (and the imports done): a budget over the data holds all of it
            assert traced_peak(paths, d / "whole.h5", 1 << 40) >= whole
        peaks[ranks] = traced_peak(paths, d / "merged.h5", budget)
        # the reads in flight (the budget) + one merged column (at most as much again) + what does not grow
        # with the rows: a /stat row being copied, and about 20 KiB an input of h5py and numpy objects
        assert peaks[ranks] <= 2 * budget + (128 << 10) + ranks * (24 << 10), (ranks, peaks[ranks], budget)
        with h5py.File(d / "merged.h5", "r") as f:
            assert f["passes/physical_count"].shape == (ranks * PASSES, SHAPE.layers, SHAPE.slots)
    with h5py.File(tmp_path / "r4" / "merged.h5", "r") as a, h5py.File(tmp_path / "r4" / "whole.h5", "r") as b:
        for name in ("physical_count", "pass_id", "rank"):
            np.testing.assert_array_equal(a[f"passes/{name}"][()], b[f"passes/{name}"][()])
