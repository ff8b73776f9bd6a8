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

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["ReplayAuditCollector", "register"]


class ReplayAuditCollector(Collector):
    """Yields the audit figures of ``source`` (a replay handle with ``audit_report()``, or a ``ReplayAudit``)."""

    def __init__(self, source: Any) -> None:
        self._report = source.audit_report if hasattr(source, "audit_report") else source.report

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(self) -> tuple[CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily("moetrace_replay_requested_rows", "(token, layer) rows a replay requested", labels=["engine", "layer"]),
            CounterMetricFamily("moetrace_replay_matched_rows", "requested rows whose experts actually used equal the requested set", labels=["engine", "layer"]),
            GaugeMetricFamily("moetrace_replay_match_ratio", "matched / requested (token, layer) rows over every replayed layer", labels=["engine"]),
            GaugeMetricFamily("moetrace_replay_unreached_routers", "replayed layers whose router a forward never reached", labels=["engine"]),
        )

    def collect(self) -> Iterator[Metric]:
        report = self._report()
        requested, matched, ratio, unreached = self._families()
        for name, r, m in zip(report.layers, report.requested, report.matched, strict=True):
            requested.add_metric([report.engine, name], float(r))
            matched.add_metric([report.engine, name], float(m))
        ratio.add_metric([report.engine], report.share)
        unreached.add_metric([report.engine], float(len(report.unreached)))
        yield from (requested, matched, ratio, unreached)


def register(source: Any, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Register a :class:`ReplayAuditCollector` for ``source`` on ``registry`` (a new private one when ``None``)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(ReplayAuditCollector(source))
    return registry
