"""Phase timing in Prometheus and OpenTelemetry: moetrace_phase_seconds {phase, rank}, step time, peak memory."""

from __future__ import annotations

import math
import time

import prometheus_client
import torch
from moetrace.exporters import otel
from moetrace.exporters.prometheus import register
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from moetrace import PHASES, ExpertDistributionRecorder, RecorderConfig
from moetrace.timing import EXPORT_EDGES


def _recorder(tmp_path, timing: bool = True, passes: int = 3) -> ExpertDistributionRecorder:
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=4, top_k=2, timing=timing, output_dir=tmp_path))
    rec.start_record()
    for _ in range(passes):
        with rec.with_forward_pass():
            for layer in range(2):
                with rec.with_current_layer(layer):
                    with rec.with_phase("route"):
                        rec.on_select_experts(torch.tensor([[0, 1], [2, 3]]))
                    with rec.with_phase("expert"):
                        time.sleep(0.003)
    return rec


def _families(rec) -> dict:
    text = prometheus_client.generate_latest(register(rec)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_phase_histogram_per_phase_and_rank(tmp_path):
    rec = _recorder(tmp_path)
    families = _families(rec)
    phase = families["moetrace_phase_seconds"]
    assert phase.type == "histogram"
    counts = {s.labels["phase"]: s.value for s in phase.samples if s.name.endswith("_count")}
    assert counts == {"route": 6.0, "dispatch": 0.0, "expert": 6.0, "combine": 0.0}  # 3 passes x 2 layers
    buckets = [s for s in phase.samples if s.name.endswith("_bucket") and s.labels["phase"] == "expert"]
    assert len(buckets) == len(EXPORT_EDGES) + 1 and all(s.labels["rank"] == "0" for s in buckets)
    values = [s.value for s in buckets]
    assert values == sorted(values) and values[-1] == 6.0
    below_1ms = next(s.value for s in buckets if s.labels["le"] == "0.001")
    assert below_1ms == 0.0  # every expert phase slept 3 ms
    step = families["moetrace_step_seconds"]
    assert next(s.value for s in step.samples if s.name.endswith("_count")) == 3.0
    assert next(s.value for s in step.samples if s.name.endswith("_sum")) >= 3 * 2 * 0.003
    peak = families["moetrace_peak_memory_bytes"].samples[0].value
    assert math.isnan(peak)  # CPU: no device memory figure


def test_no_timing_no_histogram_series(tmp_path):
    families = _families(_recorder(tmp_path, timing=False, passes=1))
    assert families["moetrace_phase_seconds"].samples == []
    assert families["moetrace_step_seconds"].samples == []


def test_otel_phase_time_and_count(tmp_path):
    rec = _recorder(tmp_path)
    reader = InMemoryMetricReader()
    otel.create_otel_instruments(MeterProvider(metric_readers=[reader]), rec)
    points = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    points[(metric.name, point.attributes.get("phase"))] = point.value
    assert points[("moetrace.phase.count", "expert")] == 6
    assert points[("moetrace.phase.time", "expert")] >= 6 * 0.003
    assert points[("moetrace.step.count", None)] == 3
    assert {p for (name, p) in points if name == "moetrace.phase.time"} == set(PHASES)
