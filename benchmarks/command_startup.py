"""Wall time of ``moetrace`` commands at two commits, side by side: ``--version``, ``--help``, and
``analyze`` / ``verify`` / ``report`` of a small trace and of a 72-rank fleet's traces.

Run: ``.venv/bin/python benchmarks/command_startup.py --before 53fe5fd --fleet DIR [--rounds 7] [--fleet-rounds 3]``
(``--after`` defaults to ``HEAD``; ``DIR`` holds the per-rank traces ``benchmarks/fleet_traces.py --keep DIR``
wrote, ``fleet-rank*.h5``, and ``merged.h5``, which this script writes with ``moetrace merge`` when it is missing).

Each commit's tree is laid out as it is installed (``moetrace/`` with ``cli/``, ``adapters/``,
``exporters/`` inside it) in a temporary folder, and every run is a fresh interpreter,
from that folder's parent, of::

    python -c "<drop the editable finders>; sys.argv = ['moetrace', *ARGS]; from moetrace.cli.app import main; main()" ARGS

so both commits import the same way, with this virtualenv's packages. In each round the commits run
one after the other in an order that alternates; a command's figure is the median of its rounds,
and the ratio after / before is the reading (the machine's load moves both alike).
Results: ``benchmarks/results/command_startup.json``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.analysis.helpers: the small trace

from harness import write_results

REPO = Path(__file__).resolve().parents[1]
RUN = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'EditableFinder' not in getattr(f, '__name__', type(f).__name__)]; "
       "sys.path.insert(0, {tree!r}); sys.argv = ['moetrace', *sys.argv[1:]]; from moetrace.cli.app import main; main()")


def lay_out(commit: str, into: Path) -> Path:
    """``commit``'s packages as installed: ``into/moetrace`` with ``cli``, ``adapters`` and ``exporters`` inside."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "moetrace", "cli", "adapters", "exporters"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for part in ("cli", "adapters", "exporters"):
        (into / part).rename(into / "moetrace" / part)
    return into


def small_trace(into: Path) -> Path:
    """A ``per_pass`` trace of 4 MoE layers, 8 experts, top-2, 64 passes of up to 32 tokens."""
    from tests.analysis.helpers import random_passes, record

    passes = random_passes(np.random.default_rng(52), num_passes=64, num_layers=4, num_experts=8, top_k=2, max_tokens=32)
    return record(into, "per_pass", passes, num_experts=8)


def timed(tree: Path, args: list[str], cwd: Path) -> float:
    """Seconds of one run of ``moetrace ARGS`` from ``tree``; a failing run stops the benchmark with its stderr."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", RUN.format(tree=str(tree)), *args], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"moetrace {' '.join(args)} (tree {tree}) exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return seconds


def side_by_side(trees: dict[str, Path], args: list[str], rounds: int, cwd: Path) -> dict[str, float]:
    """Median seconds of ``moetrace ARGS`` for each tree, the trees alternating first and second."""
    names = list(trees)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            samples[name].append(timed(trees[name], args, cwd))
    return {name: statistics.median(times) for name, times in samples.items()}


def commands(small: Path, fleet: Path | None, out: Path) -> list[tuple[str, list[str], bool]]:
    """(label, args, is a fleet command) of every command measured."""
    rows = [("moetrace --version", ["--version"], False), ("moetrace --help", ["--help"], False),
            ("moetrace analyze small.h5", ["analyze", str(small)], False),
            ("moetrace verify small.h5", ["verify", str(small)], False),
            ("moetrace report small.h5 -o r.html", ["report", str(small), "-o", str(out / "small.html")], False)]
    if fleet is not None:
        ranks = sorted(fleet.glob("fleet-rank*.h5"))
        merged = fleet / "merged.h5"
        rows += [(f"moetrace analyze (the {len(ranks)} per-rank files)", ["analyze", *map(str, ranks), "--no-progress"], True),
                 ("moetrace analyze merged.h5", ["analyze", str(merged), "--no-progress"], True),
                 ("moetrace verify merged.h5", ["verify", str(merged), "--no-progress"], True),
                 (f"moetrace report (the {len(ranks)} per-rank files) -o r.html", ["report", *map(str, ranks), "-o", str(out / "fleet.html")], True)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit before (e.g. 53fe5fd)")
    parser.add_argument("--after", default="HEAD", help="the commit after (default HEAD)")
    parser.add_argument("--fleet", type=Path, help="folder of fleet-rank*.h5 (benchmarks/fleet_traces.py --keep)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the small commands")
    parser.add_argument("--fleet-rounds", type=int, default=3, help="rounds of the fleet commands")
    parser.add_argument("--name", default="command_startup", help="results file name under benchmarks/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"before": lay_out(args.before, work / "before"), "after": lay_out(args.after, work / "after")}
        small = small_trace(work / "small")
        if args.fleet is not None and not (args.fleet / "merged.h5").exists():
            print("merging the fleet's per-rank files into merged.h5", file=sys.stderr)
            timed(trees["after"], ["merge", *map(str, sorted(args.fleet.glob("fleet-rank*.h5"))), "-o", str(args.fleet / "merged.h5"), "--no-progress"], work)
        rows = []
        for label, command, fleet in commands(small, args.fleet, work):
            print(f"timing {label}", file=sys.stderr)
            seconds = side_by_side(trees, command, args.fleet_rounds if fleet else args.rounds, work)
            rows.append({"command": label, **seconds, "ratio": seconds["after"] / seconds["before"]})
            print(f"| `{label}` | {seconds['before']:.2f} | {seconds['after']:.2f} | {seconds['after'] / seconds['before']:.2f} |")
    commits = {name: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", commit], check=True, capture_output=True, text=True).stdout.strip()
               for name, commit in (("before", args.before), ("after", args.after))}
    path = write_results(args.name, {**commits, "rows": rows,
                                     "rounds": args.rounds, "fleet_rounds": args.fleet_rounds})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
