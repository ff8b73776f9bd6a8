"""The one type that declares an exported metric, and how each exporter builds it.

Every metric moetrace exports (the recorder's :mod:`~moetrace.exporters.catalog`,
request routing :mod:`~moetrace.exporters.replicas`, per-label attribution
:mod:`~moetrace.exporters.label_load`, the replay audit
:mod:`~moetrace.exporters.replay_audit`) is one :class:`MetricSpec`: its
Prometheus and OpenTelemetry names, kind, unit, label dimensions, help, the
snapshot value it reads and, for series that are off by default, the exporter
option that turns them on (``opt_in``). Each module turns its snapshot into
``(labels, value)`` samples; :func:`prom_family` and :func:`otel_instrument`
build the families and instruments from the spec alone, the same way for all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = ["KINDS", "METER_NAME", "MetricSpec", "SnapshotCollector", "enabled", "moetrace_meter", "observe_specs", "otel_instrument",
           "prom_families", "prom_family", "str_labels"]

#: ``samples(spec, snapshot)``: the ``(labels, value)`` of each series of ``spec`` in a module's snapshot.
Samples = Callable[["MetricSpec", Any], Iterable[tuple[dict[str, str], Any]]]

#: Kinds of metric: ``counter`` (monotonic within one recording), ``gauge``, ``histogram``
#: (Prometheus buckets; OpenTelemetry counters, its API has no asynchronous histogram)
#: and ``info`` (constant 1, the labels carry the description).
KINDS = ("counter", "gauge", "histogram", "info")

#: The OpenTelemetry meter (and tracer) every moetrace instrument (and span) lives on.
METER_NAME = "moetrace"


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One exported metric, for both exporters.

    Attributes:
        prom_name: Prometheus name as exposed (counters end in ``_total``, info in ``_info``).
        otel_name: OpenTelemetry instrument name (``moetrace.*``; a histogram's prefix).
        kind: one of :data:`KINDS`.
        unit: UCUM unit for OpenTelemetry (``{token}``, ``1``, ``s``, ``By``).
        dims: label names of the series (besides labels every sample of a module
            carries, such as the recorder's ``rank``); for the recorder's array
            values, the axes of the value array.
        help: one-line description.
        formula: how the value is defined, for the docs (empty: ``help`` says it).
        value: reads the value from the module's snapshot type.
        opt_in: ``""`` for a default metric, else the name of the exporter option
            that turns it on (e.g. ``per_expert``): series a fleet cannot afford by default.
    """

    prom_name: str
    otel_name: str
    kind: str
    unit: str
    dims: tuple[str, ...]
    help: str
    formula: str
    value: Callable[[Any], Any]
    opt_in: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.prom_name}: kind must be one of {KINDS}, got {self.kind!r}")


def enabled(specs: Iterable[MetricSpec], **options: bool) -> tuple[MetricSpec, ...]:
    """The specs an exporter emits: every default one, plus the opt-in ones whose option is true.

    Raises:
        ValueError: an option names no opt-in of ``specs`` (a typo would silently export nothing).
    """
    specs = tuple(specs)
    known = {spec.opt_in for spec in specs} - {""}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown metric option(s) {sorted(unknown)}; the opt-in options are {sorted(known)}")
    return tuple(spec for spec in specs if not spec.opt_in or options.get(spec.opt_in, False))


def prom_family(spec: MetricSpec, labels: Iterable[str]) -> Metric:
    """An empty Prometheus family of ``spec`` with label names ``labels`` (add samples with ``add_metric``)."""
    names = list(labels)
    if spec.kind == "counter":
        return CounterMetricFamily(spec.prom_name.removesuffix("_total"), spec.help, labels=names)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.prom_name, spec.help, labels=names)
    if spec.kind == "histogram":
        return HistogramMetricFamily(spec.prom_name, spec.help, labels=names)
    return InfoMetricFamily(spec.prom_name.removesuffix("_info"), spec.help, labels=names)


def prom_families(specs: Iterable[MetricSpec], snapshot: Any) -> Iterator[Metric]:
    """The Prometheus family of each spec, with the ``(labels, value)`` samples its ``value`` reads from ``snapshot``."""
    for spec in specs:
        family = prom_family(spec, spec.dims)
        for labels, value in spec.value(snapshot):
            family.add_metric(list(labels.values()), value)  # type: ignore[attr-defined]
        yield family


class SnapshotCollector(Collector):
    """Prometheus collector of ``specs``: one ``snapshot()`` per scrape, each spec's series from ``samples``."""

    def __init__(self, specs: Iterable[MetricSpec], samples: Samples, snapshot: Callable[[], Any]) -> None:
        self._specs, self._samples, self._snapshot = tuple(specs), samples, snapshot

    def describe(self) -> Iterator[Metric]:
        return self.families(None)

    def collect(self) -> Iterator[Metric]:
        return self.families(self._snapshot())

    def families(self, snap: Any) -> Iterator[Metric]:
        """The family of each spec, with its samples from ``snap`` (none when ``snap`` is ``None``: describe)."""
        for spec in self._specs:
            family = prom_family(spec, spec.dims)
            if snap is not None:
                for labels, value in self._samples(spec, snap):
                    family.add_metric(list(labels.values()), value)  # type: ignore[attr-defined]
            yield family


def moetrace_meter(meter_provider: Any | None = None) -> Any:
    """The ``moetrace`` meter of ``meter_provider`` (``None``: the global provider; none is ever installed here)."""
    from opentelemetry import metrics

    from moetrace._version import __version__

    provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    return provider.get_meter(METER_NAME, __version__)


def observe_specs(meter: Any, specs: Iterable[MetricSpec], samples: Samples, snapshot: Callable[[], Any],
                  closed: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """``{name: instrument}``: an observable OpenTelemetry instrument of each spec on ``meter`` whose callback
    reads one ``snapshot()`` and observes ``samples`` of it (nothing once ``closed()``)."""
    from opentelemetry.metrics import Observation

    def callback(spec: MetricSpec) -> Callable[..., list[Any]]:
        def observe(options: object) -> list[Any]:
            return [] if closed() else [Observation(value, labels) for labels, value in samples(spec, snapshot())]
        return observe

    return dict(otel_instrument(meter, spec, callback(spec)) for spec in specs)


def otel_instrument(meter: Any, spec: MetricSpec, callback: Callable[..., Iterable[Any]],
                    suffix: str = "", unit: str | None = None) -> tuple[str, Any]:
    """``(name, instrument)``: the observable instrument of ``spec`` on ``meter``.

    Counters (and the parts of a histogram, named ``otel_name + suffix``) are
    ``ObservableCounter``s; gauges and info are ``ObservableGauge``s.
    """
    name = spec.otel_name + suffix
    counter = spec.kind in ("counter", "histogram")
    create = meter.create_observable_counter if counter else meter.create_observable_gauge
    return name, create(name, callbacks=[callback], unit=unit if unit is not None else spec.unit, description=spec.help)


def str_labels(labels: Mapping[str, object]) -> list[str]:
    """Label values as Prometheus wants them (strings, in the mapping's order)."""
    return [str(v) for v in labels.values()]
