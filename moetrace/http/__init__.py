"""HTTP serving infrastructure: the guarded server (:mod:`.guarded`), the handle of a running one (:mod:`.handle`)
and the control endpoint's bearer-token variable (:mod:`.auth`).

The control endpoint (:mod:`moetrace.control`) and the Prometheus ``/metrics``
server (:mod:`moetrace.exporters.prometheus`) both run on it; it knows nothing
of recorders. ``import moetrace`` does not load it.
"""

from .guarded import GuardedServerMixin, ServerLimits
from .handle import ServerHandle

__all__ = ["GuardedServerMixin", "ServerHandle", "ServerLimits"]
