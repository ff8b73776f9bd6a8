"""Prometheus exporter: a custom collector that reads ``recorder.snapshot()`` at scrape time.

Usage::

    from moetrace.exporters import prometheus
    server = prometheus.start_http_server(9400)          # private registry, global recorder
    ...
    server.close()

or add the collector to an application's own registry::

    prometheus.register(registry=my_registry)

A scrape takes one snapshot (a host copy the recorder made at the end of the
last pass; the device is never touched) and derives every metric from it, so
its cost depends on the layers (x EP ranks with ``per_ep_rank=True``, x experts
with ``per_expert=True``), never on the number of recorded passes. The metric set is
:data:`moetrace.exporters.catalog.METRICS`; every sample has a ``rank`` label
(this process's EP rank): run one exporter per rank, each on its own port.

With ``gpus_per_node=G`` the collector also emits :data:`NODE_PAIRS`: the token copies this rank
routed to each node's experts, all layers summed (``N`` series per process, ``N²`` over the fleet),
computed at scrape time from the snapshot's per-slot counts and the contiguous placement (rank ``r``
holds slots ``[r·P/R, (r+1)·P/R)``; ranks ``[n·G, (n+1)·G)`` form node ``n``); the recorder's hook
does nothing more. The shipped rules turn them into the fleet's inter-node share.

:func:`start_http_server` serves ``prometheus_client``'s own WSGI application
(content negotiation, OpenMetrics, gzip) on a
:class:`moetrace.http.GuardedServerMixin` server instead of
``prometheus_client``'s thread-per-connection one, so the endpoint has the
control endpoint's limits (read timeout, open connections, worker threads,
head size, request and CPU budgets; :class:`~moetrace.http.ServerLimits`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import numpy as np
import prometheus_client
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from moetrace.dispatch import node_copies
from moetrace.http import GuardedServerMixin, ServerHandle, ServerLimits
from moetrace.process_recorder import Recorder, get_recorder
from moetrace.recorder import RecorderStateError
from moetrace.snapshot import RecorderSnapshot

from .catalog import HISTOGRAMS, INFO, histogram_samples, info_labels, samples, selected
from .spec import MetricSpec, prom_family, str_labels

__all__ = ["NODE_PAIRS", "MetricsServer", "MoetraceCollector", "node_pair_samples", "register", "start_http_server"]

log = logging.getLogger("moetrace.exporters.prometheus")

NODE_PAIRS = MetricSpec(
    "moetrace_node_pair_token_copies_total", "moetrace.node_pair.token_copies", "counter", "{token}",
    ("source_node", "destination_node", "link"),
    "Token copies this rank routed (source_node: its node) to the experts on destination_node, all layers; link is "
    "intra_node or inter_node (only with gpus_per_node: N series per process, N squared over the fleet).",
    "Σ_l counted(rank_load)[l, r] over the ranks r of destination_node; node n holds ranks [n·G, (n+1)·G)",
    lambda s: s.counted(s.rank_load), opt_in="gpus_per_node",
)
"""The node-pair counters (Prometheus only, with ``gpus_per_node``); ``moetrace:inter_node_share`` reads them."""


def node_pair_samples(snap: RecorderSnapshot, gpus_per_node: int) -> Iterator[tuple[dict[str, int | str], int]]:
    """``(labels, copies)`` of :data:`NODE_PAIRS` for one snapshot: one sample per destination node.

    Raises:
        ValueError: ``gpus_per_node`` does not divide the snapshot's EP size.
    """
    per_node = node_copies(np.asarray(NODE_PAIRS.value(snap)).sum(axis=0), gpus_per_node)  # [N]
    source = snap.rank // gpus_per_node
    for node, copies in enumerate(per_node.tolist()):
        yield {"rank": snap.rank, "source_node": source, "destination_node": node,
               "link": "intra_node" if node == source else "inter_node"}, int(copies)


def _histogram(spec: MetricSpec, snap: RecorderSnapshot | None) -> Metric:
    """A histogram family; buckets at ``moetrace.timing.EXPORT_EDGES`` (values counted below each bound)."""
    from moetrace.timing import EXPORT_EDGES

    family = prom_family(spec, ["rank", *spec.dims])
    assert isinstance(family, HistogramMetricFamily)
    if snap is not None:
        for labels, cumulative, count, total in histogram_samples(spec, snap):
            buckets = [(f"{edge:.6g}", int(c)) for edge, c in zip(EXPORT_EDGES, cumulative, strict=True)]
            family.add_metric(str_labels(labels), [*buckets, ("+Inf", count)], total)
    return family


class MoetraceCollector(Collector):
    """Yields moetrace's metrics from one snapshot per scrape.

    Args:
        recorder: the recorder to read; ``None`` looks up
            :func:`moetrace.get_recorder` at every scrape (so a recorder
            configured later is picked up). An unconfigured (no-op) recorder
            yields no metrics.
        per_expert: also emit ``moetrace_expert_routed_tokens_total``
            (layers x experts series; off by default for cardinality).
        per_ep_rank: also emit the ``[layer, ep_rank]`` matrices
            (:data:`~moetrace.exporters.catalog.PER_EP_RANK`: 3 x layers x EP
            ranks series; off by default, the fleet rules need only the per-layer series).
        gpus_per_node: also emit :data:`NODE_PAIRS` for nodes of this many EP ranks (``None``: not).
    """

    def __init__(self, recorder: Recorder | None = None, per_expert: bool = False, per_ep_rank: bool = False,
                 gpus_per_node: int | None = None) -> None:
        if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1):
            raise ValueError(f"gpus_per_node must be a positive integer (the EP ranks of one node) or None, got {gpus_per_node!r}")
        self._recorder = recorder
        self._specs = selected(per_expert=per_expert, per_ep_rank=per_ep_rank)
        self._gpus_per_node = gpus_per_node

    def _snapshot(self) -> RecorderSnapshot | None:
        recorder = self._recorder if self._recorder is not None else get_recorder()
        try:
            return recorder.snapshot()
        except RecorderStateError:  # no recorder configured yet
            return None

    def describe(self) -> Iterator[Metric]:
        """The metric families (without samples), so registries can check for name clashes."""
        yield from (prom_family(spec, ["rank", *spec.dims]) for spec in self._specs)
        yield from (_histogram(spec, None) for spec in HISTOGRAMS)
        yield prom_family(INFO, ["rank", *INFO.dims])
        if self._gpus_per_node is not None:
            yield prom_family(NODE_PAIRS, ["rank", *NODE_PAIRS.dims])

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        for spec in self._specs:
            family = prom_family(spec, ["rank", *spec.dims])
            for labels, value in samples(spec, snap):
                family.add_metric(str_labels(labels), value)
            yield family
        for hist in HISTOGRAMS:
            yield _histogram(hist, snap)
        info = prom_family(INFO, [])
        info.add_metric([], info_labels(snap))  # type: ignore[attr-defined]
        yield info
        if self._gpus_per_node is not None:
            yield self._node_pairs(snap, self._gpus_per_node)

    @staticmethod
    def _node_pairs(snap: RecorderSnapshot, gpus_per_node: int) -> Metric:
        """:data:`NODE_PAIRS` of ``snap``; no samples (and one warning) when the nodes do not divide its EP ranks."""
        family = prom_family(NODE_PAIRS, ["rank", *NODE_PAIRS.dims])
        try:
            for labels, value in node_pair_samples(snap, gpus_per_node):
                family.add_metric(str_labels(labels), value)
        except ValueError as exc:
            log.warning("moetrace_node_pair_token_copies_total left out: %s", exc)
        return family


def register(recorder: Recorder | None = None, registry: CollectorRegistry | None = None,
             per_expert: bool = False, per_ep_rank: bool = False, gpus_per_node: int | None = None) -> CollectorRegistry:
    """Register a :class:`MoetraceCollector` on ``registry`` (a new private one when ``None``) and return it."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    registry.register(MoetraceCollector(recorder, per_expert=per_expert, per_ep_rank=per_ep_rank, gpus_per_node=gpus_per_node))
    return registry


