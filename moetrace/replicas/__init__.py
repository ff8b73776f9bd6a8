"""Request→replica routing evidence: :class:`RoutingRecorder` and its trace group.

The router itself (:class:`~moetrace.replicas.router.ReplicaRouter`),
the trace replay (:mod:`moetrace.replicas.simulate`) and the analysis
(:mod:`moetrace.replicas.analysis`) are imported on use; ``import moetrace`` loads
none of this. Replicas that run reference engines behind the router are
:mod:`moetrace.drivers`.
"""

from .routing_recorder import (
    LATENCY_BUCKETS,
    POLICIES,
    REASONS,
    Candidate,
    RoutingRecorder,
    RoutingSnapshot,
    RoutingStateError,
)

__all__ = ["LATENCY_BUCKETS", "POLICIES", "REASONS", "Candidate", "RoutingRecorder", "RoutingSnapshot", "RoutingStateError"]
