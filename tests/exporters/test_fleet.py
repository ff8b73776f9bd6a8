"""A fleet of EP rank processes exports bounded series; a real Prometheus running the shipped rules gives the fleet view.

Four gloo ranks (:mod:`tests.exporters.fleet`: real recorder, each rank its own id and
layout, DP attention + all-to-all EP) record the same passes, each with its own exporter;
one Prometheus scrapes them every 0.5 s and evaluates ``moetrace-fleet.rules.yml``. The
rules' per-layer and overall balancedness must equal ``moetrace analyze`` of the ranks'
dumped traces, and each process must export exactly the series the documented formula
counts (O(layers) + the hot-expert top-N, no ``[layer, ep_rank]`` matrix).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from moetrace.exporters.catalog import rules_path, series_per_process

from moetrace.analysis.distributed import analyze_traces
from moetrace.reference import free_port, launch
from tests.exporters import fleet
from tests.exporters.promserver import Prometheus, require_prometheus

PASSES = 24


def test_rules_file_is_valid_promql():
    """``promtool check rules`` accepts the shipped file (promtool comes with the prometheus package)."""
    require_prometheus()
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing beside prometheus"
    result = subprocess.run([promtool, "check", "rules", str(rules_path())], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout


def _by_layer(result: list[tuple[dict[str, str], float]]) -> dict[int, float]:
    return {int(labels["layer"]): value for labels, value in result}


def _poll(read, expect, timeout: float = 30.0):
    """``read()`` until it equals ``expect()`` (rules run after the scrapes that carry the final values)."""
    deadline = time.monotonic() + timeout
    got = read()
    while got != expect and time.monotonic() < deadline:
        time.sleep(0.25)
        got = read()
    return got


def test_fleet_rules_equal_analyze(tmp_path):
    require_prometheus()
    shape = fleet.SMALL
    ports = [free_port() for _ in range(shape.ep)]
    targets = {"fleet": [f"127.0.0.1:{p}" for p in ports]}
    with Prometheus(tmp_path, targets, rule_files=[rules_path()]) as prom:
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["passes"] = launch(fleet.fleet_rank, shape.ep, shape.name, str(tmp_path), PASSES, 0, True, 0, 120.0,
                                          ports, backend="gloo", threads_per_rank=1, timeout=240)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        try:
            deadline = time.monotonic() + 180
            while not all((tmp_path / f"rank{r}.json").exists() for r in range(shape.ep)):
                assert thread.is_alive() and time.monotonic() < deadline, f"ranks ended or hung before recording: {result}"
                time.sleep(0.1)
            ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(shape.ep)]
            got_passes = _poll(lambda: prom.value(f"count(moetrace_forward_passes_total == {PASSES})"), float(shape.ep))
            assert got_passes == shape.ep, "Prometheus never held every rank's final pass count"
            report = analyze_traces([r["path"] for r in ranks])
            want_layers = {int(i): float(b) for i, b in zip(report.layer_ids, report.layer_balancedness, strict=True)}
            got_layers = _poll(lambda: _by_layer(prom.query("moetrace:layer_balancedness")), want_layers)
            overall = prom.value("moetrace:balancedness")
            imbalance = _by_layer(prom.query("moetrace:layer_imbalance"))
            straggler = prom.query("moetrace:straggler_received_tokens")
            series = prom.query('count by (rank) ({__name__=~"moetrace_.+", job="fleet"})')
            sent = _by_layer(prom.query("sum by (layer) (moetrace_layer_sent_tokens_total)"))
            received = _by_layer(prom.query("sum by (layer) (moetrace_layer_received_tokens_total)"))
        finally:
            (tmp_path / "done").touch()
            thread.join()
    assert "error" not in result, result.get("error")
    assert result["passes"] == [PASSES] * shape.ep

    # The rules' fleet view equals `moetrace analyze` of the same passes (float division order may differ: 1e-12).
    assert report.num_passes == PASSES and report.ep_size == shape.ep
    assert got_layers == pytest.approx(want_layers, rel=1e-12)
    assert overall == pytest.approx(report.balancedness, rel=1e-12)
    assert imbalance == pytest.approx({k: 1 / v for k, v in want_layers.items()}, rel=1e-12)
    assert min(want_layers.values()) < 0.95  # skewed routing: the comparison is not of 1.0 with 1.0
    load = np.asarray(report.rank_load).sum(axis=0)  # [R] copies each rank's experts received, over layers
    [(labels, value)] = straggler
    assert int(labels["rank"]) == int(np.argmax(load)) and value == load.max()
    # What the ranks sent is what the ranks received, per layer, across the exporters.
    assert sent == received == {int(i): float(c) for i, c in zip(report.layer_ids, np.asarray(report.rank_load).sum(axis=1), strict=True)}
    # Bounded: each process exports the documented count, O(layers) + top-N; the matrices were opt-in.
    want_series = series_per_process(shape.layers, shape.ep, shape.experts)
    assert {int(labels["rank"]): v for labels, v in series} == {r: want_series for r in range(shape.ep)}
    assert all(r["series"] == want_series < r["series_per_ep_rank"] for r in ranks)
    assert all(Path(r["path"]).exists() for r in ranks)
