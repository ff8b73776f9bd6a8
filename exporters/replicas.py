"""Request→replica metrics for Prometheus and OpenTelemetry, read from ``ReplicaRecorder.snapshot()``.

Usage::

    from moetrace.exporters import replicas
    registry = replicas.register(recorder)                                 # Prometheus: a collector on a (private) registry
    handle = replicas.create_otel_instruments(recorder, meter_provider=p)  # OpenTelemetry: observable instruments

Same conventions as :mod:`moetrace.exporters.catalog`: one
:class:`~moetrace.exporters.spec.MetricSpec` per metric names it for both exporters (Prometheus:
``moetrace_`` prefix, base units, ``_total`` on counters; OpenTelemetry:
``moetrace.*``, UCUM units); values come from the snapshot, never computed
here. Labels are bounded: ``replica`` (< the recorder's ``num_replicas``),
``policy`` (:data:`~moetrace.replicas.POLICIES`, 8) and ``reason``
(:data:`~moetrace.replicas.REASONS`, 12); decision series appear only for the
(replica, policy, reason) combinations that occurred. Wait and TTFT are
Prometheus histograms with the recorder's fixed buckets
(:data:`~moetrace.replicas.LATENCY_BUCKETS`); OpenTelemetry has no observable
histogram, so they go out as ``*.bucket`` counters (attribute ``le``), plus
``*.sum`` and ``*.count``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from moetrace.lazy import renamed_attributes
from moetrace.replicas import LATENCY_BUCKETS, POLICIES, REASONS, ReplicaRecorder, ReplicaSnapshot

from .spec import (
    MetricSpec,
    SnapshotCollector,
    moetrace_meter,
    observe_specs,
    otel_instrument,
    prom_family,
)

__all__ = ["REPLICA_HISTOGRAMS", "REPLICA_METRICS", "ReplicaCollector", "ReplicaInstruments", "create_otel_instruments", "register",
           "replica_samples"]


REPLICA_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_replica_decisions_total", "moetrace.replica.decisions", "counter", "{decision}", ("replica", "policy", "reason"),
                      "The router's decisions by chosen replica, policy and the rule that decided.", "", lambda s: s.decisions),
    MetricSpec("moetrace_replica_hit_tokens_total", "moetrace.replica.hit_tokens", "counter", "{token}", ("replica",),
                      "Prompt tokens the replica served from its prefix cache (as it counted them).", "", lambda s: s.hit_tokens),
    MetricSpec("moetrace_replica_miss_tokens_total", "moetrace.replica.miss_tokens", "counter", "{token}", ("replica",),
                      "Prompt tokens the replica had to prefill.", "", lambda s: s.miss_tokens),
    MetricSpec("moetrace_replica_regret_tokens_total", "moetrace.replica.regret_tokens", "counter", "{token}", ("replica",),
                      "Prefix overlap lost by not choosing the best-overlap replica (best candidate's match - chosen's).", "", lambda s: s.regret_tokens),
    MetricSpec("moetrace_replica_queue_length", "moetrace.replica.queue_length", "gauge", "{request}", ("replica",),
                      "Requests routed to the replica that have not started.", "", lambda s: s.queue_length),
    MetricSpec("moetrace_replica_running_requests", "moetrace.replica.running_requests", "gauge", "{request}", ("replica",),
                      "Requests the replica started and has not finished.", "", lambda s: s.running),
    MetricSpec("moetrace_replica_migrations_total", "moetrace.replica.migrations", "counter", "{session}", (),
                      "Sessions moved from one replica to another.", "", lambda s: s.migrations),
    MetricSpec("moetrace_replica_finished_requests_total", "moetrace.replica.finished_requests", "counter", "{request}", (),
                      "Requests finished since start_record.", "", lambda s: s.finished),
)
"""Counters and gauges."""

REPLICA_HISTOGRAMS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_replica_queue_wait_seconds", "moetrace.replica.queue_wait", "histogram", "s", ("replica",),
                      "Arrival at the router to prefill start, per replica.", "", lambda s: (s.wait_buckets, s.wait_sum)),
    MetricSpec("moetrace_replica_ttft_seconds", "moetrace.replica.ttft", "histogram", "s", ("replica",),
                      "Arrival at the router to first token, per replica.", "", lambda s: (s.ttft_buckets, s.ttft_sum)),
)
"""Wait and TTFT histograms (buckets: LATENCY_BUCKETS)."""

_NAMES = {"policy": POLICIES, "reason": REASONS}


def replica_samples(spec: MetricSpec, snap: ReplicaSnapshot) -> Iterator[tuple[dict[str, str], int | float]]:
    """``(labels, value)`` of each series of a counter/gauge ``spec``; decision series only where non-zero."""
    value = spec.value(snap)
    if not spec.dims:
        yield {}, value  # type: ignore[misc]
        return
    array = np.asarray(value)
    for index in zip(*np.nonzero(array), strict=True) if len(spec.dims) > 1 else np.ndindex(*array.shape):
        labels = {dim: (_NAMES[dim][i] if dim in _NAMES else str(i)) for dim, i in zip(spec.dims, index, strict=True)}
        item = array[index]
        yield labels, int(item) if array.dtype.kind in "iub" else float(item)


def _histogram(spec: MetricSpec, snap: ReplicaSnapshot) -> Iterator[tuple[str, list[tuple[str, float]], float]]:
    buckets, sums = spec.value(snap)  # type: ignore[misc]
    for r in range(snap.num_replicas):
        cumulative = np.cumsum(buckets[r])
        pairs = [(repr(b), float(c)) for b, c in zip(LATENCY_BUCKETS, cumulative[:-1], strict=True)] + [("+Inf", float(cumulative[-1]))]
        yield str(r), pairs, float(sums[r])


class ReplicaCollector(SnapshotCollector):
    """Prometheus collector: one ``recorder.snapshot()`` per scrape."""

    def __init__(self, recorder: ReplicaRecorder) -> None:
        super().__init__(REPLICA_METRICS, replica_samples, recorder.snapshot)

    def families(self, snap: ReplicaSnapshot | None) -> Iterator[Metric]:
        """The counters' and gauges' families, then the wait and TTFT histograms."""
        yield from super().families(snap)
        for spec in REPLICA_HISTOGRAMS:
            hist = prom_family(spec, spec.dims)
            assert isinstance(hist, HistogramMetricFamily)
            if snap is not None:
                for replica, pairs, total in _histogram(spec, snap):
                    hist.add_metric([replica], pairs, total)
            yield hist


def register(recorder: ReplicaRecorder, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Register a :class:`ReplicaCollector` for ``recorder`` on ``registry`` (a new private one when ``None``)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(ReplicaCollector(recorder))
    return registry


@dataclasses.dataclass
class ReplicaInstruments:
    """Handle of the OpenTelemetry instruments; ``close()`` stops reporting."""

    instruments: dict[str, object]
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def create_otel_instruments(recorder: ReplicaRecorder, meter_provider: object | None = None) -> ReplicaInstruments:
    """Observable OpenTelemetry instruments on the ``moetrace`` meter for ``recorder`` (API only; no global provider is set)."""
    from opentelemetry.metrics import CallbackOptions, Observation

    meter = moetrace_meter(meter_provider)
    handle = ReplicaInstruments({})
    handle.instruments.update(observe_specs(meter, REPLICA_METRICS, replica_samples, recorder.snapshot, closed=lambda: handle.closed))

    def observe(produce: Callable[[ReplicaSnapshot], Iterable[Observation]]) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return [] if handle.closed else list(produce(recorder.snapshot()))
        return callback

    for spec in REPLICA_HISTOGRAMS:
        def parts(snap: ReplicaSnapshot, spec: MetricSpec = spec) -> Iterator[tuple[str, Observation]]:
            for replica, pairs, total in _histogram(spec, snap):
                for le, count in pairs:
                    yield "bucket", Observation(count, {"replica": replica, "le": le})
                yield "sum", Observation(total, {"replica": replica})
                yield "count", Observation(pairs[-1][1], {"replica": replica})
        for part, unit in (("bucket", "{request}"), ("sum", "s"), ("count", "{request}")):
            cb = observe(lambda snap, part=part, parts=parts: (o for p, o in parts(snap) if p == part))
            name, instrument = otel_instrument(meter, spec, cb, suffix=f".{part}", unit=unit)
            handle.instruments[name] = instrument
    return handle


__getattr__ = renamed_attributes(__name__, {
    "instrument": "create_otel_instruments", "routing_samples": "replica_samples", "ROUTING_METRICS": "REPLICA_METRICS",
    "ROUTING_HISTOGRAMS": "REPLICA_HISTOGRAMS", "RoutingCollector": "ReplicaCollector", "RoutingInstruments": "ReplicaInstruments",
}, globals().__getitem__)
