"""HTML report size against trace length: ``moetrace report`` of per_token traces of 10k to 1M tokens.

The traces are the analysis benchmark's (``analysis_throughput.make_token_trace``: OLMoE-like,
16 MoE layers x 64 experts, top-8, 8 EP ranks, skewed Gumbel top-k routing, 256 tokens a pass).
For each: the report's size in bytes, the part that is not plotly.js, and the seconds to build it
(one run each, this machine; the size is the figure, the time is only a guide).

Run: ``.venv/bin/python benchmarks/report_size.py [--quick]``.
Writes ``benchmarks/results/report_size.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from plotly.offline import get_plotlyjs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis_throughput import make_token_trace
from harness import write_results

from moetrace.report import build_report


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10k and 100k tokens only")
    args = parser.parse_args(argv)
    sizes = (10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000)
    plotly_js = len(get_plotlyjs().encode())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in sizes:
            trace = Path(tmp) / f"t{tokens}.h5"
            make_token_trace(trace, tokens)
            start = time.perf_counter()
            html = build_report([trace], Path(tmp) / f"t{tokens}.html")
            seconds = time.perf_counter() - start
            size = html.stat().st_size
            rows.append({"tokens": tokens, "trace_bytes": trace.stat().st_size, "report_bytes": size,
                         "report_bytes_without_plotly_js": size - plotly_js, "build_seconds": round(seconds, 1)})
            print(f"{tokens:>9,} tokens: trace {trace.stat().st_size / 1e6:7.1f} MB, report {size / 1e6:.2f} MB "
                  f"({(size - plotly_js) / 1e3:.0f} kB besides plotly.js), built in {seconds:.1f} s")
    write_results("report_size", {"plotly_js_bytes": plotly_js, "rows": rows})
    return {"rows": rows}


if __name__ == "__main__":
    main()
