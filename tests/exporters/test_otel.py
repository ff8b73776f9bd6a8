"""OpenTelemetry: instruments read through the SDK equal the snapshot; OTLP/HTTP reaches a receiver; spans."""

from __future__ import annotations

import gzip
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from moetrace.exporters import otel
from moetrace.exporters.catalog import ALL, INFO, METRICS, info_labels, samples
from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge,
    InMemoryMetricReader,
    PeriodicExportingMetricReader,
    Sum,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from moetrace import RecorderStateError
from moetrace.recorder import ExpertDistributionRecorder
from moetrace.reference import Request
from tests.exporters.workload import rank_config, route_pass, routers, serving_loop
from tests.servers import SUBPROCESS_BOUND_S


def expected(spec, snap) -> dict[frozenset, float]:
    return {frozenset(labels.items()): value for labels, value in samples(spec, snap)}


def read(reader: InMemoryMetricReader) -> dict[str, object]:
    """``{instrument name: metric}`` of the ``moetrace`` scope."""
    data = reader.get_metrics_data()
    scopes = [sm for rm in data.resource_metrics for sm in rm.scope_metrics if sm.scope.name == "moetrace"]
    assert len(scopes) == 1
    return {m.name: m for m in scopes[0].metrics}


def points(metric) -> dict[frozenset, float]:
    return {frozenset(p.attributes.items()): p.value for p in metric.data.data_points}


def run_passes(rec: ExpertDistributionRecorder, count: int, seed: int) -> None:
    layer_routers, gen = routers(), torch.Generator().manual_seed(seed)
    for _ in range(count):
        route_pass(rec, layer_routers, 48, gen)


@pytest.fixture
def recorded(tmp_path):
    """EP rank 1 of 4, five passes of OLMoE-biased routing."""
    rec = ExpertDistributionRecorder(rank_config(tmp_path, ep_size=4, ep_rank=1))
    rec.start_record()
    run_passes(rec, 5, seed=0)
    return rec


def _unknown(spec, snap) -> bool:
    """Every value of ``spec`` is NaN (unknown), e.g. peak device memory on CPU."""
    return all(v != v for v in expected(spec, snap).values())


def test_in_memory_reader_equals_snapshot(recorded):
    reader = InMemoryMetricReader()
    handle = otel.create_otel_instruments(MeterProvider(metric_readers=[reader]), recorded, per_expert=True, per_ep_rank=True)
    for round_ in range(2):
        got, snap = read(reader), recorded.snapshot()
        for spec in ALL:
            if _unknown(spec, snap):  # NaN (e.g. peak memory on CPU): the SDK reports no point
                assert spec.otel_name not in got
                continue
            metric = got[spec.otel_name]
            assert metric.unit == spec.unit and metric.description == spec.help
            if spec.kind == "counter":
                assert isinstance(metric.data, Sum) and metric.data.is_monotonic
            else:
                assert isinstance(metric.data, Gauge)
            assert points(metric) == pytest.approx(expected(spec, snap), rel=1e-15), spec.otel_name
        assert points(got[INFO.otel_name]) == {frozenset(info_labels(snap).items()): 1}
        assert points(got["moetrace.forward_passes"]) == {frozenset({("rank", 1)}): 5 + 3 * round_}
        run_passes(recorded, 3, seed=1 + round_)  # the next collection takes a fresh snapshot
    handle.close()
    data = reader.get_metrics_data()
    remaining = [] if data is None else [
        p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points]
    assert remaining == []  # closed: callbacks report nothing


def test_per_expert_only_when_asked(recorded):
    reader = InMemoryMetricReader()
    otel.create_otel_instruments(MeterProvider(metric_readers=[reader]), recorded)
    snap = recorded.snapshot()  # no timing here: the histograms' counters and NaN gauges report no points
    assert set(read(reader)) == {spec.otel_name for spec in METRICS if not _unknown(spec, snap)} | {INFO.otel_name}


