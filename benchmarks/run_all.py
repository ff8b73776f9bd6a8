"""``make bench``: run every benchmark, then write the summary table of docs/benchmarks.md.

Each benchmark is its own script (run in its own process, one after another so they do
not compete for cores) and writes ``benchmarks/results/<name>.json``. The headline
figures of those files are then written between the summary markers of
``docs/benchmarks.md``; the per-benchmark sections below the summary explain each one.

Run: ``.venv/bin/python benchmarks/run_all.py [--quick] [--only NAME ...] [--summary-only]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "benchmarks.md"
START, END = "<!-- summary:start -->", "<!-- summary:end -->"

Row = tuple[str, str, str]


def _recorder(d: dict) -> list[Row]:
    rows = []
    for workload in ("prefill (4096 tokens)", "decode (8 tokens)"):
        for variant in ("noop", "stat", "per_pass", "per_token"):
            end_to_end = d[workload][variant]["ratio"]
            hooks = d[workload].get(f"{variant} hooks")
            alone = f"; hooks alone {hooks['ms'] * 1e3:.0f} us = {hooks['ratio'] * 100:.2f}% of plain" if hooks else ""
            rows.append(("recorder overhead", f"{workload}, {variant} / plain", f"{end_to_end:.3f}{alone}"))
    return rows


def _hook_cost(d: dict) -> list[Row]:
    v = d["variants"]
    return [("hook cost", f"DeepSeek-V3 decode shape, {mode} hook / bare scatter_add_ ({d['shape']['device']})",
             f"{v[f'{mode} hooks']['ratio_to_bare']:.2f} ({v[f'{mode} hooks']['us_per_layer']:.1f} us)") for mode in ("stat", "per_pass", "per_token")]


def _request_rows(d: dict) -> list[Row]:
    rows = []
    for workload, r in d["results"]["cpu"].items():
        on = r["ratios"]["per_token+requests overhead (now, over off) / per_token overhead (before)"]
        off = r["ratios"]["per_token overhead: now / before"]
        over = r["overhead_ms_per_pass"]
        rows.append(("request rows overhead", f"DeepSeek-V3 rank, {workload}: per_token overhead with request rows (now) / before {d['before']} (forward-thread CPU)",
                     f"{on['median']:.3f} [{on['min']:.3f}, {on['max']:.3f}] ({over['before: per_token - off']:.2f} -> {over['now: per_token+requests - off']:.2f} ms/pass); "
                     f"no batch {off['median']:.3f}"))
    return rows


def _adapter(d: dict) -> list[Row]:
    r = d["results"]
    return [("adapter overhead (HF Mixtral)", f"{w}, {v} / plain", f"{r[w][v]['ratio_to_plain']:.3f} (hooks {r[w][v]['hook_us_per_forward']:.0f} us/forward)")
            for w in ("prefill", "decode") for v in ("moetrace", "moewatch")]


def _capture(d: dict) -> list[Row]:
    return [("capture overhead", "serving tokens/s, capture on / off (CPU time)", f"{d['cpu']['throughput_ratio_on_off']:.3f}"),
            ("capture overhead", "serving tokens/s, capture on / off (wall)", f"{d['wall']['throughput_ratio_on_off']:.3f}")]


def _ep(d: dict) -> list[Row]:
    rows = []
    for w in d["workloads"]:
        s = w["seconds_per_pass"]
        rows.append(("EP bench", f"{w['workload']} (T={w['tokens']}, H={w['hidden']}): EP exact 2 ranks vs dense 1 thread", f"{s['dense_1t'] / s['exact']:.2f}x throughput"))
        rows.append(("EP bench", f"{w['workload']}: EP padded vs dense 1 thread", f"{s['dense_1t'] / s['padded']:.2f}x throughput"))
    return rows


def _dump(d: dict) -> list[Row]:
    base, tok = d["baselines"], d["per_token"]
    rows = [("dump throughput", f"per_token record + stream + dump, {name} (MB/s of ids as int16)",
             f"{tok[name]['mb_s_int16']:.0f} vs numpy.save {base['numpy_save_mb_s_int16']:.0f}, memory copy {base['memcpy_mb_s_int16']:.0f} ({tok[name]['file_mb']:.0f} MB file)")
            for name in ("hooks only (stat mode)", "none", "lzf", "zstd:1") if name in tok]
    if "versus" in d:
        v = d["versus"]
        rows.append(("dump throughput", "per_token default path, before this change vs now (fresh processes, alternating)",
                     f"{v['median_mb_s_int16']['before']:.0f} vs {v['median_mb_s_int16']['now']:.0f} MB/s = {v['speedup']:.1f}x"))
    r = d["stat_dump"]["none"]
    rows.append(("dump throughput", "stat dump (compression none) vs numpy.save; vs numpy.save + fsync",
                 f"{r['ratio']:.2f}x; {r['ratio_fsync']:.2f}x ({r['moetrace_mb_s']:.0f} MB/s)"))
    return rows


def _dump_stall(d: dict) -> list[Row]:
    rows = []
    for name, case in d["cases"].items():
        r = case["while_recording"]
        rows.append(("dump stall", f"{name} passes at DeepSeek-V3 size, dump while recording: longest pass during it vs as many passes without a dump (median pass); lock held; dump",
                     f"{r['longest_pass_ms']:.0f} vs {r['control_longest_pass_ms']:.0f} ms ({r['normal_pass_ms']:.0f}); {r['longest_lock_hold_ms']:.1f} ms; {r['dump_ms_per_pass']:.2f} ms/pass"))
    return rows


def _analysis(d: dict) -> list[Row]:
    return [("analysis throughput", f"{mode}: streaming vs one-shot numpy", f"{r['streaming_records_per_s']:,.0f} vs {r['one_shot_records_per_s']:,.0f} {r['unit']}/s, peak memory {r['streaming_peak_bytes'] / 2**20:.0f} vs {r['one_shot_peak_bytes'] / 2**20:.0f} MiB")
            for mode, r in d["throughput"].items()]


def _scrape(d: dict) -> list[Row]:
    rows = []
    low, high = d["passes"]
    for path, r in d["results"].items():
        rows.append(("scrape cost", f"{path}: latency at {high:,} / {low:,} recorded passes", f"{r['ratio']:.2f} ({r[f'ms_{low}']:.1f} -> {r[f'ms_{high}']:.1f} ms)"))
    return rows


def _fleet_metrics(d: dict) -> list[Row]:
    r = d["render_ms_median"]
    return [("fleet metrics", f"DeepSeek-V3 rank: series default vs per_ep_rank; render one scrape ({d['live_processes']} live ranks)",
             f"{d['series_per_process_formula']:,} vs {d['series_per_process_per_ep_rank']:,}; {r['default']:.0f} vs {r['per_ep_rank']:.0f} ms ({d['render_ratio']:.1f}x)")]


def _fleet_traces(d: dict) -> list[Row]:
    rows = []
    for res in d["results"]:
        for tool in res["tools"]:
            seconds = "timeout" if tool["seconds"] is None else f"{tool['seconds']:.1f} s"
            peak = "-" if tool["peak_rss_mib"] is None else f"{tool['peak_rss_mib']:.0f} MiB"
            rows.append(("fleet traces", f"{res['ranks']} ranks x {res['passes_per_rank']} passes: {tool['tool']}", f"{seconds}, {peak}"))
    return rows


def _analysis_dask(d: dict) -> list[Row]:
    single, cluster = d["records_per_s"]["single process"], d["records_per_s"]["LocalCluster(2)"]
    return [("distributed analysis", f"{d['ranks']} per-rank traces, {d['records']:,} tokens: single process vs LocalCluster(2)",
             f"{single:,.0f} vs {cluster:,.0f} tokens/s ({d['speedup']:.2f}x; CPU efficiency {d['cpu_efficiency']:.2f}; load {d['load_average']:.1f})")]


def _control_load(d: dict) -> list[Row]:
    rows = []
    for name, r in d["configs"].items():
        hooks, probe = r["hooks_us"], r["probe_ms"]["flood"]
        rows.append(("control load", f"{name}, {d['idle']} idle + flood: hook wall flood / quiet (/ flood elsewhere)",
                     f"{r['hooks_wall_flood_over_quiet']:.2f} ({r['hooks_wall_flood_over_flood_other']:.2f}); "
                     f"{hooks['quiet']['wall_us']:.0f} -> {hooks['flood']['wall_us']:.0f} us"))
        rows.append(("control load", f"{name}: probe p50 / p99 during flood, server threads peak / bound",
                     f"{probe['p50_ms']:.0f} / {probe['p99_ms']:.0f} ms, {r['server_threads_peak']} / {r['server_thread_bound']}"))
    return rows


def _timing(d: dict) -> list[Row]:
    rows = []
    for workload in ("prefill (256 tok)", "decode (8 tok)"):
        r = d[workload]
        share = r["hooks_share_of_forward"]["timing on"]
        rows.append(("timing overhead", f"{workload}, reference model, timing on / off", f"{r['timing on']['ratio_to_off']:.3f}; timing calls alone {share * 100:.2f}% of the forward"))
    return rows


def _replay(d: dict) -> list[Row]:
    w, r = d["workload"], d["results"]
    return [("replay overhead", f"HF Mixtral training step ({w['batch']}x{w['seq']} tokens), {v} / plain (CPU time; wall)",
             f"{r[v]['cpu_ratio']:.3f}; {r[v]['wall_ratio']:.3f}") for v in ("replay", "replay_10pct_padding")] + [
        ("replay overhead", "hf.replay() + remove() alone, share of a plain step (CPU)", f"{d['install_ms'] / r['plain']['cpu_ms'] * 100:.2f}%"),
        ("replay overhead", "TopKReplay in every router (forward + backward), share of a plain step (wall)",
         f"{d['machinery_ms_per_step'] / r['plain']['wall_ms'] * 100:.2f}%")]


def _routing(d: dict) -> list[Row]:
    rows = [("routing cost", f"ReplicaRecorder, {name}: CPU per decision (all hooks + streaming) vs route() alone",
             f"{r['record_cpu_us']:.1f} vs {r['route_cpu_us']:.1f} us") for name, r in d["per_decision"].items()]
    m = d["memory"]
    rows.append(("routing cost", f"RSS over {m['decisions']:,} decisions (first -> last sample)",
                 f"{m['rss_samples'][0]['rss_mb']:.0f} -> {m['rss_samples'][-1]['rss_mb']:.0f} MiB"))
    rows += [("routing cost", f"Mooncake replay, {name} ({r['requests']} requests, {r['trace_seconds']:.0f} s of trace)", f"{r['cpu_seconds']:.1f} s CPU ({r['wall_seconds']:.1f} s wall)")
             for name, r in d["replay"].items()]
    return rows


def _placement(d: dict) -> list[Row]:
    rows = []
    for regime, r in d["by_regime"].items():
        m, g, o = r["moetrace"], r["greedy"], r["oracle"]
        rows.append(("placement backtest", f"{regime}: realised next-window balancedness, default vs greedy vs oracle (plan on {d['window']}, deploy for {d['every']} passes)",
                     f"{m['realized_mean']:.3f} vs {g['realized_mean']:.3f} vs {o['realized_mean']:.3f}; below greedy in {m['below_greedy_rebalances']:.0%} of rebalances; "
                     f"gap closed {m['gap_closed']:.0%}"))
    c = d["cost"][str(d["every"])]["moetrace"]  # JSON keys are strings
    rows.append(("placement rebalance cost", f"every {d['every']} passes: balance gained vs keeping; replicas moved; stall at {d['link_bytes_per_s'] / 1e9:g} GB/s",
                 f"{c['gain']:+.4f}; {c['moved']:.0f} ({c['bytes_moved'] / 1e9:.2f} GB); {1e3 * c['stall_s']:.2f} ms, pays above {1e3 * c['break_even_pass_s']:.2g} ms/pass"))
    return rows


def _report(d: dict) -> list[Row]:
    return [("report size", f"moetrace report of a {r['tokens']:,}-token per_token trace ({r['trace_bytes'] / 1e6:.1f} MB)",
             f"{r['report_bytes'] / 1e6:.2f} MB ({r['report_bytes_without_plotly_js'] / 1e3:.0f} kB besides plotly.js)")
            for r in d["rows"]]


def _traffic(d: dict) -> list[Row]:
    return [("traffic", f"moetrace traffic of {d['ranks']} DeepSeek-V3 per-rank {r['mode']} traces x {r['passes']} passes",
             f"{r['seconds']:.1f} s, {r['peak_rss_mib']:.0f} MiB, {'exact' if r['exact'] else 'NOT exact'}") for r in d["rows"]]


#: name -> (script arguments in full / quick runs, headline extractor)
BENCHMARKS: dict[str, tuple[list[str], list[str], Callable[[dict], list[Row]]]] = {
    "recorder_overhead": ([], ["--quick"], _recorder),
    "hook_cost": ([], ["--quick"], _hook_cost),
    "request_rows_overhead": ([], ["--quick"], _request_rows),
    "adapter_overhead": ([], ["--rounds", "4"], _adapter),
    "capture_overhead": ([], ["--rounds", "4"], _capture),
    "ep_bench": (["--compare"], ["--compare", "--workload", "seed"], _ep),
    "dump_throughput": ([], ["--quick"], _dump),
    "dump_stall": ([], ["--quick"], _dump_stall),
    "analysis_throughput": ([], ["--quick"], _analysis),
    "scrape_cost": ([], ["--quick"], _scrape),
    "fleet_metrics": ([], ["--quick"], _fleet_metrics),
    "fleet_traces": ([], ["--quick"], _fleet_traces),
    "routing_cost": ([], ["--quick"], _routing),
    "replay_overhead": ([], ["--rounds", "4"], _replay),
    "timing_overhead": ([], ["--quick"], _timing),
    "control_load": ([], ["--quick"], _control_load),
    "analysis_dask": ([], ["--quick"], _analysis_dask),
    "placement_backtest": ([], ["--quick"], _placement),
    "report_size": ([], ["--quick"], _report),
    "traffic_fleet": ([], ["--quick"], _traffic),
}


def summary_table() -> str:
    """Markdown table of the headline figure of every results file present."""
    lines = ["| benchmark | figure | value |", "|---|---|---:|"]
    for name, (_, _, extract) in BENCHMARKS.items():
        path = HERE / "results" / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | not run yet | - |")
            continue
        try:
            rows = extract(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            rows = [(name, f"results file not understood ({exc!r})", "-")]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def write_summary() -> None:
    text = DOCS.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOCS} lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{START}\n{summary_table()}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller, shorter runs")
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), help="run only these")
    parser.add_argument("--summary-only", action="store_true", help="only rewrite the summary from existing results")
    args = parser.parse_args()
    failed = []
    if not args.summary_only:
        for name, (full, quick, _) in BENCHMARKS.items():
            if args.only and name not in args.only:
                continue
            command = [sys.executable, str(HERE / f"{name}.py"), *(quick if args.quick else full)]
            print(f"== {name}: {' '.join(command[1:])}", flush=True)
            start = time.perf_counter()
            if subprocess.run(command, check=False).returncode != 0:
                failed.append(name)
            print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    write_summary()
    print(f"summary written to {DOCS}")
    if failed:
        raise SystemExit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
