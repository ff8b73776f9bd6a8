"""Control and metrics endpoints under hostile load: server threads, latency, and the hooks' cost during a flood.

Run: ``.venv/bin/python benchmarks/control_load.py [--quick]``

This process records (a stat-mode recorder of the reference model's shape: 3
MoE layers, 16 experts, top-2) and serves one endpoint: the control endpoint
(``GET /status``) or the Prometheus exporter (``GET /metrics``), with the
default :class:`~moetrace.http.ServerLimits` except a read timeout
long enough to hold the idle connections for the whole run, and once more
for ``/status`` without the request and CPU budgets
(``max_requests_per_second=None, max_cpu_share=None``). A load
client in its own process (``tests/control/load.py``) holds 300 connections
that sent half a request line, probes the endpoint every 20 ms, and its 8
threads flood valid requests back to back in some phases.

Rounds rotate three phases: ``quiet``; ``flood`` (at this process's server);
``flood-other`` (the same flood at an identical server in another process:
the machine's CPU contention without this process serving it). In each
phase this process times the recorder's hooks (``with_forward_pass`` +
``on_select_experts`` of 8 tokens: decode, where the hooks' Python overhead
matters most), in wall-clock and in its own CPU time. ``flood / flood-other``
is the cost of serving the flood inside the engine's process.

Afterwards the server is closed, and the benchmark checks that its threads
and file descriptors are released and that the client saw every idle
connection closed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.control.load: the load client

from harness import write_results
from moetrace.exporters import prometheus

from moetrace import control
from moetrace.http import ServerLimits
from tests.control.load import LoadClient, hook_cost, open_sockets, server_threads
from tests.exporters.workload import serving_loop

IDLE, CONCURRENCY, TOKENS = 300, 8, 8
PHASES = ("quiet", "flood", "flood-other")
#: name -> (endpoint kind, default budgets (True) or none (False))
CONFIGS = {
    "control /status": ("control", True),
    "control /status, no limits": ("control", False),
    "metrics /metrics": ("metrics", True),
}


def recorder(out: Path):
    """A recording stat-mode recorder of the reference model's shape."""
    _, rec = serving_loop(out)
    rec.start_record()
    return rec


def serve(kind: str, budgets: bool, rec, read_timeout: float):
    """The endpoint of ``rec`` in this process: (server, inner guarded server, path)."""
    limits = ServerLimits(read_timeout=read_timeout)
    if not budgets:
        limits = dataclasses.replace(limits, max_requests_per_second=None, max_cpu_share=None)
    if kind == "control":
        server = control.serve_control(rec, limits=limits)
        return server, server._server, "/status"
    server = prometheus.start_http_server(0, recorder=rec, limits=limits)
    return server, server.server, "/metrics"


def serve_other(kind: str, budgets: bool, read_timeout: float) -> None:
    """``--other``: the same endpoint in this (separate) process; prints its port, serves until stdin closes."""
    with tempfile.TemporaryDirectory() as tmp:
        server, _, _ = serve(kind, budgets, recorder(Path(tmp)), read_timeout)
        print(server.port, flush=True)
        sys.stdin.read()
        server.close()


