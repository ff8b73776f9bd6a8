"""The Prometheus collector and HTTP server, read through prometheus_client's own parser."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
from moetrace.exporters import prometheus
from moetrace.exporters.catalog import (
    ALL,
    INFO,
    METRICS,
    PER_EP_RANK,
    PER_EXPERT,
    samples,
    series_per_process,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import moetrace
from moetrace import ExpertDistributionRecorder
from moetrace.testing import assert_no_host_sync
from tests.exporters.workload import MODEL, rank_config, route_pass, routers


def parse(text: str) -> dict[str, dict[frozenset, float]]:
    """``{sample name: {frozenset(labels): value}}``."""
    out: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def expected(spec, snap) -> dict[frozenset, float]:
    return {frozenset((k, str(v)) for k, v in labels.items()): float(value) for labels, value in samples(spec, snap)}


@pytest.fixture
def recorded(tmp_path):
    rec = ExpertDistributionRecorder(rank_config(tmp_path, ep_size=4, ep_rank=2))
    layer_routers, gen = routers(), torch.Generator().manual_seed(0)
    rec.start_record()
    for _ in range(6):
        route_pass(rec, layer_routers, 40, gen)
    return rec


def test_scrape_equals_snapshot(recorded):
    snap = recorded.snapshot()
    scraped = parse(generate_latest(prometheus.register(recorded, per_expert=True, per_ep_rank=True)).decode())
    for spec in ALL:
        assert scraped[spec.prom_name] == pytest.approx(expected(spec, snap), rel=1e-15, nan_ok=True), spec.prom_name
    (info,) = scraped[INFO.prom_name]
    assert dict(info) == {"rank": "2", "model": MODEL, "engine": "moetrace.reference", "mode": "stat",
                          "id_space": "logical", "ep_size": "4", "layout": "TP1 EP4", "global_rank": "0", "tp_rank": "0",
                          "dp_rank": "0", "pp_rank": "0", "replica": "false"}
    # headline numbers, independently of the catalog
    assert scraped["moetrace_forward_passes_total"] == {frozenset({("rank", "2")}): 6.0}
    assert scraped["moetrace_tokens_total"][frozenset({("rank", "2")})] == 240
    layers = {dict(k)["layer"] for k in scraped["moetrace_layer_imbalance"]}
    assert layers == {"1", "2", "3"}  # model layer ids, not compact indices
    assert len(scraped["moetrace_rank_routed_tokens_total"]) == 3 * 4
    assert 0 < scraped["moetrace_balancedness"][frozenset({("rank", "2")})] < 1  # OLMoE-fitted routing is skewed
    assert sum(scraped["moetrace_dropped_tokens_total"].values()) == snap.dropped.sum() > 0  # capacity_factor=1


def test_per_expert_series_only_when_asked(recorded):
    names = parse(generate_latest(prometheus.register(recorded)).decode())
    assert PER_EXPERT.prom_name not in names
    assert set(names) == {spec.prom_name for spec in METRICS} | {INFO.prom_name}


def test_default_series_are_bounded_by_layers(recorded):
    """By default a rank exports O(layers) series plus the hot-expert top-N; the [layer, ep_rank] matrices are opt-in."""
    snap = recorded.snapshot()
    default = parse(generate_latest(prometheus.register(recorded)).decode())
    full = parse(generate_latest(prometheus.register(recorded, per_ep_rank=True)).decode())
    L, R, E = len(snap.layer_ids), snap.ep_size, snap.logical_count.shape[1]
    assert sum(map(len, default.values())) == series_per_process(L, R, E)
    assert sum(map(len, full.values())) == series_per_process(L, R, E, per_ep_rank=True) == series_per_process(L, R, E) + 3 * L * R
    assert not {spec.prom_name for spec in PER_EP_RANK} & set(default)
    assert len(default["moetrace_hot_expert_routed_tokens"]) == 10  # 3 layers x 16 experts: a top-10
    # The per-layer sums of the matrices are what the default series carry.
    for matrix, total in (("moetrace_dispatch_sent_tokens_total", "moetrace_layer_sent_tokens_total"),
                          ("moetrace_dispatch_received_tokens_total", "moetrace_layer_received_tokens_total")):
        sums: dict[frozenset, float] = {}
        for labels, value in full[matrix].items():
            key = frozenset((k, v) for k, v in labels if k != "ep_rank")
            sums[key] = sums.get(key, 0.0) + value
        assert sums == default[total]
    assert sum(default["moetrace_layer_sent_tokens_total"].values()) == snap.send_count.sum() > 0
    # the hottest cells are the largest logical counts, with their model layer ids
    hot = sorted(default["moetrace_hot_expert_routed_tokens"].values(), reverse=True)
    assert hot == sorted(snap.logical_count.reshape(-1).tolist(), reverse=True)[:10]
    for labels, value in default["moetrace_hot_expert_routed_tokens"].items():
        d = dict(labels)
        assert snap.logical_count[list(snap.layer_ids).index(int(d["layer"])), int(d["expert"])] == value


def test_unknown_metric_option_is_refused():
    from moetrace.exporters.catalog import ALL as specs
    from moetrace.exporters.spec import enabled

    with pytest.raises(ValueError, match="unknown metric option"):
        enabled(specs, per_rank=True)


def test_global_recorder_looked_up_per_scrape(tmp_path):
    registry = prometheus.register()  # recorder=None
    assert generate_latest(registry) == b""  # no-op recorder: nothing to report
    rec = moetrace.configure(num_layers=2, num_physical_experts=4, top_k=1)
    rec.start_record()
    scraped = parse(generate_latest(registry).decode())
    assert scraped["moetrace_recording"] == {frozenset({("rank", "0")}): 1.0}
    moetrace.set_recorder(None)
    assert generate_latest(registry) == b""


def test_private_registry_and_name_clash(recorded):
    shared = CollectorRegistry()
    assert prometheus.register(recorded, registry=shared) is shared
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        prometheus.register(recorded, registry=shared)
    assert prometheus.register(recorded) is not prometheus.register(recorded)


def test_http_server_serves_and_closes(recorded):
    with prometheus.start_http_server(0, recorder=recorded) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url) as resp:
            scraped = parse(resp.read().decode())
        assert scraped["moetrace_forward_passes_total"][frozenset({("rank", "2")})] == 6
        port = server.port
    server.close()  # idempotent
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):  # nobody listens any more
        sock.connect(("127.0.0.1", port))


def test_http_server_port_in_use_is_clear(recorded):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        registry = CollectorRegistry()
        with pytest.raises(OSError, match=r"cannot serve metrics on 127\.0\.0\.1"):
            prometheus.start_http_server(sock.getsockname()[1], recorder=recorded, registry=registry)
        prometheus.register(recorded, registry=registry)  # the failed start left nothing registered


def test_scrapes_alongside_sync_free_hooks(recorded):
    """Hooks stay sync-free while scrapes run concurrently; scrapes see monotonic, complete passes.

    (A scrape reads the host copy the recorder made at pass end, so it never waits for the device.)
    """
    registry = prometheus.register(recorded, per_expert=True)
    stop = threading.Event()
    scrapes = []

    def scrape() -> None:
        while not stop.is_set():
            scrapes.append(parse(generate_latest(registry).decode())["moetrace_forward_passes_total"])
            time.sleep(0.05)

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        gen = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, 16, (32, 2), generator=gen) for _ in range(5)]
        # Keep passes coming until several scrapes ran concurrently (bounded: a fast machine
        # finishes a handful of passes before the scrape thread's first turn).
        for step in range(20000):
            if len(scrapes) >= 3 and step >= 5:
                break
            with assert_no_host_sync(), recorded.with_forward_pass():
                for layer in range(3):
                    with recorded.with_current_layer(layer):
                        recorded.on_select_experts(ids[step % len(ids)])
    finally:
        stop.set()
        thread.join()
    passes = [next(iter(s.values())) for s in scrapes]
    # Monotonic, and never ahead of the recorder.
    assert len(passes) >= 3 and passes == sorted(passes) and passes[-1] <= recorded.num_passes
    assert parse(generate_latest(registry).decode())["moetrace_forward_passes_total"] == {frozenset({("rank", "2")}): float(recorded.num_passes)}
    np.testing.assert_array_equal(recorded.snapshot().physical_count.sum(1), recorded.snapshot().tokens_per_layer)
