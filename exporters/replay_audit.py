"""Prometheus metrics of a replay's audit (:mod:`moetrace.replay_audit`).

::

    from moetrace.exporters import replay_audit
    with mt.replay(model, routes) as handle:
        replay_audit.register(handle, registry)    # scraped: the audit so far

Families (``layer`` = the replayed MoE layer's name):

- ``moetrace_replay_requested_rows_total{layer}``: (token, layer) rows a replay asked for;
- ``moetrace_replay_matched_rows_total{layer}``: of those, rows whose experts actually used
  equal the requested set (read at the experts' input, not by the replay);
- ``moetrace_replay_match_ratio``: matched / requested over every layer (1 when nothing
  was requested);
- ``moetrace_replay_unreached_routers``: layers a replayed forward never reached (each such
  forward raised).

A scrape reads the audit's ``[L]`` device counters (a copy of ``2 x L`` integers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .spec import MetricSpec, prom_families, prom_family

__all__ = ["REPLAY_METRICS", "ReplayAuditCollector", "register"]


def _per_layer(values: Any) -> Any:
    return lambda report: [({"engine": report.engine, "layer": name}, float(v))
                           for name, v in zip(report.layers, values(report), strict=True)]


REPLAY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_replay_requested_rows_total", "moetrace.replay.requested_rows", "counter", "{row}", ("engine", "layer"),
               "(token, layer) rows a replay requested", "`requested`", _per_layer(lambda r: r.requested)),
    MetricSpec("moetrace_replay_matched_rows_total", "moetrace.replay.matched_rows", "counter", "{row}", ("engine", "layer"),
               "requested rows whose experts actually used equal the requested set", "`matched`",
               _per_layer(lambda r: r.matched)),
    MetricSpec("moetrace_replay_match_ratio", "moetrace.replay.match_ratio", "gauge", "1", ("engine",),
               "matched / requested (token, layer) rows over every replayed layer", "`share`",
               lambda r: [({"engine": r.engine}, r.share)]),
    MetricSpec("moetrace_replay_unreached_routers", "moetrace.replay.unreached_routers", "gauge", "{layer}", ("engine",),
               "replayed layers whose router a forward never reached", "`len(unreached)`",
               lambda r: [({"engine": r.engine}, float(len(r.unreached)))]),
)
"""The audit's metrics; ``value`` reads an audit report and returns its ``(labels, value)`` samples."""


class ReplayAuditCollector(Collector):
    """Yields the audit figures of ``source`` (a replay handle with ``audit_report()``, or a ``ReplayAudit``)."""

    def __init__(self, source: Any) -> None:
        self._report = source.audit_report if hasattr(source, "audit_report") else source.report

    def describe(self) -> Iterator[Metric]:
        yield from (prom_family(spec, spec.dims) for spec in REPLAY_METRICS)

    def collect(self) -> Iterator[Metric]:
        yield from prom_families(REPLAY_METRICS, self._report())


def register(source: Any, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Register a :class:`ReplayAuditCollector` for ``source`` on ``registry`` (a new private one when ``None``)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(ReplayAuditCollector(source))
    return registry
