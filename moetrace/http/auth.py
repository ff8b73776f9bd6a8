"""The bearer token of moetrace's control endpoint: the environment variable both ends read.

The endpoint (:func:`moetrace.control.serve_control`) takes its token from :data:`TOKEN_ENV`
when none is passed, and its client (``moetrace start|stop|dump|status``) sends the same
variable's value. The client loads this module, not the endpoint's, so asking a running process
for its status loads neither torch nor the exporters.
"""

from __future__ import annotations

__all__ = ["TOKEN_ENV"]

#: Environment variable holding the control endpoint's bearer token (unset or empty: no token).
TOKEN_ENV = "MOETRACE_CONTROL_TOKEN"
