"""A threaded HTTP server that hostile or broken clients cannot exhaust.

``http.server.ThreadingHTTPServer`` starts one thread per connection and lets
it wait forever for the request: 300 clients that send half a request line
hold 300 threads of the engine's process. :class:`GuardedServerMixin` replaces
that model, for any ``socketserver.TCPServer`` subclass (``HTTPServer``,
``wsgiref``'s ``WSGIServer``) and its usual request handler:

- one event-loop thread accepts connections and reads each request head (and a
  small body, up to ``prefetch_body_bytes``) without blocking; an idle or
  half-sent connection costs a socket and its buffer, never a thread;
- a complete request goes to a pool of at most ``max_workers`` threads, which
  run the ordinary handler on the bytes already read;
- a connection that has not sent a complete request ``read_timeout`` seconds
  after it was accepted gets ``408`` and is closed (a client trickling bytes
  does not extend its time); a worker's socket operations time out after
  ``read_timeout`` too;
- a request head larger than ``max_header_bytes`` gets ``431`` and is closed;
- beyond ``max_connections`` open connections (pending or being served), a
  new one gets ``503`` at once and is closed;
- at most ``max_requests_per_second`` requests are served, and the workers
  spend at most ``max_cpu_share`` of one core's time serving (their CPU time
  is metered per request), both averaged over a second: while either budget
  is spent, the server stops accepting, and new connections wait in the
  kernel's listen backlog (beyond it, the kernel refuses them) until the
  budgets have refilled. This bounds what a flood of valid requests can take
  from the application's threads: every request hands the GIL back and forth
  many times (so the request rate counts, however cheap a ``/status`` is),
  and a 500-series ``/metrics`` costs milliseconds of CPU. While it waits, the
  flood costs the process nothing;
- a client that goes away (reset, broken pipe, timeout) costs one line at
  debug level on the ``moetrace.http`` logger, never a traceback.

The server thread count is therefore at most ``1 + max_workers``, whatever the
clients do. Handlers must close the connection after one request (HTTP/1.0,
the default of ``BaseHTTPRequestHandler`` and ``WSGIRequestHandler``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["GuardedServerMixin", "ServerLimits"]

log = logging.getLogger("moetrace.http")

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_CONTENT_LENGTH = re.compile(rb"\ncontent-length[ \t]*:[ \t]*(\d{1,15})[ \t]*\r?\n", re.IGNORECASE)
_ACCEPT_BATCH = 64  # connections accepted per wake-up of the event loop
_LINGER_SECONDS = 1.0  # a refused client gets this long to read its error reply
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Resource limits of a :class:`GuardedServerMixin` server.

    Attributes:
        read_timeout: seconds a connection has, from its accept, to send a
            complete request; also the timeout of each socket operation while
            the request is served.
        max_connections: open connections (waiting for their request or being
            served); a new connection beyond it is answered 503 and closed.
        max_workers: threads that serve complete requests.
        max_header_bytes: largest request head (request line and headers).
        max_requests_per_second: requests served per second, averaged over a
            second; ``None``: no limit.
        max_cpu_share: fraction of one core's time that workers may spend
            serving, averaged over a second; ``None``: no limit.
    """

    read_timeout: float = 5.0
    max_connections: int = 512
    max_workers: int = 8
    max_header_bytes: int = 16384
    max_requests_per_second: float | None = 50.0
    max_cpu_share: float | None = 0.1

    def __post_init__(self) -> None:
        if not self.read_timeout > 0:
            raise ValueError(f"read_timeout must be > 0 seconds, got {self.read_timeout}")
        for name in ("max_connections", "max_workers", "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_requests_per_second is not None and not self.max_requests_per_second > 0:
            raise ValueError(f"max_requests_per_second must be > 0 or None, got {self.max_requests_per_second}")
        if self.max_cpu_share is not None and not 0 < self.max_cpu_share <= self.max_workers:
            raise ValueError(f"max_cpu_share must be in (0, max_workers] or None, got {self.max_cpu_share}")


def _reply(status: int, message: str) -> bytes:
    """A complete HTTP/1.0 error response with a JSON body ``{"error": message}``."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n")
    if status == 503:
        head += "Retry-After: 1\r\n"
    return head.encode() + b"\r\n" + body


class _HeadThenSocket(io.RawIOBase):
    """Raw reader: the bytes the event loop already read, then the socket."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        super().__init__()
        self._head = memoryview(head)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(buffer)


class _Connection:
    """An accepted socket as request handlers see it.

    ``makefile("rb")`` first yields the bytes the event loop has read; a
    handler's ``settimeout`` never exceeds the server's ``read_timeout``.
    Everything else is the socket's own.
    """

    def __init__(self, sock: socket.socket, head: bytes, timeout: float) -> None:
        self._sock, self._head, self._limit = sock, head, timeout
        sock.settimeout(timeout)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(self._limit if value is None else min(value, self._limit))

    def makefile(self, mode: str = "r", buffering: int = -1, **kwargs: Any) -> Any:
        if mode == "rb":
            size = buffering if buffering > 0 else io.DEFAULT_BUFFER_SIZE
            return io.BufferedReader(_HeadThenSocket(self._head, self._sock), size)
        return self._sock.makefile(mode, buffering, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@dataclasses.dataclass
class _Pending:
    """A connection whose request is still arriving."""

    address: Any
    deadline: float
    data: bytearray = dataclasses.field(default_factory=bytearray)
    need: int | None = None  # bytes to read before hand-off, known once the head is complete


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class GuardedServerMixin:
    """Bounded event-loop front end for a ``socketserver.TCPServer`` subclass.

    Mix in first: ``class Server(GuardedServerMixin, HTTPServer)``, then
    ``Server((host, port), Handler, ServerLimits(...))``. ``serve_forever``,
    ``shutdown`` and ``server_close`` keep their ``socketserver`` meaning.
    ``prefetch_body_bytes`` (set before serving) is the largest declared
    request body the event loop reads before the hand-off, so a worker never
    waits for a slow body it will accept.
    """

    allow_reuse_address = True
    request_queue_size = 128
    prefetch_body_bytes = 0

    # provided by socketserver.TCPServer
    socket: socket.socket
    RequestHandlerClass: Any
    address_family: int

    def __init__(self, address: tuple[str, int], handler: Any, limits: ServerLimits | None = None) -> None:
        self.limits = limits if limits is not None else ServerLimits()
        self._pool = ThreadPoolExecutor(self.limits.max_workers, thread_name_prefix="moetrace-http-worker")
        self._pending: dict[socket.socket, _Pending] = {}
        self._closing: dict[socket.socket, float] = {}  # refused connections -> close deadline
        self._busy = 0
        self._budget = self.limits.max_cpu_share or 0.0  # CPU seconds the workers may still spend
        self._tokens = max(1.0, self.limits.max_requests_per_second or 0.0)  # requests that may still be served
        self._refilled = time.monotonic()
        self._accepting = False
        self.served_cpu_seconds = 0.0  # CPU time the workers have spent serving, in total
        self._busy_lock = threading.Lock()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        try:
            infos = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError:
            self._wake_r.close()
            self._wake_w.close()
            raise
        family, _, _, _, sockaddr = infos[0]
        self.address_family = family
        super().__init__((sockaddr[0], address[1]), handler)  # type: ignore[call-arg]  # on failure: server_close()

    # ------------------------------------------------------------------ public
    @property
    def open_connections(self) -> int:
        """Connections waiting for their request or being served (refused ones not counted)."""
        return len(self._pending) + self._busy

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept, read and dispatch requests until :meth:`shutdown`."""
        self._stopped.clear()
        self.socket.setblocking(False)
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, self._woken)
        self._accepting = False
        try:
            while not self._stop.is_set():
                resume = self._pace(selector)
                now = time.monotonic()
                deadlines = [p.deadline for p in self._pending.values()] + list(self._closing.values())
                timeout = max(0.0, min([poll_interval, resume, *(d - now for d in deadlines)]))
                for key, _ in selector.select(timeout):
                    key.data(selector, key.fileobj)
                self._expire(selector, time.monotonic())
        finally:
            for sock in [*self._pending, *self._closing]:
                _close(sock)
            self._pending.clear()
            self._closing.clear()
            selector.close()
            self._stop.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (from another thread) and wait until it has returned."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket and wait for the workers to finish their requests."""
        super().server_close()  # type: ignore[misc]
        self._pool.shutdown(wait=True)
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------- event loop
    def _woken(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        try:
            sock.recv(64)
        except OSError:
            pass

    def _pace(self, selector: selectors.BaseSelector) -> float:
        """Accept while the CPU budget lasts; returns the seconds until it refills (``inf``: accepting)."""
        wait = self._budget_wait()
        if wait == 0.0 and not self._accepting:
            selector.register(self.socket, selectors.EVENT_READ, self._accept)
        elif wait > 0.0 and self._accepting:
            selector.unregister(self.socket)
        self._accepting = wait == 0.0
        return wait if wait else float("inf")

    def _budget_wait(self) -> float:
        """Refill the request and CPU budgets (one second's worth at most); seconds until both allow a request."""
        rate, share = self.limits.max_requests_per_second, self.limits.max_cpu_share
        now = time.monotonic()
        elapsed, self._refilled = now - self._refilled, now
        wait = 0.0
        with self._busy_lock:
            if rate is not None:
                self._tokens = min(max(1.0, rate), self._tokens + elapsed * rate)
                wait = max(wait, (1.0 - self._tokens) / rate)
            if share is not None:
                self._budget = min(share, self._budget + elapsed * share)
                wait = max(wait, -self._budget / share if self._budget <= 0 else 0.0)
        return max(wait, 1e-3) if wait > 0 else 0.0

    def _accept(self, selector: selectors.BaseSelector, listener: socket.socket) -> None:
        for _ in range(_ACCEPT_BATCH):
            if self._budget_wait():
                return
            try:
                conn, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: try again at the next wake-up
                log.warning("accept failed: %s", exc)
                return
            conn.setblocking(False)
            if self.open_connections >= self.limits.max_connections:
                log.debug("refusing %s: %d connections open", address, self.open_connections)
                self._refuse(selector, conn, 503, f"server busy: {self.limits.max_connections} connections open; retry later")
                continue
            self._pending[conn] = _Pending(address, time.monotonic() + self.limits.read_timeout)
            selector.register(conn, selectors.EVENT_READ, self._read)

    def _read(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        pending = self._pending[conn]
        try:
            chunk = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("client %s went away: %s", pending.address, exc)
            self._drop(selector, conn)
            return
        if not chunk:
            if pending.need is not None:  # the handler answers a short body
                self._hand_off(selector, conn)
            else:
                log.debug("client %s closed the connection before sending a complete request", pending.address)
                self._drop(selector, conn)
            return
        data = pending.data
        start = max(0, len(data) - 3)
        data += chunk
        if pending.need is None:
            end = _HEAD_END.search(data, start)
            limit = self.limits.max_header_bytes
            if (end is None and len(data) > limit) or (end is not None and end.end() > limit):
                del self._pending[conn]
                selector.unregister(conn)
                self._refuse(selector, conn, 431, f"request head larger than {limit} bytes")
                return
            if end is None:
                return
            length = _CONTENT_LENGTH.search(data, 0, end.end())
            declared = int(length.group(1)) if length else 0
            pending.need = end.end() + (declared if declared <= self.prefetch_body_bytes else 0)
        if len(data) >= pending.need:
            self._hand_off(selector, conn)

    def _expire(self, selector: selectors.BaseSelector, now: float) -> None:
        for conn, pending in [(c, p) for c, p in self._pending.items() if p.deadline <= now]:
            log.debug("dropping %s: no complete request within %.1f s", pending.address, self.limits.read_timeout)
            del self._pending[conn]
            selector.unregister(conn)
            self._refuse(selector, conn, 408, f"no complete request within {self.limits.read_timeout:g} s")
        for conn in [c for c, deadline in self._closing.items() if deadline <= now]:
            selector.unregister(conn)
            del self._closing[conn]
            _close(conn)

    def _drop(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        del self._pending[conn]
        selector.unregister(conn)
        _close(conn)

    def _refuse(self, selector: selectors.BaseSelector, conn: socket.socket, status: int, message: str) -> None:
        """Send an error reply without blocking, then close once the client has had time to read it."""
        try:
            conn.send(_reply(status, message))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if len(self._closing) >= self.limits.max_connections:
            _close(conn)
            return
        self._closing[conn] = time.monotonic() + _LINGER_SECONDS
        selector.register(conn, selectors.EVENT_READ, self._discard)

    def _discard(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        """Read and drop what a refused client still sends; close at its end of stream."""
        try:
            if conn.recv(65536):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        selector.unregister(conn)
        del self._closing[conn]
        conn.close()

    def _hand_off(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        pending = self._pending.pop(conn)
        selector.unregister(conn)
        conn.setblocking(True)
        with self._busy_lock:
            self._busy += 1
            self._tokens -= 1.0  # may go below zero: accepting pauses until it is paid back
        try:
            self._pool.submit(self._serve, conn, pending.address, bytes(pending.data))
        except RuntimeError:  # the pool is shutting down (interpreter exit)
            self._finished(conn)

    # ---------------------------------------------------------------- workers
    def _serve(self, conn: socket.socket, address: Any, head: bytes) -> None:
        started = time.thread_time()
        try:
            self.RequestHandlerClass(_Connection(conn, head, self.limits.read_timeout), address, self)
        except (ConnectionError, TimeoutError) as exc:
            log.debug("client %s went away: %s", address, exc or type(exc).__name__)
        except Exception:
            log.exception("serving %s failed", address)
        finally:
            self._finished(conn, time.thread_time() - started)

    def _finished(self, conn: socket.socket, cpu_seconds: float = 0.0) -> None:
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()
        with self._busy_lock:
            self._busy -= 1
            self._budget -= cpu_seconds
            self.served_cpu_seconds += cpu_seconds