class _Handler(WSGIRequestHandler):
    """``wsgiref``'s handler, logging requests at debug level instead of to stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(GuardedServerMixin, WSGIServer):
    """``wsgiref``'s server behind the guarded event loop."""


@dataclasses.dataclass
class MetricsServer(ServerHandle):
    """A running ``/metrics`` HTTP server; :meth:`close` stops it and frees the port."""

    server: WSGIServer
    thread: threading.Thread
    registry: CollectorRegistry
    host: str

    @property
    def url(self) -> str:
        return f"{self.origin}/metrics"


def start_http_server(port: int, addr: str = "127.0.0.1", recorder: Recorder | None = None,
                      registry: CollectorRegistry | None = None, per_expert: bool = False,
                      limits: ServerLimits | None = None, per_ep_rank: bool = False, gpus_per_node: int | None = None) -> MetricsServer:
    """Serve moetrace's metrics over HTTP in a daemon thread.

    Args:
        port: TCP port; ``0`` picks a free one (read it from ``.port``).
        addr: bind address; loopback by default. Bind ``0.0.0.0`` only on a
            trusted network: the exposition is unauthenticated.
        recorder: as for :class:`MoetraceCollector`.
        registry: serve this registry after adding the collector to it; a
            private one when ``None``.
        per_expert: also emit per-expert series.
        per_ep_rank: also emit the ``[layer, ep_rank]`` matrices.
        gpus_per_node: also emit the node-pair counters (:data:`NODE_PAIRS`).
        limits: connection limits (read timeout, open connections, worker
            threads, head size, request and CPU budgets); ``None``:
            :class:`ServerLimits` defaults.

    Returns:
        a :class:`MetricsServer` with ``.port``, ``.url`` and ``.close()``.
    """
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    collector = MoetraceCollector(recorder, per_expert=per_expert, per_ep_rank=per_ep_rank, gpus_per_node=gpus_per_node)
    registry.register(collector)
    try:
        server = _Server((addr, port), _Handler, limits)
    except OSError as exc:
        registry.unregister(collector)
        raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror}; pick another port or 0 for a free one") from exc
    server.set_app(prometheus_client.make_wsgi_app(registry))
    return MetricsServer(server, ServerHandle.serve(server, "moetrace-metrics"), registry, addr)
