"""Old home of :mod:`moetrace.replicas.router` (request→replica routing lives in ``moetrace.replicas``); the names stay importable from here."""

from ..replicas.router import (
    POLICY_NAMES,
    CostModel,
    Decision,
    ReplicaRouter,
    ReplicaView,
    RouterConfig,
    RouteRequest,
)

__all__ = ["POLICY_NAMES", "CostModel", "Decision", "ReplicaRouter", "ReplicaView", "RouteRequest", "RouterConfig"]
