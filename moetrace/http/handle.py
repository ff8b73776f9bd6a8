"""A server running in a daemon thread: the one handle the control and metrics endpoints share."""

from __future__ import annotations

import socketserver
import threading

__all__ = ["ServerHandle"]


class ServerHandle:
    """A ``socketserver`` server serving in a daemon thread; :meth:`close` stops it and frees the port.

    Subclasses (:class:`~moetrace.control.ControlServer`,
    :class:`~moetrace.exporters.prometheus.MetricsServer`) set ``server``,
    ``thread`` and ``host`` and may give :attr:`url` a path.
    """

    server: socketserver.BaseServer
    thread: threading.Thread
    host: str

    @staticmethod
    def serve(server: socketserver.BaseServer, name: str) -> threading.Thread:
        """Start ``server.serve_forever`` in a daemon thread called ``name``."""
        thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
        thread.start()
        return thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])  # type: ignore[attr-defined]

    @property
    def origin(self) -> str:
        """``http://host:port`` (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        return self.origin

    def close(self) -> None:
        """Stop serving, wait for the server thread and close the socket (idempotent)."""
        if self.thread.is_alive():
            self.server.shutdown()
            self.thread.join()
        self.server.server_close()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
