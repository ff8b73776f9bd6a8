"""HTTP control endpoint: start, stop and dump recording in a running process.

One line for engine integrators::

    server = moetrace.serve_control(port=9401)      # global recorder, 127.0.0.1
    ...
    server.close()

Routes (JSON in, JSON out, except ``/metrics``):

=========  ==========  =============================================================
method     path        response
=========  ==========  =============================================================
POST       /start      200 ``{"ok": true, "status": {...}}``
POST       /stop       200 ``{"ok": true, "status": {...}}``
POST       /dump       200 ``{"ok": true, "path": "..."}``; optional body ``{"name": "f.h5"}``
GET        /status     200 ``recorder.status()``
GET        /metrics    200 Prometheus text exposition (:mod:`moetrace.exporters.prometheus`)
=========  ==========  =============================================================

Errors are ``{"error": "..."}`` with 400 (malformed JSON, unknown field, bad
file name), 401 (missing or wrong bearer token), 404 (unknown path), 405
(method not allowed on the path), 409 (lifecycle conflict: start twice, stop
while stopped, dump before start, no recorder configured, dump name already
taken), 413 (body larger than ``max_body_bytes``), 500 (the dump could not be
written, or any other failure, with its message).

Hostile or broken clients cannot exhaust the process: the server runs on
:mod:`moetrace.http` (one event-loop thread reads requests, at most
``max_workers`` threads serve them; a request must arrive complete within
``read_timeout`` seconds, its head within ``max_header_bytes``; beyond
``max_connections`` a new connection gets 503 at once; 408 / 431 / 503
replies are JSON too; beyond ``max_requests_per_second`` or ``max_cpu_share``
the server stops accepting for a while, so a flood of valid requests cannot
take the forward's CPU and GIL). A client that goes away costs one debug log line.

Dump names are plain file names: the file is always written directly inside
the recorder's ``output_dir``. Absolute paths, separators, ``..``, hidden
names, and names whose target is a symlink or an existing file are refused.
Lifecycle calls go through :mod:`moetrace.exporters.otel`, so they appear as
spans when the application has configured an OpenTelemetry tracer provider.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from moetrace.exporters import otel, prometheus

from .http import GuardedServerMixin, ServerHandle, ServerLimits
from .http.auth import TOKEN_ENV
from .process_recorder import NoOpRecorder, Recorder, get_recorder
from .recorder import RecorderStateError
from .trace.schema import TraceWriteError

__all__ = ["ControlServer", "serve_control"]

log = logging.getLogger("moetrace.control")

_ROUTES: dict[str, str] = {"/start": "POST", "/stop": "POST", "/dump": "POST", "/status": "GET", "/metrics": "GET"}
_MAX_NAME = 255
_DRAIN_BYTES = 16 << 20  # unread request bodies up to this size are discarded before an error reply
_DRAIN_SECONDS = 2.0


class _HTTPError(Exception):
    """An error reply: status code, message for the JSON body, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _dump_target(output_dir: Path, name: object) -> Path:
    """The file ``name`` inside ``output_dir``, or a 400/409 explaining why not."""
    if not isinstance(name, str) or not name:
        raise _HTTPError(400, f"'name' must be a non-empty string, got {json.dumps(name)}")
    if len(name) > _MAX_NAME or "\x00" in name:
        raise _HTTPError(400, f"'name' must be at most {_MAX_NAME} characters without NUL bytes")
    if "/" in name or "\\" in name or name in (".", "..") or os.path.isabs(name):
        raise _HTTPError(400, f"'name' must be a plain file name, without directories or '..' (got {name!r}); the file is written inside the output directory")
    if name.startswith("."):
        raise _HTTPError(400, f"'name' must not start with '.' (got {name!r}); hidden names are reserved for temporary files")
    if not name.endswith(".h5"):
        name += ".h5"
    base = output_dir.resolve()
    target = base / name
    if target.is_symlink():
        raise _HTTPError(400, f"{name!r} is a symbolic link in the output directory; refusing to write through it, pick another name")
    if target.resolve().parent != base:
        raise _HTTPError(400, f"{name!r} resolves outside the output directory {base}")
    if target.exists():
        raise _HTTPError(409, f"{target} already exists; pick another name or remove it")
    return target


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "moetrace-control"

    # -------------------------------------------------------------- plumbing
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json", headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors raised by ``http.server`` itself (bad request line, header overflow): JSON too."""
        self.close_connection = True
        text = message or HTTPStatus(code).phrase
        self._json(code, {"error": f"{text}: {explain}" if explain else text})

    def _drain(self) -> None:
        """Discard an unread request body (bounded), so the client can read the error reply.

        Closing a socket with unread input resets the connection, and the
        client would see a broken pipe instead of, e.g., the 413. Bodies
        declared larger than ``_DRAIN_BYTES`` are not read at all.
        """
        try:
            remaining = int(self.headers.get("Content-Length", 0))
        except ValueError:
            return
        if remaining > _DRAIN_BYTES:
            return
        deadline = time.monotonic() + _DRAIN_SECONDS
        self.connection.settimeout(_DRAIN_SECONDS)
        try:
            while remaining > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(remaining, 1 << 16))
                if not chunk:
                    break
                remaining -= len(chunk)
        except OSError:
            pass

    def _dispatch(self) -> None:
        self._body_read = False
        try:
            self._route()
        except _HTTPError as exc:
            self.close_connection = True
            if not self._body_read:
                self._drain()
            self._json(exc.status, {"error": exc.message}, exc.headers)
        except RecorderStateError as exc:
            self._json(409, {"error": str(exc)})
        except (ConnectionError, TimeoutError):  # the client went away: the server logs it at debug level
            raise
        except (TraceWriteError, OSError) as exc:
            log.warning("control %s %s failed: %s", self.command, self.path, exc)
            self._json(500, {"error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # the server must answer, whatever the recorder raised
            log.exception("control %s %s failed", self.command, self.path)
            self._json(500, {"error": f"{type(exc).__name__}: {exc}"})

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def __getattr__(self, name: str) -> Any:
        # Any other method (PUT, DELETE, HEAD, ...) is answered by the router: 404 or 405.
        if name.startswith("do_") and name[3:].isalpha() and name[3:].isupper():
            return self._dispatch
        raise AttributeError(name)

    # -------------------------------------------------------------- routing
    def _authorise(self) -> None:
        expected = self.server.token
        if expected is None:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())
        if not ok:
            reason = "missing bearer token" if not header else "wrong bearer token"
            raise _HTTPError(401, f"{reason}: send 'Authorization: Bearer <token>' ({TOKEN_ENV} of the server)",
                             {"WWW-Authenticate": 'Bearer realm="moetrace"'})

    def _body(self) -> dict[str, object]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise _HTTPError(400, "chunked request bodies are not supported; send Content-Length")
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            return {}
        try:
            length = int(raw_length)
        except ValueError:
            raise _HTTPError(400, f"Content-Length {raw_length!r} is not an integer") from None
        if length < 0:
            raise _HTTPError(400, f"Content-Length {length} is negative")
        if length > self.server.max_body_bytes:
            raise _HTTPError(413, f"request body of {length} bytes exceeds the limit of {self.server.max_body_bytes} bytes")
        self._body_read = True
        data = self.rfile.read(length) if length else b""
        if len(data) != length:
            raise _HTTPError(400, f"request body ended after {len(data)} of {length} bytes")
        if not data.strip():
            return {}
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _HTTPError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, f"request body must be a JSON object, got {type(body).__name__}")
        return body

    def _route(self) -> None:
        self._authorise()
        path = urlsplit(self.path).path
        allowed = _ROUTES.get(path)
        if allowed is None:
            raise _HTTPError(404, f"no such endpoint {path!r}; endpoints: {', '.join(sorted(_ROUTES))}")
        if self.command != allowed:
            raise _HTTPError(405, f"{path} accepts {allowed} only, not {self.command}", {"Allow": allowed})
        body = self._body() if self.command == "POST" else {}
        accepted = {"name"} if path == "/dump" else set()
        unknown = sorted(set(body) - accepted)
        if unknown:
            raise _HTTPError(400, f"unknown field(s) {unknown} for {path}; accepted: {sorted(accepted) or 'none'}")
        recorder = self.server.recorder if self.server.recorder is not None else get_recorder()
        getattr(self, "_" + path[1:])(recorder, body)

    # -------------------------------------------------------------- endpoints
    def _start(self, recorder: Recorder, body: dict[str, object]) -> None:
        with self.server.lifecycle:
            otel.traced_start_record(recorder)
        self._json(200, {"ok": True, "status": recorder.status()})

    def _stop(self, recorder: Recorder, body: dict[str, object]) -> None:
        with self.server.lifecycle:
            otel.traced_stop_record(recorder)
        self._json(200, {"ok": True, "status": recorder.status()})

    def _dump(self, recorder: Recorder, body: dict[str, object]) -> None:
        if isinstance(recorder, NoOpRecorder):
            raise RecorderStateError("dump: no recorder is configured; call moetrace.configure(...) in the served process first")
        with self.server.lifecycle:
            target = _dump_target(Path(recorder.config.output_dir), body["name"]) if "name" in body else None
            written = otel.traced_dump_record(recorder, target)
        self._json(200, {"ok": True, "path": str(written)})

    def _status(self, recorder: Recorder, body: dict[str, object]) -> None:
        self._json(200, recorder.status())

    def _metrics(self, recorder: Recorder, body: dict[str, object]) -> None:
        self._send(200, generate_latest(self.server.metrics_registry), CONTENT_TYPE_LATEST)


