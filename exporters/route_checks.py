"""Prometheus metrics of the row checks a capturer runs on the routes it hands out (:mod:`moetrace.route_checks`).

::

    from moetrace.exporters import route_checks
    route_checks.register(capturer, registry)     # scraped: the counts so far

Families (``check`` is one of :data:`moetrace.route_checks.ROW_CHECKS`: five values, bounded):

- ``moetrace_routes_checked_requests_total``: requests whose routes were handed out and checked;
- ``moetrace_routes_checked_rows_total``: their (position, layer) rows;
- ``moetrace_routes_failed_requests_total``: requests with at least one failing row;
- ``moetrace_routes_failed_rows_total{check}``: rows failing each check (alert on any increase).

A scrape copies a handful of host integers (``RowCheckCounts.snapshot()``); nothing touches the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from moetrace.route_checks import ROW_CHECKS

from .spec import MetricSpec, prom_families, prom_family

__all__ = ["ROUTE_CHECK_METRICS", "RouteChecksCollector", "register"]

ROUTE_CHECK_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_routes_checked_requests_total", "moetrace.routes.checked_requests", "counter", "{request}", (),
               "requests whose routed experts were handed out and checked", "`requests`", lambda s: [({}, float(s["requests"]))]),
    MetricSpec("moetrace_routes_checked_rows_total", "moetrace.routes.checked_rows", "counter", "{row}", (),
               "(position, layer) rows of routed experts handed out and checked", "`rows`", lambda s: [({}, float(s["rows"]))]),
    MetricSpec("moetrace_routes_failed_requests_total", "moetrace.routes.failed_requests", "counter", "{request}", (),
               "requests handed out with at least one row failing a check", "`requests_failed`",
               lambda s: [({}, float(s["requests_failed"]))]),
    MetricSpec("moetrace_routes_failed_rows_total", "moetrace.routes.failed_rows", "counter", "{row}", ("check",),
               "rows handed out that fail each row check (zero_row, missing_layer, partial_row, out_of_range, duplicate)",
               "`failed[check]`", lambda s: [({"check": check}, float(s["failed"][check])) for check in ROW_CHECKS]),
)
"""The row-check metrics; ``value`` reads a ``RowCheckCounts.snapshot()``."""


class RouteChecksCollector(Collector):
    """Yields the row-check counts of ``source`` (a capturer with ``row_checks``, or a ``RowCheckCounts``)."""

    def __init__(self, source: Any) -> None:
        self._counts = getattr(source, "row_checks", source)

    def describe(self) -> Iterator[Metric]:
        yield from (prom_family(spec, spec.dims) for spec in ROUTE_CHECK_METRICS)

    def collect(self) -> Iterator[Metric]:
        yield from prom_families(ROUTE_CHECK_METRICS, self._counts.snapshot())


def register(source: Any, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Register a :class:`RouteChecksCollector` for ``source`` on ``registry`` (a new private one when ``None``)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(RouteChecksCollector(source))
    return registry
