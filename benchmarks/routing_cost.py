"""Cost of recording request→replica routing: time per decision and memory over many decisions.

- ``per decision``: the router's own ``route()`` over R replicas (a Mooncake
  request, caches warm) against ``route()`` + every ReplicaRecorder hook
  (arrival, decision with R candidates, start, first token, finish),
  interleaved in one process; the figure is the hooks' time per decision and
  its ratio to routing alone.
- ``memory``: RSS while the recorder takes N decisions (8 candidates each)
  sampled every N/10: it must stay flat (rows stream to the segment file).
- ``replay``: wall seconds to replay the Mooncake hour (12,031 requests) in
  simulated time, recorded, on 8 and 64 replicas (``constrained_locality``).

Run: ``.venv/bin/python benchmarks/routing_cost.py [--quick]``
"""

from __future__ import annotations

import argparse
import tempfile
import time

import psutil
from harness import interleaved, write_results

from moetrace.replicas import ReplicaRecorder
from moetrace.replicas.prefix_cache import PrefixCache
from moetrace.replicas.router import ReplicaRouter, RouteRequest
from moetrace.replicas.workload import load_trace


def _per_decision(replicas: int, rounds: int, inner: int, tmp: str) -> dict[str, float]:
    requests = load_trace(limit=2000)
    caches = [PrefixCache(20000) for _ in range(replicas)]
    for i, req in enumerate(requests[:1000]):
        caches[i % replicas].insert(req.hashes)
    router = ReplicaRouter(replicas, "cache_aware", block_size=512, caches=caches)
    probe = [RouteRequest(r.rid, r.input_tokens, r.hashes) for r in requests[1000:]]
    rec = ReplicaRecorder(replicas, output_dir=tmp, chunk_rows=4096, clock=lambda: 0.0)
    rec.start_record()
    counter = iter(range(1 << 62))

    def route_only() -> None:
        router.route(probe[next(counter) % len(probe)])

    def route_and_record() -> None:
        n = next(counter)
        req = probe[n % len(probe)]
        rid = str(n)
        rec.on_arrival(rid, req.input_tokens, t=0.0)
        d = router.route(req)
        rec.on_decision(rid, d.replica, "cache_aware", d.reason, d.candidates, t=0.0)
        rec.on_start(rid, t=0.1)
        rec.on_first_token(rid, t=0.2)
        rec.on_finish(rid, 10, d.chosen.match_tokens, t=1.0)

    t = interleaved({"route": route_only, "route+record": route_and_record}, rounds=rounds, inner=inner)
    rec.close()
    # CPU time of the whole process (the writer thread included) over whole chunks, robust to a busy shared machine
    rec = ReplicaRecorder(replicas, output_dir=tmp, chunk_rows=4096, clock=lambda: 0.0)
    rec.start_record()
    n = 5 * 4096
    cpu = {}
    for name, fn in (("route", route_only), ("route+record", route_and_record)):
        start = time.process_time()
        for _ in range(n):
            fn()
        if name == "route+record":
            with rec._lock:
                rec._flush()
            rec._segment.drain()  # the rows' streaming is part of the cost
        cpu[name] = (time.process_time() - start) / n
    rec.close()
    return {"route_us": t["route"] * 1e6, "route_record_us": t["route+record"] * 1e6,
            "record_us": (t["route+record"] - t["route"]) * 1e6, "ratio": t["route+record"] / t["route"],
            "route_cpu_us": cpu["route"] * 1e6, "record_cpu_us": (cpu["route+record"] - cpu["route"]) * 1e6}


def _memory(decisions: int, tmp: str) -> dict[str, object]:
    from moetrace.replicas import Candidate

    proc = psutil.Process()
    rec = ReplicaRecorder(8, output_dir=tmp, chunk_rows=8192, clock=lambda: 0.0)
    rec.start_record()
    cands = [Candidate(r, queue=r, match_blocks=r, match_tokens=512 * r) for r in range(8)]
    samples = []
    step = decisions // 10
    for i in range(decisions):
        rid = str(i)
        rec.on_arrival(rid, 4096, t=0.0)
        rec.on_decision(rid, i % 8, "cache_aware", "prefix_match", cands, t=0.0)
        rec.on_finish(rid, 10, 512, t=1.0)
        if (i + 1) % step == 0:
            samples.append({"decisions": i + 1, "rss_mb": proc.memory_info().rss / 2**20})
    path = rec.dump_record(f"{tmp}/mem.h5")
    rec.close()
    size = path.stat().st_size / 2**20
    return {"decisions": decisions, "rss_samples": samples, "rss_growth_mb": samples[-1]["rss_mb"] - samples[0]["rss_mb"], "trace_mb": size}


def _replay_speed(replicas: int, limit: int | None, tmp: str) -> dict[str, float]:
    from pathlib import Path

    from moetrace.replicas.simulate import REFERENCE_COST, scale_to_utilization, simulate

    requests = load_trace(limit=limit)
    cost = scale_to_utilization(requests, replicas, REFERENCE_COST, 0.9)
    start, cpu = time.perf_counter(), time.process_time()
    simulate(requests, replicas, "constrained_locality", block_size=512, cost=cost, cache_blocks=20000, out=Path(tmp) / f"r{replicas}.h5")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    span = requests[-1].arrival - requests[0].arrival
    return {"requests": len(requests), "trace_seconds": span, "wall_seconds": wall, "cpu_seconds": cpu, "speedup": span / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 200k decisions instead of 1M")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per = {f"{r} replicas": _per_decision(r, 5 if args.quick else 15, 200, tmp) for r in (8, 64)}
        mem = _memory(200_000 if args.quick else 1_000_000, tmp)
        speed = {f"{r} replicas": _replay_speed(r, 3000 if args.quick else None, tmp) for r in (8, 64)}
    for name, r in per.items():
        print(f"{name}: route {r['route_us']:.1f} us, route+record {r['route_record_us']:.1f} us -> recording {r['record_us']:.1f} us/decision ({r['ratio']:.2f}x); "
              f"CPU: route {r['route_cpu_us']:.1f} us, recording {r['record_cpu_us']:.1f} us")
    print(f"memory: {mem['decisions']:,} decisions, RSS {mem['rss_samples'][0]['rss_mb']:.0f} -> {mem['rss_samples'][-1]['rss_mb']:.0f} MiB, trace {mem['trace_mb']:.1f} MiB")
    for name, r in speed.items():
        print(f"replay {name}: {r['requests']} requests, {r['trace_seconds']:.0f} s of trace in {r['wall_seconds']:.1f} s wall, {r['cpu_seconds']:.1f} s CPU ({r['speedup']:.0f}x real time)")
    write_results("routing_cost", {"per_decision": per, "memory": mem, "replay": speed})


if __name__ == "__main__":
    main()
