"""Per-label attribution metrics for Prometheus and OpenTelemetry, read from ``LabelLoad.snapshot()``.

Usage::

    from moetrace.labels import LabelLoad
    from moetrace.exporters import labels
    load = LabelLoad(num_layers=L, num_experts=E, key="tenant")
    registry = labels.register(load, top=10)           # Prometheus, a private registry by default
    handle = labels.instrument(load, top=10)           # OpenTelemetry observable gauges

Cardinality is bounded: the ``top`` labels by tokens, plus ``other`` for the
rest (and :class:`~moetrace.labels.LabelLoad` tracks at most ``max_tracked``
values exactly). Every series carries ``label_key`` (the label name) and
``label`` (its value). Values come from the snapshot; nothing is computed here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from moetrace.labels import LabelLoad, LabelLoadSnapshot

from .spec import MetricSpec, otel_instrument, prom_family

__all__ = ["LABEL_METRICS", "LabelCollector", "instrument", "register"]

_DIMS = ("label_key", "label")

LABEL_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_label_requests_total", "moetrace.label.requests", "counter", "{request}", _DIMS,
               "Finished requests counted under the label", "`requests`", lambda s: s.requests),
    MetricSpec("moetrace_label_tokens_total", "moetrace.label.tokens", "counter", "{token}", _DIMS,
               "Routed tokens of the label's finished requests", "`tokens`", lambda s: s.tokens),
    MetricSpec("moetrace_label_hot_expert_excess_share", "moetrace.label.hot_expert_excess_share", "gauge", "1", _DIMS,
               "Share of the hot experts' excess load (copies above an even share) that the label produced",
               "`hot_excess_share`", lambda s: s.hot_excess_share),
    MetricSpec("moetrace_label_expert_profile_divergence", "moetrace.label.expert_profile_divergence", "gauge", "1", _DIMS,
               "Mean over layers of the JS divergence between the label's expert profile and the rest's",
               "`divergence`", lambda s: s.divergence),
)


def _samples(spec: MetricSpec, snap: LabelLoadSnapshot) -> Iterator[tuple[dict[str, str], float]]:
    values = spec.value(snap)
    for name, value in zip(snap.labels, values, strict=True):
        yield {"label_key": snap.key, "label": name}, float(value)


class LabelCollector(Collector):
    """Prometheus collector: one ``load.snapshot(top)`` per scrape."""

    def __init__(self, load: LabelLoad, top: int = 10) -> None:
        if top < 1:
            raise ValueError(f"top must be positive, got {top}")
        self._load, self._top = load, top

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._load.snapshot(self._top))

    def _families(self, snap: LabelLoadSnapshot | None) -> Iterator[Metric]:
        for spec in LABEL_METRICS:
            family = prom_family(spec, spec.dims)
            if snap is not None:
                for labels, value in _samples(spec, snap):
                    family.add_metric(list(labels.values()), value)
            yield family


def register(load: LabelLoad, registry: CollectorRegistry | None = None, top: int = 10) -> CollectorRegistry:
    """Register a :class:`LabelCollector` on ``registry`` (a new private one when ``None``)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(LabelCollector(load, top))
    return registry


def instrument(load: LabelLoad, top: int = 10, meter_provider: object | None = None) -> dict[str, object]:
    """Observable OpenTelemetry instruments on the ``moetrace`` meter (API only; no global provider is set)."""
    from opentelemetry import metrics
    from opentelemetry.metrics import CallbackOptions, Observation

    from moetrace._version import __version__

    provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    meter = provider.get_meter("moetrace", __version__)  # type: ignore[attr-defined]
    out: dict[str, object] = {}
    for spec in LABEL_METRICS:
        def callback(options: CallbackOptions, spec: MetricSpec = spec) -> list[Observation]:
            return [Observation(v, labels) for labels, v in _samples(spec, load.snapshot(top))]
        _, out[spec.otel_name] = otel_instrument(meter, spec, callback)
    return out
