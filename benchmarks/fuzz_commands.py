"""Full-size command fuzz: every trace-reading CLI command on 1,001+ seeded damaged traces.

The same cases as ``tests/integrity/test_fuzz.py``'s command tier (11 kinds: stat, per_pass,
per_token, timing, routing ``/requests``, merged, recovered, converted, segment, checkpoint,
SGLang ``.pt``; 6 mutations in turn: bit flip, zeroed 2 KiB, zeroed metadata structure, zeroed
chunk data, truncation, swapped chunks), at full size: ``--cases`` damaged files per kind, every
command on every file (``tests.integrity.pool``: long-lived ``spawn`` workers run the typer app
in-process; the parent kills a worker whose command passes ``--bound`` seconds and counts a hang).

Every run must end in exit 0 with the undamaged file's exact answer or exit 2 saying why; exit 1,
a traceback, a hang, a crash or a different answer is a failure, listed in the results and
making the script exit 1. Cases run case-major (case 0 of every kind, then case 1, ...) and the
results file is rewritten every ``--flush`` seconds, so a run stopped early still reports evenly
over the kinds.

Run: ``.venv/bin/python benchmarks/fuzz_commands.py [--cases 91] [--workers 2] [--bound 300] [--kinds stat,per_pass]``
(``make fuzz``). Writes ``benchmarks/results/fuzz_commands.json`` (``fuzz_commands-<kinds>.json`` with
``--kinds``): cases, outcome counts per
command and kind, the slowest run per command, wall time, failures.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.integrity: the trace kinds, damage and worker pool
from harness import write_results

from tests.integrity.pool import COMMANDS, KINDS, Pool, Task, build_sources, check, tasks_for

SEED = 28
"""The seed of tests/integrity/test_fuzz.py: its CI sample is this run's first cases."""


def _case_major(tasks: list[Task]) -> list[Task]:
    """Undamaged runs first, then case 0 of every kind, case 1 of every kind, ..."""
    return sorted(tasks, key=lambda t: (t.case, KINDS.index(t.kind)))


def _summary(results: dict, started: float, args: argparse.Namespace, replaced: int, done: bool) -> dict[str, object]:
    tally, failures, slowest = check(results)
    files = {(kind, case) for (kind, case, _) in results if case >= 0}
    per_command: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (_, command), counts in tally.items():
        per_command[command].update(counts)
    return {
        "complete": done,
        "command": f"{sys.executable} benchmarks/fuzz_commands.py --cases {args.cases} --first-case {args.first_case} --kinds {args.kinds} "
                   f"--workers {args.workers} --bound {args.bound}",
        "seed": SEED, "bound_s": args.bound, "workers": args.workers, "cases_per_kind": args.cases,
        "damaged_files": len(files), "runs": sum(1 for (_, case, _) in results if case >= 0),
        "wall_s": round(time.monotonic() - started, 1), "workers_replaced": replaced,
        "per_command": {c: dict(per_command[c]) for c in COMMANDS if c in per_command},
        "per_kind_command": {f"{k}/{c}": dict(v) for (k, c), v in sorted(tally.items())},
        "slowest_s": {c: round(s, 3) for c, s in sorted(slowest.items())},
        "failures": failures[:50], "failure_count": len(failures),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=91, help="damaged files per kind (91 x 11 kinds = 1,001)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bound", type=float, default=300.0, help="seconds one command may take")
    parser.add_argument("--flush", type=float, default=60.0, help="seconds between rewrites of the results file")
    parser.add_argument("--quick", action="store_true", help="4 files per kind")
    parser.add_argument("--first-case", type=int, default=0,
                        help="skip the damaged files of cases below this (resume a run that stopped; its seeds are unchanged)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated kinds to damage (default every one: {','.join(KINDS)})")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; choose from {','.join(KINDS)}")
    if args.quick:
        args.cases = 4
    name = "fuzz_commands" if kinds == list(KINDS) else "fuzz_commands-" + "-".join(kinds)  # a run of some kinds keeps its own results
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moetrace-fuzz-") as tmp:
        sources = build_sources(Path(tmp) / "sources", kinds)
        tasks = _case_major([t for t in tasks_for(kinds, args.cases) if t.case < 0 or t.case >= args.first_case])
        results: dict = {}
        with Pool(sources, Path(tmp) / "workers", workers=args.workers, bound_s=args.bound, seed=SEED) as pool:
            last = time.monotonic()
            batch = max(1, args.workers * 4)
            for at in range(0, len(tasks), batch):  # in batches, to flush partial results
                results.update(pool.run(tasks[at : at + batch]))
                if time.monotonic() - last > args.flush:
                    write_results(name, _summary(results, started, args, pool.replaced, done=False))
                    last = time.monotonic()
            summary = _summary(results, started, args, pool.replaced, done=True)
    path = write_results(name, summary)
    print(f"{summary['damaged_files']} damaged files, {summary['runs']} command runs in {summary['wall_s']} s: "
          f"{summary['per_command']}; slowest {summary['slowest_s']}; {summary['failure_count']} failures -> {path}")
    return summary


if __name__ == "__main__":
    sys.exit(1 if main()["failure_count"] else 0)
