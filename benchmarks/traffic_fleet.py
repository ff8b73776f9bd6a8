"""``moetrace traffic`` at DeepSeek-V3 size: 72 per-rank traces (58 MoE layers, 288 slots, top-8) on 9 nodes of 8 GPUs.

Run: ``.venv/bin/python benchmarks/traffic_fleet.py [--passes 20 80] [--modes per_pass per_token] [--keep DIR] [--quick]``
(``--quick``: 4 and 8 passes; writing 72 ``per_token`` traces of 80 passes takes about 6 minutes and about 12 GB of
memory in this process, 72 recorders at once).

For each mode and pass count, the real recorder writes 72 per-rank traces of one run in this process (the fleet's
deterministic skewed routing, :mod:`tests.exporters.fleet`; DP attention, each rank routes its own 128 tokens a
pass), then ``moetrace traffic FILES --gpus-per-node 8 --json`` runs as its own subprocess, timed, its peak RSS
read by GNU ``time`` (:func:`fleet_traces.run_tool`). Its ``rank_tokens`` per layer are held to the copies the
routing sends, counted here from the same ids (``fleet.copies_to_ranks``). Flat memory: the peak RSS at the larger
pass count is the same as at the smaller one (``per_pass`` reads each rank's ``/stat`` counts; ``per_token``
streams each rank's rows in chunks), while the seconds of ``per_token`` grow with the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.exporters.fleet: the fleet's routing and layouts

from fleet_traces import run_tool
from harness import write_results

from tests.exporters import fleet

SHAPE = fleet.DSV3  # 58 layers, 256 experts on 288 slots, top-8, EP 72, 128 tokens per rank per pass
GPUS_PER_NODE = 8


def expected_rank_tokens(passes: int) -> np.ndarray:
    """``[L, R, R]`` copies from each source rank to each destination rank, counted from the fleet's ids."""
    total = np.zeros((SHAPE.layers, SHAPE.ep, SHAPE.ep), dtype=np.int64)
    for index in range(passes):
        total += fleet.copies_to_ranks(fleet.fleet_routing(SHAPE, 0, index), SHAPE).transpose(1, 0, 2)  # [source, L, dest] -> [L, source, dest]
    return total


def measure(mode: str, passes: int, work: Path, limit: float) -> dict[str, object]:
    out = work / f"{mode}-{passes}"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    paths = fleet.write_rank_traces(SHAPE, passes, out, f"traffic-{mode}-{passes}-{os.getpid()}", mode=mode, stream_chunk_passes=32)
    write_s = time.perf_counter() - start
    answer = out / "traffic.json"
    row = run_tool(f"traffic ({mode}, {passes} passes)", ["traffic", *map(str, paths), "--gpus-per-node", str(GPUS_PER_NODE), "--json", "--no-progress"],
                   limit, answer)
    document = json.loads(answer.read_text()) if row["rc"] == 0 else {}
    exact = bool(document) and [layer["rank_tokens"] for layer in document["layers"]] == expected_rank_tokens(passes).tolist()
    share = document.get("inter_node_share")
    mean_nodes = None
    if document.get("nodes_per_token"):
        hist = np.asarray(document["nodes_per_token"])
        mean_nodes = float((hist * np.arange(len(hist))).sum() / hist.sum())
    bytes_on_disk = sum(p.stat().st_size for p in paths)
    return {**row, "mode": mode, "passes": passes, "write_s": write_s, "trace_mib": bytes_on_disk / 2**20, "exact": exact,
            "inter_node_share": share, "mean_nodes_per_token": mean_nodes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, nargs="+", default=[20, 80])
    parser.add_argument("--quick", action="store_true", help="4 and 8 passes")
    parser.add_argument("--modes", nargs="+", default=["per_pass", "per_token"], choices=["stat", "per_pass", "per_token"])
    parser.add_argument("--limit", type=float, default=600.0, help="seconds before a traffic run is stopped")
    parser.add_argument("--keep", type=Path, default=None, help="keep the traces in this directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.passes = [4, 8]
    work = args.keep or Path(tempfile.mkdtemp(prefix="moetrace-traffic-"))
    rows = []
    try:
        for mode in args.modes:
            for passes in args.passes:
                rows.append(measure(mode, passes, work, args.limit))
                if args.keep is None:
                    shutil.rmtree(work / f"{mode}-{passes}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    path = write_results("traffic_fleet", {"shape": SHAPE.name, "ranks": SHAPE.ep, "gpus_per_node": GPUS_PER_NODE, "rows": rows})
    print(f"wrote {path}")
    return 0 if all(r["exact"] and r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
