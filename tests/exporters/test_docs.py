"""docs/observability.md carries the metric reference table generated from the catalog."""

from __future__ import annotations

from pathlib import Path

from moetrace.exporters import catalog, label_load, replay_audit, replicas, route_checks
from moetrace.exporters.catalog import ALL, INFO, METRICS, markdown_table
from moetrace.exporters.spec import MetricSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def test_metric_table_matches_catalog():
    text = DOC.read_text()
    assert markdown_table() in text, "regenerate the table: python -c 'from moetrace.exporters.catalog import markdown_table; print(markdown_table())'"
    for spec in (*ALL, INFO):
        assert f"`{spec.prom_name}`" in text and f"`{spec.otel_name}`" in text


def test_metric_names_follow_conventions():
    for spec in ALL:
        assert spec.prom_name.startswith("moetrace_") and ":" not in spec.prom_name
        assert spec.prom_name.endswith("_total") == (spec.kind == "counter"), spec.prom_name
        assert spec.otel_name.startswith("moetrace.") and spec.unit in ("{pass}", "{token}", "{id}", "{expert}", "{error}", "{file}", "{request}", "1", "s", "By")
    names = [s.prom_name for s in METRICS]
    assert len(names) == len(set(names))


def test_one_spec_type_for_every_exported_metric():
    """Recorder, replica, label, replay-audit and route-check metrics are all declared as one MetricSpec type, names unique."""
    specs = (*catalog.ALL, *catalog.HISTOGRAMS, catalog.INFO, *replicas.REPLICA_METRICS, *replicas.REPLICA_HISTOGRAMS,
             *label_load.LABEL_METRICS, *replay_audit.REPLAY_METRICS, *route_checks.ROUTE_CHECK_METRICS)
    assert all(type(spec) is MetricSpec for spec in specs)
    for names in ([s.prom_name for s in specs], [s.otel_name for s in specs]):
        assert len(names) == len(set(names))
