"""The Grafana dashboard names only metrics the exporter emits, and has the panels operators need."""

from __future__ import annotations

from moetrace.exporters import prometheus
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.exporters import dashboard
from tests.exporters.workload import serve, serving_loop


def emitted_sample_names(tmp_path) -> set[str]:
    loop, rec = serving_loop(tmp_path, timing=True)  # timing: the phase and step histograms too
    rec.start_record()
    serve(loop, 4)
    text = generate_latest(prometheus.register(rec, per_expert=True)).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_expression_names_an_emitted_metric(tmp_path):
    emitted = emitted_sample_names(tmp_path)
    exprs = dashboard.expressions(dashboard.load())
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        names = set(dashboard.METRIC_NAME.findall(expr))
        assert names, f"expression names no moetrace metric: {expr}"
        assert names <= emitted, f"{expr} uses {sorted(names - emitted)}, which the exporter does not emit"
        used |= names
    assert {"moetrace_balancedness", "moetrace_layer_imbalance", "moetrace_layer_received_tokens_total"} <= used


def test_required_panels():
    panels = dashboard.load()["panels"]

    def find(kind: str, metric: str) -> list[dict]:
        return [p for p in panels if p["type"] == kind and any(metric in t["expr"] for t in p["targets"])]

    assert find("timeseries", "moetrace_balancedness"), "balancedness over time"
    heat = find("heatmap", "moetrace_layer_imbalance")
    assert heat and "{{layer}}" in heat[0]["targets"][0]["legendFormat"], "per-layer heatmap of imbalance"
    assert find("timeseries", "moetrace_expert_imbalance") and find("heatmap", "moetrace_layer_expert_imbalance"), "expert balance (needs no EP)"
    assert any("by (rank)" in t["expr"] for p in find("timeseries", "moetrace_layer_received_tokens_total") for t in p["targets"]), "per-rank load"
    assert find("timeseries", "moetrace_phase_seconds_sum"), "phase time per rank"
    assert any("topk(1" in t["expr"] for p in find("timeseries", 'phase="expert"') for t in p["targets"]), "slowest rank over time"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
