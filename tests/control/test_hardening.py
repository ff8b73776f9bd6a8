"""The control and metrics endpoints under hostile clients (issue 18): loopback only, bounded in count and time.

The load test holds hundreds of idle half-sent connections while a separate
process floods valid requests, and checks what does not depend on the
machine's speed: every request succeeds, the server's threads stay within
``1 + max_workers``, the idle connections are dropped by the read timeout,
and every thread and file descriptor is released afterwards. Latency and hook
cost are printed (``pytest -s``) and recorded by ``benchmarks/control_load.py``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import socket
import struct
import threading
import time

import pytest
import torch
from moetrace.exporters import prometheus

from moetrace import control
from moetrace.http import ServerLimits
from tests.control.load import LoadClient, hook_cost, open_sockets, server_threads
from tests.exporters.workload import serving_loop

IDLE = 300
HANG_S = 120.0
"""How long a wait may last before it is a hang: waits end as soon as what they wait for happens."""


def wait_for(predicate, seconds: float = HANG_S) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def get(port: int, path: str = "/status", timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def read_reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def start(kind: str, rec, limits: ServerLimits):
    """A control endpoint or a Prometheus exporter on loopback, and the path to flood."""
    if kind == "control":
        return control.serve_control(rec, limits=limits), "/status"
    return prometheus.start_http_server(0, recorder=rec, limits=limits), "/metrics"


def inner(server):
    """The guarded server behind a ControlServer or a MetricsServer."""
    return server.server


@pytest.mark.parametrize(("kind", "budgets"), [("control", False), ("control", True), ("metrics", True)])
def test_idle_half_open_connections_and_a_flood(kind, budgets, tmp_path):
    """300 half-sent connections held, 8 client threads flooding, a probe every 20 ms; then release."""
    _, rec = serving_loop(tmp_path)
    rec.start_record()
    ids = torch.randint(0, 16, (8, 2))
    quiet = hook_cost(rec, ids, 0.3)  # (and the recorder's own threads started)
    threads_before, sockets_before = threading.active_count(), open_sockets()
    limits = ServerLimits()  # the defaults: 5 s read timeout, request and CPU budgets
    if not budgets:
        limits = dataclasses.replace(limits, max_requests_per_second=None, max_cpu_share=None)
    server, path = start(kind, rec, limits)
    started = time.monotonic()
    try:
        with LoadClient(server.port, path=path, idle=IDLE, concurrency=8, idle_wait=HANG_S) as client:
            assert wait_for(lambda: inner(server).open_connections >= IDLE)
            client.flood()  # returns once a flood request has an outcome
            peak_threads = peak_open = 0
            flood: dict[str, list[float]] = {"wall_us": [], "cpu_us": []}
            end = time.monotonic() + 1.2
            while time.monotonic() < end:
                cost = hook_cost(rec, ids, 0.05)
                flood["wall_us"].append(cost["wall_us"])
                flood["cpu_us"].append(cost["cpu_us"])
                peak_threads = max(peak_threads, server_threads())
                peak_open = max(peak_open, inner(server).open_connections)
            client.quiet()
            summary = client.finish(timeout=2 * HANG_S)
    finally:
        server.close()
    lifetime, served_cpu = time.monotonic() - started, inner(server).served_cpu_seconds
    flood_cost = {k: sorted(v)[len(v) // 2] for k, v in flood.items()}
    print(f"\n{kind} ({limits}): {json.dumps(summary)}\nhooks quiet {quiet}, during the flood {flood_cost}, "
          f"server threads peak {peak_threads}, served CPU {served_cpu:.3f} s in {lifetime:.1f} s")
    outcomes = summary["outcomes"]
    assert {key.split()[1] for key in outcomes} == {"200"}, outcomes  # every request answered, none failed
    assert outcomes.get("flood 200", 0) > 0 and outcomes.get("probe 200", 0) > 0  # the client waited for one of each
    if budgets:  # each budget, plus what was admitted before it ran out
        assert served_cpu <= limits.max_cpu_share * (lifetime + 1) + 0.05 * limits.max_workers
        served = outcomes.get("flood 200", 0) + outcomes.get("probe 200", 0)
        assert served <= limits.max_requests_per_second * (lifetime + 1) + 64
    assert peak_open >= IDLE  # the flood was answered while the idle connections were held
    assert 1 <= peak_threads <= 1 + limits.max_workers
    assert summary["idle_closed_by_server"] == IDLE  # dropped by the read timeout (how late: printed, the machine's business)
    assert wait_for(lambda: threading.active_count() == threads_before), threading.enumerate()
    assert wait_for(lambda: open_sockets() == sockets_before)
    assert server_threads() == 0
    assert rec.recording and rec.num_passes > 0


@pytest.fixture
def recorder(tmp_path):
    _, rec = serving_loop(tmp_path)
    return rec


def test_connections_beyond_the_bound_get_503(recorder):
    limits = ServerLimits(read_timeout=2.0, max_connections=16, max_workers=2)
    with control.serve_control(recorder, limits=limits) as server:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=HANG_S) for _ in range(16)]
        for sock in held:
            sock.sendall(b"GET /sta")
        assert wait_for(lambda: inner(server).open_connections == 16)
        status, headers, body = get(server.port)
        # refused while the 16 were held: at once, not after the idle ones time out (then it would serve it)
        assert status == 503 and headers["retry-after"] == "1" and "16 connections" in json.loads(body)["error"]
        assert server_threads() <= 1 + limits.max_workers
        for sock in held:  # the read timeout frees the slots
            assert b" 408 " in read_reply(sock)
            sock.close()
        assert get(server.port)[0] == 200


def test_slow_and_half_sent_requests_are_dropped(recorder):
    limits = ServerLimits(read_timeout=1.0)
    with control.serve_control(recorder, limits=limits) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            # Trickling bytes does not extend the deadline: uncut, the 640 bytes would all be sent (32 s) without an error.
            with pytest.raises(OSError):
                for byte in b"GET /status HTTP/1.1\r\nHost: x\r\n" * 20:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.05)
            reply = read_reply(sock)
            assert reply.startswith(b"HTTP/1.0 408") and b"within 1 s" in reply
        # A declared body that never comes: the worker is never handed the request.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /dump HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            assert read_reply(sock).startswith(b"HTTP/1.0 408")
        assert get(server.port)[0] == 200


def test_request_head_size_limit(recorder):
    limits = ServerLimits(max_header_bytes=1024)
    with control.serve_control(recorder, limits=limits) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /status HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n")
            reply = read_reply(sock)
        assert reply.startswith(b"HTTP/1.0 431") and b"larger than 1024 bytes" in reply
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # no end of head at all
            sock.sendall(b"G" * 4096)
            assert read_reply(sock).startswith(b"HTTP/1.0 431")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/status", headers={"X-Pad": "a" * 500})
        assert conn.getresponse().status == 200
        conn.close()


def test_clients_that_go_away_are_logged_quietly(recorder, caplog, capfd, monkeypatch):
    real_status = recorder.status

    def slow_status():  # the client is gone before the reply is written
        time.sleep(0.3)
        return real_status()

    monkeypatch.setattr(recorder, "status", slow_status)
    with caplog.at_level(logging.DEBUG, logger="moetrace"), control.serve_control(recorder) as server:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # reset
        assert wait_for(lambda: sum("went away" in r.getMessage() for r in caplog.records) == 3)
        assert get(server.port)[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert all(r.levelno == logging.DEBUG and r.exc_info is None for r in gone)
    assert "Traceback" not in capfd.readouterr().err


def test_limits_are_validated():
    for bad in ({"read_timeout": 0}, {"max_connections": 0}, {"max_workers": -1}, {"max_header_bytes": 1.5},
                {"max_cpu_share": 0}, {"max_cpu_share": 9}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerLimits(**bad)
