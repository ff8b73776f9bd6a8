"""Offline tools at fleet size: merge, verify, analyze, report and placement over 8, 32 and 72 DeepSeek-V3 rank traces.

Run: ``.venv/bin/python benchmarks/fleet_traces.py [--ranks 8 32 72] [--passes 500] [--quick]``
(``--quick``: 8 and 32 ranks, 100 passes). Needs about 1 GB of disk at 72 ranks x 500
passes (the per-rank files plus the merged one; deleted after each size) and runs alone
(the tools are measured, not the machine's other jobs).

For each fleet size ``R`` the real recorder writes ``R`` per-rank ``per_pass`` traces of
one run in this process: DeepSeek-V3's shape (58 MoE layers 3..60, 256 experts on 288
slots over EP ``R``, top-8, 128 decode tokens per rank per pass), each recorder with its
rank's id and layout (DP attention, all-to-all EP) and the run's ``run_id``, fed the
fleet's deterministic skewed routing (:mod:`tests.exporters.fleet`). Then each tool runs
as its own ``moetrace`` subprocess, timed, its peak RSS read from ``wait4``:
``merge`` (per-rank -> merged), ``verify`` (the merged file), ``analyze`` of the per-rank
files and of the merged file (their ``--json`` answers must be equal), ``report`` and
``placement --gpus R`` of the per-rank files. A tool that runs past ``--limit`` seconds
is stopped and reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.exporters.fleet: the fleet's routing and layouts

from harness import write_results

from moetrace import ExpertDistributionRecorder
from tests.exporters import fleet

MOETRACE = [sys.executable, "-m", "moetrace.cli"]


def shape_of(ranks: int) -> fleet.FleetShape:
    return fleet.FleetShape(f"dsv3-ep{ranks}", layers=58, first_layer=3, experts=256, slots=288, top_k=8, ep=ranks, tokens=128)


def write_fleet(ranks: int, passes: int, out: Path) -> tuple[list[Path], float]:
    """``ranks`` per-rank per_pass traces of one run, written by ``ranks`` recorders fed pass by pass."""
    shape = shape_of(ranks)
    run_id = f"fleet-{ranks}-{os.getpid()}"
    recorders = []
    for rank in range(ranks):
        config = fleet.recorder_config(shape, rank, out, mode="per_pass", run_id=run_id, stream_chunk_passes=32)
        recorders.append(ExpertDistributionRecorder(config))
    start = time.perf_counter()
    for rec in recorders:
        rec.start_record()
    for index in range(passes):
        ids = torch.from_numpy(fleet.fleet_routing(shape, 0, index))  # [R, L, T, k]
        for rank, rec in enumerate(recorders):
            with rec.with_forward_pass():
                for layer in range(shape.layers):
                    with rec.with_current_layer(layer):
                        rec.on_select_experts(ids[rank, layer])
    paths = []
    for rec in recorders:
        rec.stop_record()
        paths.append(rec.dump_record(out / "fleet.h5"))
    return paths, time.perf_counter() - start


def run_tool(name: str, args: list[str], limit: float, stdout: Path) -> dict[str, object]:
    """Run one ``moetrace`` command under GNU ``time`` (its peak RSS is the tool's own: ``wait4`` in this
    process would report the high-water mark this large process had when it forked); seconds, MiB, exit code."""
    stats = stdout.with_suffix(".time")
    start = time.perf_counter()
    with stdout.open("wb") as out:
        try:
            proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(stats), *MOETRACE, *args], stdout=out,
                                  stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"tool": name, "seconds": None, "peak_rss_mib": None, "rc": "timeout"}
    seconds = time.perf_counter() - start
    peak_kib = int(stats.read_text().split()[-1])
    return {"tool": name, "seconds": seconds, "peak_rss_mib": peak_kib / 1024, "rc": proc.returncode}


def _answer(path: Path) -> dict[str, object]:
    """The analyze JSON without what names the input (its path or file names, and the notes on how it was read)."""
    data = json.loads(path.read_text())
    for key in ("path", "trace", "notes"):
        data.pop(key, None)
    return data


def measure(ranks: int, passes: int, work: Path, limit: float) -> dict[str, object]:
    out = work / f"ranks{ranks}"
    out.mkdir()
    paths, write_s = write_fleet(ranks, passes, out)
    merged = out / "merged.h5"
    files = [str(p) for p in paths]
    rows = [
        run_tool("merge", ["merge", *files, "-o", str(merged), "--no-progress"], limit, out / "merge.txt"),
        run_tool("verify", ["verify", str(merged), "--no-progress"], limit, out / "verify.txt"),
        run_tool("analyze (per-rank files)", ["analyze", *files, "--json", "--no-progress"], limit, out / "analyze-ranks.json"),
        run_tool("analyze (merged file)", ["analyze", str(merged), "--json", "--no-progress"], limit, out / "analyze-merged.json"),
        run_tool("report", ["report", *files, "-o", str(out / "report.html")], limit, out / "report.txt"),
        run_tool("placement", ["placement", *files, "--gpus", str(ranks)], limit, out / "placement.txt"),
    ]
    same: object = None
    if all(r["rc"] == 0 for r in rows[2:4]):
        a, b = _answer(out / "analyze-ranks.json"), _answer(out / "analyze-merged.json")
        same = a == b or {"differ": sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))}
    result = {"ranks": ranks, "passes_per_rank": passes, "write_seconds": write_s,
              "per_rank_bytes": sum(p.stat().st_size for p in paths), "merged_bytes": merged.stat().st_size if merged.exists() else None,
              "tools": rows, "analyze_merged_equals_per_rank": same,
              "failures": {r["tool"]: (out / f).read_text()[-2000:] for r, f in zip(rows, ("merge.txt", "verify.txt", "analyze-ranks.json",
                                                                                        "analyze-merged.json", "report.txt", "placement.txt"), strict=True)
                           if r["rc"] not in (0,)}}
    shutil.rmtree(out)
    return result


def table(results: list[dict[str, object]]) -> str:
    tools = [r["tool"] for r in results[0]["tools"]]  # type: ignore[index]
    head = "| tool | " + " | ".join(f"{r['ranks']} ranks: s / peak MiB" for r in results) + " |"
    lines = [head, "|---|" + "---:|" * len(results)]
    for i, tool in enumerate(tools):
        cells = []
        for r in results:
            row = r["tools"][i]  # type: ignore[index]
            seconds = "timeout" if row["seconds"] is None else f"{row['seconds']:.1f}"
            peak = "-" if row["peak_rss_mib"] is None else f"{row['peak_rss_mib']:.0f}"
            cells.append(f"{seconds} / {peak}" + ("" if row["rc"] in (0, "timeout") else f" (exit {row['rc']})"))
        lines.append(f"| {tool} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 72])
    parser.add_argument("--passes", type=int, default=500)
    parser.add_argument("--limit", type=float, default=900.0, help="seconds before a tool is stopped")
    parser.add_argument("--quick", action="store_true", help="8 and 32 ranks, 100 passes")
    args = parser.parse_args()
    ranks, passes = ([8, 32], 100) if args.quick else (args.ranks, args.passes)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="moetrace-fleet-traces-") as tmp:
        for r in ranks:
            results.append(measure(r, passes, Path(tmp), args.limit))
            print(json.dumps(results[-1], indent=2), flush=True)
    print(table(results))
    write_results("fleet_traces", {"results": results, "table": table(results), "load_average": os.getloadavg()[0],
                                   "numpy": np.__version__})


if __name__ == "__main__":
    main()