def run(name: str, kind: str, budgets: bool, rounds: int, phase_seconds: float, tmp: Path) -> dict[str, object]:
    read_timeout = rounds * len(PHASES) * phase_seconds * 3 + 30
    other = subprocess.Popen([sys.executable, __file__, "--other", kind, str(int(budgets)), str(read_timeout)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rec = recorder(tmp / name.replace(" ", "_").replace("/", ""))
    ids = torch.randint(0, 16, (TOKENS, 2), generator=torch.Generator().manual_seed(0))
    hook_cost(rec, ids, 0.2)  # warm-up (and the recorder's own threads started)
    me = psutil.Process()
    threads_before, sockets_before = threading.active_count(), open_sockets()
    try:
        assert other.stdout is not None
        other_port = int(other.stdout.readline())
        server, inner, path = serve(kind, budgets, rec, read_timeout)
        try:
            with LoadClient(server.port, path=path, idle=IDLE, concurrency=CONCURRENCY, other_port=other_port) as client:
                deadline = time.monotonic() + 30
                while inner.open_connections < IDLE and time.monotonic() < deadline:
                    time.sleep(0.05)
                held = inner.open_connections
                costs: dict[str, list[dict[str, float]]] = {p: [] for p in PHASES}
                peak_threads, peak_os_threads = 0, 0
                for r in range(rounds):
                    for phase in PHASES[r % 3:] + PHASES[: r % 3]:
                        if phase == "quiet":
                            client.quiet()
                        else:
                            client.flood(other=phase == "flood-other")
                        time.sleep(0.05)  # let the flood ramp up
                        costs[phase].append(hook_cost(rec, ids, phase_seconds))
                        peak_threads = max(peak_threads, server_threads())
                        peak_os_threads = max(peak_os_threads, me.num_threads())
                client.stop()
                served_cpu, lifetime = inner.served_cpu_seconds, time.monotonic() - deadline + 30
                server.close()
                summary = client.finish()
        finally:
            server.close()
    finally:
        if other.stdin is not None:
            other.stdin.close()
        other.wait(timeout=60)
    released_threads = threading.active_count() == threads_before and server_threads() == 0
    hooks = {p: {k: statistics.median(c[k] for c in costs[p]) for k in ("wall_us", "cpu_us")} for p in PHASES}
    latency = summary["latency"]
    return {
        "endpoint": path, "limits": dataclasses.asdict(inner.limits),
        "idle_held_during_run": held, "hooks_us": hooks,
        "hooks_wall_flood_over_quiet": hooks["flood"]["wall_us"] / hooks["quiet"]["wall_us"],
        "hooks_wall_flood_over_flood_other": hooks["flood"]["wall_us"] / hooks["flood-other"]["wall_us"],
        "hooks_cpu_flood_over_quiet": hooks["flood"]["cpu_us"] / hooks["quiet"]["cpu_us"],
        "ok_per_s": summary["ok_per_s"], "outcomes": summary["outcomes"],
        "probe_ms": {p: latency.get(f"probe {p}", {"count": 0}) for p in PHASES},
        "server_threads_peak": peak_threads, "server_thread_bound": 1 + inner.limits.max_workers,
        "process_os_threads_peak": peak_os_threads,
        "served_cpu_share": served_cpu / lifetime,
        "released": {"threads": released_threads, "sockets": open_sockets() == sockets_before,
                     "idle_closed": summary["idle_closed_by_server"], "idle": IDLE},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.5 s phases instead of 6 of 1 s")
    parser.add_argument("--other", nargs=3, metavar=("KIND", "BUDGETS", "READ_TIMEOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.other:
        kind, budgets, read_timeout = args.other
        serve_other(kind, budgets == "1", float(read_timeout))
        return
    rounds, phase_seconds = (3, 0.5) if args.quick else (6, 1.0)
    results: dict[str, object] = {"idle": IDLE, "concurrency": CONCURRENCY, "tokens": TOKENS, "rounds": rounds,
                                  "phase_seconds": phase_seconds, "configs": {}}
    print(f"control endpoint load: {IDLE} idle half-sent connections, {CONCURRENCY} flood threads in another process; "
          f"median of {rounds} rotated rounds of {phase_seconds} s per phase")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, budgets) in CONFIGS.items():
            r = run(name, kind, budgets, rounds, phase_seconds, Path(tmp))
            results["configs"][name] = r  # type: ignore[index]
            h, probe = r["hooks_us"], r["probe_ms"]
            limits = r["limits"]
            print(f"\n== {name} (max_requests_per_second={limits['max_requests_per_second']}, "
                  f"max_cpu_share={limits['max_cpu_share']}); {r['idle_held_during_run']} idle connections held")
            print(f"{'phase':<13}{'hook wall us':>14}{'hook CPU us':>13}{'probe p50 ms':>14}{'probe p99 ms':>14}{'200/s':>9}")
            for p in PHASES:
                pr = probe[p]
                print(f"{p:<13}{h[p]['wall_us']:>14.1f}{h[p]['cpu_us']:>13.1f}{pr.get('p50_ms', float('nan')):>14.1f}"
                      f"{pr.get('p99_ms', float('nan')):>14.1f}{r['ok_per_s'].get(p, 0.0):>9.0f}")
            print(f"hook wall flood / quiet {r['hooks_wall_flood_over_quiet']:.2f}, flood / flood-other "
                  f"{r['hooks_wall_flood_over_flood_other']:.2f}; server threads peak {r['server_threads_peak']} "
                  f"(bound {r['server_thread_bound']}); served CPU share {r['served_cpu_share']:.3f}; "
                  f"outcomes {r['outcomes']}; released {r['released']}")
    print(f"wrote {write_results('control_load', results)}")


if __name__ == "__main__":
    main()