class _Server(GuardedServerMixin, HTTPServer):
    def __init__(self, address: tuple[str, int], recorder: Recorder | None, token: str | None, max_body_bytes: int,
                 limits: ServerLimits | None, per_ep_rank: bool) -> None:
        super().__init__(address, _Handler, limits)
        self.recorder = recorder
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.prefetch_body_bytes = max_body_bytes
        self.metrics_registry = prometheus.register(recorder, per_ep_rank=per_ep_rank)
        # Serialises start/stop/dump: a name check and the write it guards happen together.
        self.lifecycle = threading.Lock()


class ControlServer(ServerHandle):
    """A running control endpoint (daemon thread); a context manager, :meth:`close` stops it.

    ``.url`` is ``http://host:port``; ``.port``, ``.close()`` as every :class:`~moetrace.http.ServerHandle`.
    """

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.host = str(server.server_address[0])
        self.thread = self.serve(server, "moetrace-control")

    def __repr__(self) -> str:
        return f"ControlServer(url={self.url!r})"


def serve_control(recorder: Recorder | None = None, port: int = 0, host: str = "127.0.0.1",
                  token: str | None = None, max_body_bytes: int = 65536,
                  limits: ServerLimits | None = None, per_ep_rank: bool = False) -> ControlServer:
    """Serve the control endpoint in a daemon thread.

    Args:
        recorder: the recorder to control; ``None`` looks up
            :func:`moetrace.get_recorder` on every request.
        port: TCP port; ``0`` picks a free one (read ``.port`` / ``.url``).
        host: bind address; loopback by default. Binding elsewhere without a
            token logs a warning: anyone who reaches the port can dump files.
        token: bearer token every request must carry; ``None`` reads
            ``MOETRACE_CONTROL_TOKEN`` (unset or empty: no token).
        max_body_bytes: larger request bodies are refused with 413.
        limits: connection limits (read timeout, open connections, worker
            threads, head size, request and CPU budgets); ``None``:
            :class:`ServerLimits` defaults (5 s, 512, 8, 16 KiB, 50/s, 0.1 core).
        per_ep_rank: ``/metrics`` also exports the ``[layer, ep_rank]`` matrices (3 x L x R
            series; off by default, see docs/observability.md), which ``moetrace top`` needs for
            balancedness over EP ranks and the per-rank load bars.

    Returns:
        a :class:`ControlServer` with ``.url``, ``.port`` and ``.close()``.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if max_body_bytes < 0:
        raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
    try:
        server = _Server((host, port), recorder, token, max_body_bytes, limits, per_ep_rank)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve the control endpoint on {host}:{port}: {exc.strerror}; pick another port or 0 for a free one") from exc
    if token is None and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("moetrace control endpoint on %s:%d has no token: set %s or pass token=...", host, server.server_address[1], TOKEN_ENV)
    return ControlServer(server)

