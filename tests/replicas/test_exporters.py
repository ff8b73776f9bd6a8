"""Replica metrics: Prometheus exposition (bounded labels, histograms) and OpenTelemetry, from one snapshot."""

from __future__ import annotations

from moetrace.exporters import replicas
from prometheus_client import generate_latest

from moetrace.replicas import Candidate, ReplicaRecorder


def _recorder(tmp_path) -> ReplicaRecorder:
    rec = ReplicaRecorder(2, output_dir=tmp_path)
    rec.start_record()
    for i in range(6):
        rid = f"r{i}"
        rec.on_arrival(rid, 100, t=0.0)
        rec.on_decision(rid, i % 2, "cache_aware", "prefix_match" if i % 3 else "smallest_cache", [Candidate(0, match_tokens=40), Candidate(1)], t=0.0)
        rec.on_start(rid, t=0.02)
        rec.on_first_token(rid, t=0.3)
        if i < 5:
            rec.on_finish(rid, 4, 40 if i % 2 == 0 else 0, t=1.0)
    return rec


def test_prometheus(tmp_path):
    rec = _recorder(tmp_path)
    text = generate_latest(replicas.register(rec)).decode()
    rec.close()
    assert 'moetrace_replica_decisions_total{policy="cache_aware",reason="prefix_match",replica="0"} 2.0' in text
    assert 'moetrace_replica_decisions_total{policy="cache_aware",reason="smallest_cache",replica="1"} 1.0' in text
    assert 'reason="random"' not in text  # combinations that never happened have no series
    assert 'moetrace_replica_hit_tokens_total{replica="0"} 120.0' in text
    assert 'moetrace_replica_miss_tokens_total{replica="1"} 200.0' in text
    assert 'moetrace_replica_regret_tokens_total{replica="1"} 120.0' in text
    assert 'moetrace_replica_running_requests{replica="1"} 1.0' in text
    assert 'moetrace_replica_ttft_seconds_bucket{le="0.25",replica="0"} 0.0' in text
    assert 'moetrace_replica_ttft_seconds_bucket{le="0.5",replica="0"} 3.0' in text
    assert 'moetrace_replica_ttft_seconds_count{replica="1"} 3.0' in text
    assert 'moetrace_replica_queue_wait_seconds_bucket{le="0.025",replica="1"} 3.0' in text


def test_opentelemetry(tmp_path):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    rec = _recorder(tmp_path)
    reader = InMemoryMetricReader()
    handle = replicas.create_otel_instruments(rec, meter_provider=MeterProvider(metric_readers=[reader]))
    data = reader.get_metrics_data()
    points = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    decisions = {(p.attributes["replica"], p.attributes["reason"]): p.value for p in points["moetrace.replica.decisions"].data.data_points}
    assert decisions == {("0", "prefix_match"): 2, ("0", "smallest_cache"): 1, ("1", "prefix_match"): 2, ("1", "smallest_cache"): 1}
    assert points["moetrace.replica.hit_tokens"].unit == "{token}"
    counts = {p.attributes["replica"]: p.value for p in points["moetrace.replica.ttft.count"].data.data_points}
    assert counts == {"0": 3, "1": 3}
    handle.close()
    rec.close()


def test_grafana_routing_dashboard_uses_exported_metrics(tmp_path):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-replicas-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]] + [v["query"]["query"] for v in dashboard["templating"]["list"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"\bmoetrace_[a-z0-9_]+\b", e)}
    rec = _recorder(tmp_path)
    text = generate_latest(replicas.register(rec)).decode()
    rec.close()
    exposed = set(re.findall(r"^# TYPE (moetrace_[a-z0-9_]+)", text, re.M))
    exposed |= {f"{name}_total" for name in exposed}
    assert used and used <= exposed, used - exposed
