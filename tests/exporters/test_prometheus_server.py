"""A real Prometheus server scrapes the exporter while the reference runtime serves requests.

PromQL answers, read through Prometheus's HTTP API, must equal the recorder's
own numbers: its snapshot, and the HDF5 trace it dumps. Skips without the
``prometheus`` binary, except in CI (``CI`` set), where it fails.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from moetrace.exporters import prometheus
from moetrace.exporters.catalog import INFO, METRICS, PER_EXPERT, samples

from moetrace import balance
from moetrace.reference import free_port, launch
from moetrace.trace import open_trace
from tests.exporters import dashboard
from tests.exporters.promserver import Prometheus, require_prometheus
from tests.exporters.workload import MODEL, ep_worker, requests, serving_loop


def expected(spec, snap) -> dict[frozenset, float]:
    return {frozenset((k, str(v)) for k, v in labels.items()): float(value) for labels, value in samples(spec, snap)}


def by_layer(result: list[tuple[dict[str, str], float]]) -> dict[int, float]:
    return {int(labels["layer"]): value for labels, value in result}


def test_promql_equals_recorder_during_reference_serving(tmp_path):
    require_prometheus()
    loop, rec = serving_loop(tmp_path, timing=True)  # timing: the dashboard's phase and step panels need data
    with prometheus.start_http_server(0, recorder=rec, per_expert=True) as exporter, \
            Prometheus(tmp_path, {"moetrace": [f"127.0.0.1:{exporter.port}"]}) as prom:
        rec.start_record()
        # Serve until Prometheus has scraped the running workload at two different pass counts.
        seen: set[float] = set()
        last_query, deadline = 0.0, time.monotonic() + 60
        loop.submit(requests(5000))
        for _ in loop.steps():
            if time.monotonic() - last_query > 0.2:
                last_query = time.monotonic()
                seen.add(prom.value("moetrace_forward_passes_total") or 0.0)
                if len(seen - {0.0}) >= 2 or last_query > deadline:
                    loop.stop()
        assert len(seen - {0.0}) >= 2, f"Prometheus saw only {sorted(seen)} while the workload ran"
        rec.stop_record()
        snap = rec.snapshot()
        assert snap.num_passes > max(seen)
        prom.wait_for("moetrace_recording", 0)
        prom.wait_for("moetrace_forward_passes_total", snap.num_passes)

        # Every series of every metric equals the snapshot.
        for spec in (*METRICS, PER_EXPERT):
            # nan_ok: peak memory is NaN (unknown) on CPU on both sides; Prometheus exposes NaN as NaN.
            assert prom.series(spec) == pytest.approx(expected(spec, snap), rel=1e-15, nan_ok=True), spec.prom_name
        [(info, value)] = prom.query(INFO.prom_name)
        assert value == 1 and info["model"] == MODEL and info["engine"] == "moetrace.reference" and info["mode"] == "stat"

        # PromQL aggregates equal the recorder's own trace.
        with open_trace(rec.dump_record()) as trace:
            counts, layer_ids = trace.physical_count(), trace.layers
            assert prom.value("moetrace_tokens_total") == trace.num_tokens()[0] == snap.num_tokens
            assert prom.value("moetrace_forward_passes_total") == trace.num_passes()[0]
            np.testing.assert_array_equal(
                [by_layer(prom.query("sum by (layer) (moetrace_expert_routed_tokens_total)"))[i] for i in layer_ids],
                counts.sum(axis=1))
            np.testing.assert_array_equal(
                [by_layer(prom.query("count by (layer) (moetrace_expert_routed_tokens_total == 0)")).get(i, 0) for i in layer_ids],
                (counts == 0).sum(axis=1))
            np.testing.assert_array_equal(
                [by_layer(prom.query("moetrace_dropped_tokens_total"))[i] for i in layer_ids], trace.dropped_tokens()[0])
        assert snap.dropped.sum() > 0  # capacity 1.0 with skewed routing drops tokens
        # The workload was observed while it ran (several scrapes, growing counter).
        assert prom.value("changes(moetrace_forward_passes_total[5m])") >= 2

        # Every dashboard expression is valid PromQL with data behind it.
        for expr in dashboard.expressions(dashboard.load()):
            assert prom.query(dashboard.for_prometheus(expr)), f"dashboard expression returned nothing: {expr}"


@pytest.mark.slow
def test_one_exporter_per_ep_rank(tmp_path):
    """Two gloo EP ranks serve the reference model, each with its own exporter; one Prometheus scrapes both."""
    require_prometheus()
    ports = [free_port(), free_port()]
    with Prometheus(tmp_path, {"moetrace": [f"127.0.0.1:{p}" for p in ports]}) as prom:
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["passes"] = launch(ep_worker, 2, ports, str(tmp_path), backend="gloo", threads_per_rank=1, timeout=180)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        try:
            snaps = _scrape_ranks_while_serving(prom, tmp_path, thread, result)
            _check_ranks(prom, snaps)
        finally:
            (tmp_path / "done").touch()  # the workers close their exporters and exit
            thread.join()
    assert "error" not in result, result.get("error")
    assert snaps[0]["num_passes"] == snaps[1]["num_passes"] == result["passes"][0]  # lockstep ranks


def _scrape_ranks_while_serving(prom: Prometheus, tmp_path, thread: threading.Thread, result: dict) -> list[dict]:
    """Wait until both ranks were scraped mid-run, stop them, wait for Prometheus to hold their final values."""
    deadline = time.monotonic() + 120
    while len(prom.query("moetrace_forward_passes_total > 0")) < 2:
        assert thread.is_alive() and time.monotonic() < deadline, f"ranks never scraped while running: {result}"
        time.sleep(0.2)
    (tmp_path / "stop").touch()
    while not all((tmp_path / f"rank{r}.json").exists() for r in range(2)):
        assert thread.is_alive(), f"workers ended early: {result}"
        time.sleep(0.1)
    snaps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, snap in enumerate(snaps):
        prom.wait_for(f'moetrace_recording{{rank="{r}"}}', 0)
        prom.wait_for(f'moetrace_forward_passes_total{{rank="{r}"}}', snap["num_passes"])
    return snaps


def _check_ranks(prom: Prometheus, snaps: list[dict]) -> None:
    layers = (1, 2, 3)
    for r, snap in enumerate(snaps):
        load = prom.query(f'moetrace_rank_routed_tokens_total{{rank="{r}"}}')
        assert {(int(labels["layer"]), int(labels["ep_rank"])): v for labels, v in load} == {
            (layer, e): snap["rank_load"][i][e] for i, layer in enumerate(layers) for e in range(2)}
        assert prom.value(f'moetrace_balancedness{{rank="{r}"}}') == pytest.approx(snap["balancedness"], rel=1e-15)
        assert [by_layer(prom.query(f'moetrace_alltoall_actual_bytes_total{{rank="{r}"}}'))[i] for i in layers] == \
            snap["alltoall_bytes_actual"]
    # What rank s sent to rank r is what rank r received from rank s, across the two exporters.
    for r in range(2):
        for s in range(2):
            sent = by_layer(prom.query(f'moetrace_dispatch_sent_tokens_total{{rank="{s}", ep_rank="{r}"}}'))
            received = by_layer(prom.query(f'moetrace_dispatch_received_tokens_total{{rank="{r}", ep_rank="{s}"}}'))
            assert sent == received == {layer: snaps[s]["send_count"][i][r] for i, layer in enumerate(layers)}
    # The whole EP group's balancedness, computed in PromQL from the per-rank exporters.
    group_load = np.sum([snap["rank_load"] for snap in snaps], axis=0)
    promql = ("sum(avg by (layer) (sum by (layer, ep_rank) (moetrace_rank_routed_tokens_total)))"
              " / sum(max by (layer) (sum by (layer, ep_rank) (moetrace_rank_routed_tokens_total)))")
    assert prom.value(promql) == pytest.approx(balance.balancedness(group_load), rel=1e-12)
