"""Per-label attribution metrics for Prometheus and OpenTelemetry, read from ``LabelLoad.snapshot()``.

Usage::

    from moetrace.label_load import LabelLoad
    from moetrace.exporters import label_load
    load = LabelLoad(num_layers=L, num_experts=E, key="tenant")
    registry = labels.register(load, top=10)           # Prometheus, a private registry by default
    handle = labels.create_otel_instruments(load, top=10)  # OpenTelemetry observable instruments

Cardinality is bounded: the ``top`` labels by tokens, plus ``other`` for the
rest (and :class:`~moetrace.label_load.LabelLoad` tracks at most ``max_tracked``
values exactly). Every series carries ``label_key`` (the label name) and
``label`` (its value). Values come from the snapshot; nothing is computed here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.registry import CollectorRegistry

from moetrace.label_load import LabelLoad, LabelLoadSnapshot
from moetrace.lazy import renamed_attributes

from .spec import MetricSpec, SnapshotCollector, moetrace_meter, observe_specs

__all__ = ["LABEL_METRICS", "LabelCollector", "create_otel_instruments", "register"]

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


class LabelCollector(SnapshotCollector):
    """Prometheus collector: one ``load.snapshot(top)`` per scrape."""

    def __init__(self, load: LabelLoad, top: int = 10) -> None:
        if top < 1:
            raise ValueError(f"top must be positive, got {top}")
        super().__init__(LABEL_METRICS, _samples, lambda: load.snapshot(top))


def register(load: LabelLoad, registry: CollectorRegistry | None = None, top: int = 10) -> CollectorRegistry:
    """Register a :class:`LabelCollector` on ``registry`` (a new private one when ``None``)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(LabelCollector(load, top))
    return registry


def create_otel_instruments(load: LabelLoad, top: int = 10, meter_provider: object | None = None) -> dict[str, object]:
    """Observable OpenTelemetry instruments on the ``moetrace`` meter, one ``load.snapshot(top)`` per callback
    (API only; no global provider is set). Returns ``{instrument name: instrument}``."""
    return observe_specs(moetrace_meter(meter_provider), LABEL_METRICS, _samples, lambda: load.snapshot(top))


__getattr__ = renamed_attributes(__name__, {"instrument": "create_otel_instruments"}, globals().__getitem__)
