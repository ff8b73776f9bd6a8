"""Old home of :mod:`moetrace.http.guarded` (HTTP serving lives in ``moetrace.http``); the names stay importable from here."""

from .http.guarded import GuardedServerMixin, ServerLimits

__all__ = ["GuardedServerMixin", "ServerLimits"]
