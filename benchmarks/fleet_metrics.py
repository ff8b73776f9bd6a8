"""Live metrics of a DeepSeek-V3 fleet: 8 rank processes of EP72 scraped by a real Prometheus running the fleet rules.

Run: ``.venv/bin/python benchmarks/fleet_metrics.py [--quick]`` (needs the ``prometheus`` binary).

Eight processes stand for EP ranks 0..7 of a DeepSeek-V3 fleet (58 MoE layers 3..60,
256 experts on 288 slots, top-8, EP 72, DP attention, 128 tokens per rank per pass):
each runs the real recorder with its own rank id and layout
(:mod:`tests.exporters.fleet`), records the same ``--passes`` decode passes of the
fleet's deterministic routing (its own tokens through ``on_select_experts``, its
dispatch through ``on_dispatch``) and serves its default ``/metrics``. One Prometheus
scrapes them every 0.5 s and evaluates ``moetrace-fleet.rules.yml``. Reported:

- series per process (Prometheus's own count) and the formula's, by default and with
  ``per_ep_rank=True`` (the old default), and per fleet of 72 ranks;
- render time of one scrape per process (``generate_latest``), default vs
  ``per_ep_rank=True``, interleaved round by round in each process (median over processes
  of each process's median), and Prometheus's ``scrape_duration_seconds`` per target;
- the rules' per-layer balancedness over the 8 scraped ranks vs the same figure computed
  here in numpy from the fleet routing (received load of ranks 0..7);
- GIL: the longest gap of a 1 ms ticker thread in one process while the main thread
  renders scrapes back to back (default, per_ep_rank) and while it idles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.exporters.fleet: the simulated rank

from harness import write_results
from moetrace.exporters.catalog import rules_path, series_per_process
from prometheus_client import generate_latest

from moetrace import ExpertDistributionRecorder
from tests.exporters import fleet
from tests.exporters.promserver import Prometheus, free_port

LIVE = 8
ROOT = Path(__file__).resolve().parents[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def expected_balancedness(shape: fleet.FleetShape, passes: int, seed: int, ranks: int) -> np.ndarray:
    """Per-layer mean/max over ranks 0..ranks-1 of the copies their experts received, from the routing alone ``[L]``."""
    load = np.zeros((shape.layers, shape.ep), dtype=np.int64)
    for index in range(passes):
        load += fleet.copies_to_ranks(fleet.fleet_routing(shape, seed, index), shape).sum(axis=0)
    part = load[:, :ranks].astype(np.float64)
    return part.mean(axis=1) / part.max(axis=1)


def gil_gaps(shape: fleet.FleetShape, passes: int, rounds: int, out: Path) -> dict[str, float]:
    """Longest gap (ms) of a 1 ms ticker thread while this thread renders scrapes, or idles."""
    from moetrace.exporters import prometheus

    recorder = ExpertDistributionRecorder(fleet.recorder_config(shape, 3, out, mode="stat"))
    recorder.start_record()
    for index in range(passes):
        fleet.record_pass(recorder, shape, 0, index)
    recorder.stop_record()
    work = {"idle": lambda: time.sleep(0.05), "default": lambda: generate_latest(prometheus.register(recorder)),
            "per_ep_rank": lambda: generate_latest(prometheus.register(recorder, per_ep_rank=True))}
    gaps: dict[str, float] = {}
    for name, step in work.items():
        stop, worst = threading.Event(), [0.0]

        def tick(stop: threading.Event = stop, worst: list[float] = worst) -> None:
            last = time.perf_counter()
            while not stop.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                worst[0] = max(worst[0], now - last)
                last = now

        thread = threading.Thread(target=tick)
        thread.start()
        for _ in range(rounds):
            step()
        stop.set()
        thread.join()
        gaps[name] = worst[0] * 1e3
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15, help="render rounds per process")
    parser.add_argument("--quick", action="store_true", help="8 passes, 5 rounds")
    args = parser.parse_args()
    passes, rounds = (8, 5) if args.quick else (args.passes, args.rounds)
    shape = fleet.DSV3
    with tempfile.TemporaryDirectory(prefix="moetrace-fleet-") as tmp:
        out = Path(tmp)
        ports = [free_port() for _ in range(LIVE)]
        # 2 s: a loaded 2-core machine renders 8 scrapes at once; a 0.5 s timeout would drop some.
        with Prometheus(out, {"fleet": [f"127.0.0.1:{p}" for p in ports]}, rule_files=[rules_path()], interval_s=2.0) as prom:
            procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(ports[r]), str(out), str(passes), str(rounds)],
                                      cwd=ROOT) for r in range(LIVE)]
            try:
                start = time.monotonic()
                _wait(lambda: all((out / f"rank{r}.json").exists() for r in range(LIVE)), 1200, "the ranks' results")
                record_s = time.monotonic() - start
                _wait(lambda: prom.value(f"count(moetrace_forward_passes_total == {passes})") == LIVE, 60, "the final scrapes")
                want = expected_balancedness(shape, passes, 0, LIVE)
                want_by_layer = dict(zip(shape.layer_ids, want.tolist(), strict=True))

                def rules() -> dict[int, float]:
                    return {int(k["layer"]): v for k, v in prom.query("moetrace:layer_balancedness")}
                time.sleep(6.0)  # three rule evaluations after the final scrape
                got = rules()
                series = {int(k["rank"]): v for k, v in prom.query('count by (rank) ({__name__=~"moetrace_.+", job="fleet"})')}
                scrape = [v for _, v in prom.query('scrape_duration_seconds{job="fleet"}')]
                up = [v for _, v in prom.query('up{job="fleet"}')]
            finally:
                (out / "done").touch()
                for p in procs:
                    p.wait(timeout=120)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(LIVE)]
        gaps = gil_gaps(shape, passes, rounds * 2, out)
    render = {name: statistics.median(statistics.median(r["render_s"][name]) for r in ranks) * 1e3
              for name in ("default", "per_ep_rank")}
    per_process = series_per_process(shape.layers, shape.ep, shape.experts)
    old = series_per_process(shape.layers, shape.ep, shape.experts, per_ep_rank=True)
    payload = {
        "shape": {"layers": shape.layers, "experts": shape.experts, "slots": shape.slots, "top_k": shape.top_k, "ep": shape.ep,
                  "tokens_per_pass": shape.tokens},
        "live_processes": LIVE, "passes": passes, "render_rounds": rounds, "record_seconds": record_s,
        "series_per_process_prometheus": series, "series_per_process_formula": per_process,
        "series_per_process_per_ep_rank": old, "series_fleet_72": per_process * shape.ep, "series_fleet_72_per_ep_rank": old * shape.ep,
        "render_ms_median": render, "render_ratio": render["per_ep_rank"] / render["default"],
        "prometheus_scrape_seconds": {"median": statistics.median(scrape), "max": max(scrape)},
        "rules_vs_routing_max_abs_diff": max(abs(got.get(k, float("nan")) - w) for k, w in want_by_layer.items()),
        "rules_layers_seen": len(got), "targets_up": up,
        "rules_layer_balancedness_min": min(got.values()),
        "gil_longest_gap_ms": gaps,
    }
    print(json.dumps(payload, indent=2))
    write_results("fleet_metrics", payload)


_RANK = """
import sys
from tests.exporters import fleet
import torch
torch.set_num_threads(1)
rank, port, out, passes, rounds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ports = [0] * 72
ports[rank] = port
fleet.fleet_rank(rank, 72, "dsv3", out, passes, 0, dump=False, render_rounds=rounds, timeout=1800, ports=ports)
"""


if __name__ == "__main__":
    main()
