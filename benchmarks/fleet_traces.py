"""Offline tools at fleet size: merge, verify, analyze, report and placement over 8, 32 and 72 DeepSeek-V3 rank traces.

Run: ``.venv/bin/python benchmarks/fleet_traces.py [--ranks 8 32 72] [--passes 500] [--quick]``
(``--quick``: 8 and 32 ranks, 100 passes). Needs about 1 GB of disk at 72 ranks x 500
passes (the per-rank files plus the merged one; deleted after each size unless ``--keep DIR``,
which also reuses the traces a previous run kept there) and runs alone
(the tools are measured, not the machine's other jobs). ``--tools`` measures some of them only.

For each fleet size ``R`` the real recorder writes ``R`` per-rank ``per_pass`` traces of
one run in this process: DeepSeek-V3's shape (58 MoE layers 3..60, 256 experts on 288
slots over EP ``R``, top-8, 128 decode tokens per rank per pass), each recorder with its
rank's id and layout (DP attention, all-to-all EP) and the run's ``run_id``, fed the
fleet's deterministic skewed routing (:mod:`tests.exporters.fleet`). Then each tool runs
as its own ``moetrace`` subprocess, timed, its peak RSS read from ``wait4``:
``merge`` (per-rank -> merged), ``verify`` (the merged file), ``analyze`` of the per-rank
files and of the merged file (their ``--json`` answers must be equal), ``report`` of the
per-rank files, ``placement --gpus R --json`` of the per-rank files and of the merged file
(their plans must be equal), and beside ``placement`` DeepSeek EPLB's plan time on the same
loads in this process. A tool that runs past ``--limit`` seconds is stopped and
reported as such. Peak memory (GNU ``time``'s maximum RSS) does not depend on the machine's
load; the seconds do, so the 1-minute load average is recorded before and after each tool.
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

from tests.exporters import fleet

MOETRACE = [sys.executable, "-m", "moetrace.cli"]


def shape_of(ranks: int) -> fleet.FleetShape:
    return fleet.FleetShape(f"dsv3-ep{ranks}", layers=58, first_layer=3, experts=256, slots=288, top_k=8, ep=ranks, tokens=128)


def write_fleet(ranks: int, passes: int, out: Path) -> tuple[list[Path], float]:
    """``ranks`` per-rank per_pass traces of one run, written by ``ranks`` recorders fed pass by pass."""
    start = time.perf_counter()
    paths = fleet.write_rank_traces(shape_of(ranks), passes, out, f"fleet-{ranks}-{os.getpid()}", stream_chunk_passes=32)
    return paths, time.perf_counter() - start


def fleet_files(ranks: int, passes: int, out: Path) -> tuple[list[Path], float | None]:
    """The per-rank traces in ``out``: the ones a previous run kept there, or newly written (and their writing seconds)."""
    kept = sorted(out.glob("fleet-rank*.h5"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    if (out / "complete").exists() and len(kept) == ranks:
        return kept, None
    for stale in out.glob("*.h5"):
        stale.unlink()
    paths, seconds = write_fleet(ranks, passes, out)
    (out / "complete").touch()
    return paths, seconds


def run_tool(name: str, args: list[str], limit: float, stdout: Path) -> dict[str, object]:
    """Run one ``moetrace`` command under GNU ``time`` (its peak RSS is the tool's own: ``wait4`` in this
    process would report the high-water mark this large process had when it forked); seconds, MiB, exit code."""
    stats = stdout.with_suffix(".time")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with stdout.open("wb") as out:
        try:
            proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(stats), *MOETRACE, *args], stdout=out,
                                  stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"tool": name, "seconds": None, "peak_rss_mib": None, "rc": "timeout", "load": [load_before, os.getloadavg()[0]]}
    seconds = time.perf_counter() - start
    peak_kib = int(stats.read_text().split()[-1])
    row = {"tool": name, "seconds": seconds, "peak_rss_mib": peak_kib / 1024, "rc": proc.returncode, "load": [load_before, os.getloadavg()[0]]}
    print(json.dumps(row), flush=True)
    return row


def _answer(path: Path) -> dict[str, object]:
    """The analyze JSON without what names the input (its path or file names, and the notes on how it was read)."""
    data = json.loads(path.read_text())
    for key in ("path", "trace", "notes"):
        data.pop(key, None)
    return data


#: Each tool: its name in the table, the file its output goes to, its arguments (``{files}``: the per-rank files).
TOOLS = {
    "merge": ("merge.txt", ["merge", "{files}", "-o", "{merged}", "--no-progress"]),
    "verify": ("verify.txt", ["verify", "{merged}", "--no-progress"]),
    "analyze (per-rank files)": ("analyze-ranks.json", ["analyze", "{files}", "--json", "--no-progress"]),
    "analyze (merged file)": ("analyze-merged.json", ["analyze", "{merged}", "--json", "--no-progress"]),
    "report (per-rank files)": ("report.txt", ["report", "{files}", "-o", "{out}/report.html"]),
    "placement (per-rank files)": ("placement-ranks.json", ["placement", "{files}", "--gpus", "{ranks}", "--json"]),
    "placement (merged file)": ("placement-merged.json", ["placement", "{merged}", "--gpus", "{ranks}", "--json"]),
}


EPLB = "EPLB's plan of the same loads (rebalance_experts, in-process)"


def eplb_beside(paths: list[Path], ranks: int) -> dict[str, object]:
    """DeepSeek EPLB's plan time (moetrace's drop-in ``rebalance_experts``) on the loads ``placement --gpus R`` plans on, in this run."""
    from moetrace.analysis.distributed import pass_series
    from moetrace.placement import rebalance_experts

    load_before = os.getloadavg()[0]
    weight = torch.from_numpy(pass_series(paths).logical.sum(axis=0))
    replicas = -(-weight.shape[1] // ranks) * ranks  # what `placement --gpus R` defaults to: the experts rounded up to a multiple of R
    start = time.perf_counter()
    rebalance_experts(weight, replicas, 1, 1, ranks)
    row = {"tool": EPLB, "seconds": time.perf_counter() - start, "peak_rss_mib": None, "rc": 0, "load": [load_before, os.getloadavg()[0]]}
    print(json.dumps(row), flush=True)
    return row


def _same(a: dict[str, object], b: dict[str, object]) -> object:
    return a == b or {"differ": sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))}


def measure(ranks: int, passes: int, work: Path, limit: float, tools: list[str], keep: bool) -> dict[str, object]:
    out = work / f"ranks{ranks}-passes{passes}"
    out.mkdir(parents=True, exist_ok=True)
    paths, write_s = fleet_files(ranks, passes, out)
    merged = out / "merged.h5"
    files = [str(p) for p in paths]
    rows = []
    for tool in tools:
        output, template = TOOLS[tool]
        args = []
        for arg in template:
            args += files if arg == "{files}" else [arg.format(merged=merged, out=out, ranks=ranks)]
        rows.append(run_tool(tool, args, limit, out / output))
    if "placement (per-rank files)" in tools:
        rows.append(eplb_beside(paths, ranks))
    done = {r["tool"] for r in rows if r["rc"] == 0}
    same: dict[str, object] = {}
    if {"analyze (per-rank files)", "analyze (merged file)"} <= done:
        same["analyze"] = _same(_answer(out / "analyze-ranks.json"), _answer(out / "analyze-merged.json"))
    if {"placement (per-rank files)", "placement (merged file)"} <= done:
        same["placement"] = _same(json.loads((out / "placement-ranks.json").read_text()), json.loads((out / "placement-merged.json").read_text()))
    answer = None
    if "placement (per-rank files)" in done:  # what was deployed and how it held out, beside EPLB's plan
        document = json.loads((out / "placement-ranks.json").read_text())
        estimate = document.get("held_out_estimate") or {}
        answer = {"planner": document["planner"], "reason": document["selection"]["reason"], "in_sample": document["in_sample"]["balancedness"],
                  "held_out_estimate": estimate.get("summary"), "gap_closed": estimate.get("gap_closed")}
    result = {"ranks": ranks, "passes_per_rank": passes, "write_seconds": write_s, "placement": answer,
              "per_rank_bytes": sum(p.stat().st_size for p in paths), "merged_bytes": merged.stat().st_size if merged.exists() else None,
              "tools": rows, "merged_equals_per_rank": same,
              "failures": {r["tool"]: (out / TOOLS[str(r["tool"])][0]).read_text()[-2000:] for r in rows if r["rc"] != 0}}
    if keep:
        for name in {o for o, _ in TOOLS.values()} | {"merged.h5", "report.html"}:
            (out / name).unlink(missing_ok=True)
    else:
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
    loads = [[x for row in r["tools"] for x in row["load"]] for r in results]  # type: ignore[attr-defined]
    lines.append("| load average (1 min) | " + " | ".join(f"{min(x):.1f}-{max(x):.1f}" for x in loads) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 72])
    parser.add_argument("--passes", type=int, default=500)
    parser.add_argument("--limit", type=float, default=900.0, help="seconds before a tool is stopped")
    parser.add_argument("--quick", action="store_true", help="8 and 32 ranks, 100 passes")
    parser.add_argument("--tools", nargs="+", choices=list(TOOLS), default=list(TOOLS), help="the tools to measure (default all)")
    parser.add_argument("--keep", type=Path, help="keep the per-rank traces in this directory (and reuse those a previous run kept)")
    parser.add_argument("--name", default="fleet_traces", help="results file name under benchmarks/results")
    args = parser.parse_args()
    ranks, passes = ([8, 32], 100) if args.quick else (args.ranks, args.passes)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="moetrace-fleet-traces-") as tmp:
        for r in ranks:
            results.append(measure(r, passes, args.keep or Path(tmp), args.limit, args.tools, keep=args.keep is not None))
            print(json.dumps(results[-1], indent=2), flush=True)
    print(table(results))
    write_results(args.name, {"results": results, "table": table(results), "load_average": os.getloadavg()[0],
                              "numpy": np.__version__, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
