"""The HTTP control endpoint: lifecycle over HTTP, hostile input, concurrency, errors."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import moetrace
from moetrace import control
from moetrace.http import ServerLimits
from moetrace.trace import open_trace
from tests.exporters.workload import serve, serving_loop


def call(server, method: str, path: str, body: object = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, dict[str, str], object]:
    """One request; returns ``(status, headers, JSON body or text)``."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers=headers or {})
        resp = conn.getresponse()
        payload = resp.read()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    if hdrs.get("content-type") == "application/json" and payload:
        return resp.status, hdrs, json.loads(payload)
    return resp.status, hdrs, payload.decode()


def raw_request(server, head: bytes, body: bytes = b"", shutdown_write: bool = False) -> tuple[int, dict]:
    """Send bytes as they are (for malformed framing); returns the status and JSON error."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + body)
        if shutdown_write:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


@pytest.fixture
def served(tmp_path):
    """A recorder on the reference serving loop (output_dir ``tmp/out``), its control server, the loop.

    No request or CPU budget: test_concurrent_requests hammers the server as fast as it answers
    (the budgets are tested in test_hardening.py).
    """
    loop, rec = serving_loop(tmp_path / "out")
    (tmp_path / "out").mkdir()
    limits = ServerLimits(max_requests_per_second=None, max_cpu_share=None)
    with control.serve_control(rec, limits=limits) as server:
        yield server, rec, loop


def test_lifecycle_end_to_end(served, tmp_path):
    server, rec, loop = served
    assert server.url == f"http://127.0.0.1:{server.port}"
    status, _, body = call(server, "GET", "/status")
    assert status == 200 and body["configured"] and not body["recording"] and body["output_dir"] == str(tmp_path / "out")

    status, _, body = call(server, "POST", "/start")
    assert status == 200 and body["ok"] and body["status"]["recording"] and body["status"]["passes"] == 0
    passes = serve(loop, 6)
    assert passes > 0

    status, _, body = call(server, "GET", "/status")
    assert (body["recording"], body["passes"], body["mode"]) == (True, passes, "stat") and body["tokens"] == rec.snapshot().num_tokens
    status, hdrs, text = call(server, "GET", "/metrics")
    assert status == 200 and hdrs["content-type"].startswith("text/plain")
    scraped = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.keys() - {"rank"}}
    assert scraped["moetrace_forward_passes_total"] == passes and scraped["moetrace_recording"] == 1

    status, _, body = call(server, "POST", "/stop")
    assert status == 200 and not body["status"]["recording"] and body["status"]["passes"] == passes
    status, _, body = call(server, "POST", "/dump", {"name": "run1"})
    assert status == 200 and body == {"ok": True, "path": str((tmp_path / "out" / "run1.h5").resolve())}
    snap = rec.snapshot()
    with open_trace(body["path"]) as trace:
        np.testing.assert_array_equal(trace.physical_count(), snap.physical_count)
        assert trace.num_passes()[0] == passes and trace.attrs["complete"]
    status, _, body = call(server, "POST", "/dump", raw=b"")  # default name, inside output_dir
    assert status == 200 and Path(body["path"]).parent == tmp_path / "out" and Path(body["path"]).is_file()
    assert call(server, "GET", "/status")[2]["last_dump_path"] == body["path"]


def test_lifecycle_conflicts_are_409(served):
    server, rec, _ = served
    assert call(server, "POST", "/stop")[0] == 409
    status, _, body = call(server, "POST", "/dump")
    assert status == 409 and "start_record" in body["error"]
    assert call(server, "POST", "/start")[0] == 200
    status, _, body = call(server, "POST", "/start")
    assert status == 409 and "already recording" in body["error"]
    assert rec.recording


def test_unconfigured_global_recorder(tmp_path):
    moetrace.set_recorder(None)
    with moetrace.serve_control() as server:  # recorder looked up per request
        assert call(server, "GET", "/status")[2]["configured"] is False
        for path in ("/start", "/stop", "/dump"):
            status, _, body = call(server, "POST", path)
            assert status == 409 and "configure" in body["error"], path
        assert call(server, "GET", "/metrics")[:1] == (200,)
        _, rec = serving_loop(tmp_path)
        moetrace.set_recorder(rec)  # configured later: picked up by the running server
        assert call(server, "POST", "/start")[0] == 200 and rec.recording


def test_bearer_token(tmp_path, monkeypatch):
    _, rec = serving_loop(tmp_path)
    compared = []
    real = control.hmac.compare_digest
    monkeypatch.setattr(control.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    with control.serve_control(rec, token="s3cret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer"}):
            status, hdrs, body = call(server, "POST", "/start", headers=headers)
            assert status == 401 and hdrs["www-authenticate"].startswith("Bearer") and "Bearer <token>" in body["error"]
        assert call(server, "GET", "/nope")[0] == 401  # auth comes before routing
        assert not rec.recording
        assert call(server, "POST", "/start", headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert compared, "tokens are compared with hmac.compare_digest (constant time)"
    monkeypatch.setenv("MOETRACE_CONTROL_TOKEN", "from-env")
    with control.serve_control(rec) as server:
        assert call(server, "GET", "/status")[0] == 401
        assert call(server, "GET", "/status", headers={"Authorization": "Bearer from-env"})[0] == 200
    monkeypatch.setenv("MOETRACE_CONTROL_TOKEN", "")
    with control.serve_control(rec) as server:  # empty: no token
        assert call(server, "GET", "/status")[0] == 200


HOSTILE_NAMES = [
    "../escape.h5", "../../etc/passwd", "/tmp/absolute.h5", "sub/dir.h5", "..", ".", ".hidden.h5", "..\\win.h5",
    "", "a\x00b.h5", "x" * 300, 123, None, ["a.h5"], {"n": 1},
]


def test_hostile_dump_names_are_refused(served, tmp_path):
    server, rec, loop = served
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "out" / "link.h5").symlink_to(outside / "target.h5")
    (tmp_path / "out" / "linkdir").symlink_to(outside, target_is_directory=True)
    (tmp_path / "out" / "taken.h5").write_bytes(b"precious")
    call(server, "POST", "/start")
    passes = serve(loop, 3)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for name in [*HOSTILE_NAMES, "link.h5", "link", "linkdir/x.h5"]:
        status, _, body = call(server, "POST", "/dump", {"name": name})
        assert status == 400 and body["error"], (name, status, body)
    status, _, body = call(server, "POST", "/dump", {"name": "taken.h5"})
    assert status == 409 and "already exists" in body["error"]
    assert (tmp_path / "out" / "taken.h5").read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    assert rec.recording and rec.num_passes == passes and call(server, "GET", "/status")[2]["last_dump_path"] is None


def test_malformed_and_oversized_bodies(served):
    server, rec, _ = served
    call(server, "POST", "/start")
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"\xff\xfe\x00", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'"name"', 400, "JSON object"),
        (json.dumps({"name": "a.h5", "path": "/etc"}).encode(), 400, "unknown field"),
        (b"x" * 65537, 413, "exceeds the limit"),
        (b"x" * (10 << 20), 413, "exceeds the limit"),  # the reply still reaches the client
    ]
    for raw, code, message in cases:
        status, _, body = call(server, "POST", "/dump", raw=raw, headers={"Content-Type": "application/json"})
        assert status == code and message in body["error"], (raw[:20], status, body)
    assert call(server, "POST", "/stop", raw=b'{"force": true}')[0] == 400  # /stop takes no fields
    head = b"POST /dump HTTP/1.1\r\nHost: x\r\n"
    assert raw_request(server, head + b"Content-Length: 999999999999\r\n\r\n")[0] == 413
    assert raw_request(server, head + b"Content-Length: -5\r\n\r\n")[0] == 400
    assert raw_request(server, head + b"Content-Length: ten\r\n\r\n")[0] == 400
    assert raw_request(server, head + b"Transfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n")[0] == 400
    status, body = raw_request(server, b"M-SEARCH /status HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 501 and "Unsupported method" in body["error"]  # http.server's own errors are JSON too
    status, body = raw_request(server, head + b"Content-Length: 100\r\n\r\n", b'{"name": ', shutdown_write=True)
    assert status == 400 and "ended after 9 of 100 bytes" in body["error"]
    assert rec.recording and call(server, "GET", "/status")[2]["last_dump_path"] is None


def test_wrong_method_and_unknown_path(served):
    server, rec, _ = served
    for method, path in [("GET", "/start"), ("GET", "/dump"), ("POST", "/status"), ("POST", "/metrics"),
                         ("PUT", "/dump"), ("DELETE", "/stop"), ("PATCH", "/start"), ("OPTIONS", "/status")]:
        status, hdrs, body = call(server, method, path)
        assert status == 405 and hdrs["allow"] in ("GET", "POST") and "only" in body["error"], (method, path)
    status, hdrs, _ = call(server, "HEAD", "/status")
    assert status == 405 and hdrs["allow"] == "GET"
    for method, path in [("GET", "/"), ("GET", "/nope"), ("POST", "/start/"), ("POST", "/dump/../start"),
                         ("GET", "/../../etc/passwd"), ("DELETE", "/everything")]:
        status, _, body = call(server, method, path)
        assert status == 404 and "no such endpoint" in body["error"], (method, path)
    assert not rec.recording  # nothing started by any of these


def test_write_failure_is_500_and_recoverable(served, tmp_path):
    server, _, loop = served
    call(server, "POST", "/start")
    passes = serve(loop, 2)
    out = tmp_path / "out"
    shutil.rmtree(out)
    out.write_text("a file where the output directory was")
    for body in (None, {"name": "x.h5"}):
        status, _, reply = call(server, "POST", "/dump", body)
        assert status == 500 and reply["error"], reply
    out.unlink()
    out.mkdir()
    status, _, reply = call(server, "POST", "/dump", {"name": "x.h5"})  # the data survived the failure
    assert status == 200
    with open_trace(reply["path"]) as trace:
        assert trace.num_passes()[0] == passes


def test_concurrent_requests(served):
    server, rec, loop = served
    with ThreadPoolExecutor(16) as pool:
        starts = list(pool.map(lambda _: call(server, "POST", "/start")[0], range(16)))
    assert sorted(starts) == [200] + [409] * 15
    stop = threading.Event()
    readers: list[int] = []

    def read() -> None:
        while not stop.is_set():
            readers.append(call(server, "GET", "/status")[0])
            readers.append(call(server, "GET", "/metrics")[0])

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        passes = serve(loop, 6)  # the forward runs while the endpoint is hammered
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert readers and set(readers) == {200}
    with ThreadPoolExecutor(8) as pool:
        distinct = list(pool.map(lambda i: call(server, "POST", "/dump", {"name": f"d{i}.h5"}), range(8)))
        same = list(pool.map(lambda _: call(server, "POST", "/dump", {"name": "same.h5"})[0], range(8)))
    assert [s for s, _, _ in distinct] == [200] * 8
    assert sorted(same) == [200] + [409] * 7
    for _, _, body in distinct:
        with open_trace(body["path"]) as trace:
            assert trace.num_passes()[0] == passes
    assert rec.recording and rec.num_passes == passes


def test_server_setup_errors_and_warning(tmp_path, caplog):
    _, rec = serving_loop(tmp_path)
    with control.serve_control(rec) as first:
        with pytest.raises(OSError, match=f"cannot serve the control endpoint on 127.0.0.1:{first.port}"):
            control.serve_control(rec, port=first.port)
    with pytest.raises(ValueError, match="max_body_bytes"):
        control.serve_control(rec, max_body_bytes=-1)
    with caplog.at_level(logging.WARNING, logger="moetrace.control"):
        with control.serve_control(rec, host="0.0.0.0") as open_server:
            assert call(open_server, "GET", "/status")[0] == 200
    assert any("has no token" in r.message for r in caplog.records)
    first.close()  # idempotent after the context exited


def test_small_body_limit(tmp_path):
    _, rec = serving_loop(tmp_path)
    rec.start_record()
    with control.serve_control(rec, max_body_bytes=16) as server:
        assert call(server, "POST", "/dump", {"name": "a-long-name.h5"})[0] == 413
        assert call(server, "POST", "/dump", {"name": "a.h5"})[0] == 200


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_ipv6_loopback(tmp_path):
    _, rec = serving_loop(tmp_path)
    try:
        server = control.serve_control(rec, host="::1")
    except OSError:
        pytest.skip("::1 is not configured on this machine")
    with server:
        assert server.url == f"http://[::1]:{server.port}"
        conn = http.client.HTTPConnection("::1", server.port, timeout=10)
        conn.request("GET", "/status")
        assert conn.getresponse().status == 200
        conn.close()

