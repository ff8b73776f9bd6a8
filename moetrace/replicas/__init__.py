"""Request→replica evidence: :class:`ReplicaRecorder` and its trace group (a replica trace's ``/requests``).

``RoutingRecorder``, ``RoutingSnapshot`` and ``RoutingStateError`` are renamed ``ReplicaRecorder``,
``ReplicaSnapshot`` and ``ReplicaStateError`` ("routing" is token → expert routing); the old names answer,
with a ``DeprecationWarning``, for one release.

The router itself (:class:`~moetrace.replicas.router.ReplicaRouter`),
the trace replay (:mod:`moetrace.replicas.simulate`) and the analysis
(:mod:`moetrace.replicas.analysis`) are imported on use; ``import moetrace`` loads
none of this. Replicas that run reference engines behind the router are
:mod:`moetrace.drivers`.
"""

from ..lazy import renamed_attributes
from .replica_recorder import (
    LATENCY_BUCKETS,
    POLICIES,
    REASONS,
    Candidate,
    ReplicaRecorder,
    ReplicaSnapshot,
    ReplicaStateError,
)

__all__ = ["LATENCY_BUCKETS", "POLICIES", "REASONS", "Candidate", "ReplicaRecorder", "ReplicaSnapshot", "ReplicaStateError"]

__getattr__ = renamed_attributes(__name__, {"RoutingRecorder": "ReplicaRecorder", "RoutingSnapshot": "ReplicaSnapshot",
                                            "RoutingStateError": "ReplicaStateError"}, globals().__getitem__)
