"""What holding ``/tokens`` to ``/stat`` on every full read costs (issue 32).

:meth:`moetrace.trace.reader.Trace.iter_tokens` adds every row's ids up per rank, layer and slot
(:class:`moetrace.trace.invariants.TokenTally`) and compares them with ``/stat`` at the last row.
This times, interleaved in one process, ``analyze_trace`` and a bare ``iter_tokens`` read of one
long ``per_token`` trace (the OLMoE-like trace of ``analysis_throughput.py``) with the tally and
with it switched off (``add``/``check`` replaced by no-ops: what the reader did before).

Run: ``.venv/bin/python benchmarks/token_tally_cost.py [--tokens N] [--rounds R]``.
Writes ``benchmarks/results/token_tally_cost.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis_throughput import make_token_trace
from harness import interleaved, write_results

from moetrace.analysis import analyze_trace
from moetrace.trace import invariants, open_trace


def _read_all(path: Path) -> None:
    with open_trace(path) as trace:
        for _ in trace.iter_tokens():
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 19)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tally = invariants.TokenTally
    real = (tally.add, tally.check)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.h5"
        make_token_trace(path, args.tokens)

        def switched(on: bool, run):  # type: ignore[no-untyped-def]
            def call() -> None:
                tally.add, tally.check = real if on else (lambda self, ids, ranks: None, lambda self, trace: None)  # type: ignore[method-assign]
                try:
                    run()
                finally:
                    tally.add, tally.check = real  # type: ignore[method-assign]
            return call

        times = interleaved({
            "analyze, tally": switched(True, lambda: analyze_trace(path)),
            "analyze, no tally": switched(False, lambda: analyze_trace(path)),
            "read, tally": switched(True, lambda: _read_all(path)),
            "read, no tally": switched(False, lambda: _read_all(path)),
        }, rounds=args.rounds, warmup=1)
    result = {"tokens": args.tokens, "seconds": times,
              "analyze_ratio": times["analyze, tally"] / times["analyze, no tally"],
              "read_ratio": times["read, tally"] / times["read, no tally"]}
    print(result)
    write_results("token_tally_cost", result)


if __name__ == "__main__":
    main()