def test_library_never_sets_a_global_provider(recorded, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("moetrace must not install a global provider")

    monkeypatch.setattr(metrics, "set_meter_provider", refuse)
    monkeypatch.setattr(trace, "set_tracer_provider", refuse)
    reader = InMemoryMetricReader()
    otel.create_otel_instruments(MeterProvider(metric_readers=[reader]), recorded)
    otel.create_otel_instruments(None, recorded)  # the global (no-op proxy) provider: accepted, nothing installed
    read(reader)
    otel.traced_stop_record(recorded)
    otel.traced_dump_record(recorded)


def test_global_provider_is_used_when_none_is_passed(tmp_path):
    """In a fresh interpreter: the application sets the global provider, moetrace uses it."""
    script = textwrap.dedent(f"""
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        import torch
        from moetrace.exporters import otel
        from moetrace.recorder import ExpertDistributionRecorder
        from moetrace import RecorderConfig
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, output_dir={str(tmp_path)!r}))
        rec.start_record()
        with rec.with_forward_pass(), rec.with_current_layer(0):
            rec.on_select_experts(torch.tensor([[0], [3], [3]]))
        otel.create_otel_instruments(recorder=rec)
        data = reader.get_metrics_data()
        [scope] = [s for r in data.resource_metrics for s in r.scope_metrics if s.scope.name == "moetrace"]
        values = {{m.name: [p.value for p in m.data.data_points] for m in scope.metrics}}
        print(values["moetrace.forward_passes"], values["moetrace.layer.routed_tokens"], values["moetrace.layer.dead_experts"])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=SUBPROCESS_BOUND_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1]", "[3]", "[2]"]


class _Receiver(BaseHTTPRequestHandler):
    """Collects OTLP/HTTP metric exports (protobuf, optionally gzip)."""

    requests: list[ExportMetricsServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportMetricsServiceRequest()
        message.ParseFromString(body)
        self.server.requests.append((self.path, self.headers.get("Content-Type"), message))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_otlp_http_export_reaches_a_receiver(recorded):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"http://127.0.0.1:{server.server_port}/v1/metrics"), export_interval_millis=3_600_000)])
    try:
        otel.create_otel_instruments(provider, recorded, per_expert=True, per_ep_rank=True)
        assert provider.force_flush(timeout_millis=30_000)
    finally:
        provider.shutdown()
        server.shutdown()
        server.server_close()
    assert server.requests, "no OTLP export arrived"  # type: ignore[attr-defined]
    path, content_type, message = server.requests[0]  # type: ignore[attr-defined]
    assert path == "/v1/metrics" and content_type == "application/x-protobuf"
    got: dict[str, dict[frozenset, float]] = {}
    for rm in message.resource_metrics:
        for sm in rm.scope_metrics:
            if sm.scope.name != "moetrace":
                continue
            for m in sm.metrics:
                data = m.sum if m.HasField("sum") else m.gauge
                got[m.name] = {
                    frozenset((a.key, a.value.int_value if a.value.HasField("int_value") else a.value.string_value) for a in p.attributes):
                    (p.as_int if p.HasField("as_int") else p.as_double)
                    for p in data.data_points
                }
                if m.HasField("sum"):
                    assert m.sum.is_monotonic
    snap = recorded.snapshot()
    for spec in ALL:
        if _unknown(spec, snap):
            continue
        assert got[spec.otel_name] == pytest.approx(expected(spec, snap), rel=1e-15), spec.otel_name
    assert sum(got["moetrace.rank.routed_tokens"].values()) == snap.physical_count.sum() > 0


def test_lifecycle_spans(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rec = ExpertDistributionRecorder(rank_config(tmp_path, ep_size=1, ep_rank=0))
    otel.traced_start_record(rec, tracer_provider=provider)
    route_pass(rec, routers(), 8, torch.Generator().manual_seed(0))
    otel.traced_stop_record(rec, tracer_provider=provider)
    path = otel.traced_dump_record(rec, tmp_path / "t.h5", tracer_provider=provider)
    with pytest.raises(RecorderStateError):
        otel.traced_stop_record(rec, tracer_provider=provider)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["moetrace.start_record", "moetrace.stop_record", "moetrace.dump_record", "moetrace.stop_record"]
    start, stop, dump, failed = spans
    assert start.attributes["moetrace.recording"] is True and start.attributes["moetrace.mode"] == "stat"
    assert stop.attributes["moetrace.passes"] == 1 and stop.attributes["moetrace.tokens"] == 8
    assert dump.attributes["moetrace.dump.path"] == str(path) and path.exists()
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.events[0].name == "exception" and "not recording" in failed.events[0].attributes["exception.message"]
    assert all(s.instrumentation_scope.name == "moetrace" for s in spans)


def test_annotate_request_span_with_captured_routing(tmp_path):
    """Routed experts captured by the reference serving loop, summarised on the request's span."""
    loop, _ = serving_loop(tmp_path, capture=True)
    model_layers = loop.model.config.num_layers
    [result] = loop.run([Request("q", list(range(20)), max_new_tokens=6, return_routed_experts=True)])
    routed = result.routed_experts
    assert routed.shape == (25, model_layers, 2) and (routed[:, 0] == -1).all()  # layer 0 is dense

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("server").start_as_current_span("request q"):
        attrs = otel.annotate_routed_experts(routed)
    [span] = exporter.get_finished_spans()
    assert dict(span.attributes) == {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}
    distinct = [len(np.unique(routed[:, layer][routed[:, layer] >= 0])) for layer in range(model_layers)]
    assert attrs["moetrace.routed_experts.tokens"] == 25
    assert attrs["moetrace.routed_experts.layers"] == list(range(model_layers))
    assert attrs["moetrace.routed_experts.distinct_per_layer"] == distinct and distinct[0] == 0 and min(distinct[1:]) > 0
    assert attrs["moetrace.routed_experts.top_expert_per_layer"][0] == -1
    for layer in range(1, model_layers):
        ids, counts = np.unique(routed[:, layer], return_counts=True)
        assert counts[list(ids).index(attrs["moetrace.routed_experts.top_expert_per_layer"][layer])] == counts.max()
    assert attrs["moetrace.routed_experts.distinct_total"] == sum(distinct)
    with pytest.raises(ValueError, match="layer_ids has 2 entries"):
        otel.annotate_routed_experts(routed, layer_ids=[1, 2])
    with pytest.raises(ValueError, match=r"\[tokens, layers, top_k\]"):
        otel.annotate_routed_experts(routed[0])
