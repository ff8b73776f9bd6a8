"""Load generator for the HTTP endpoints, run in its own process (loopback only).

The client process opens ``--idle`` connections that each send half a
request line and then nothing (the slow-client attack of issue 18), then
obeys commands read from stdin, one per line:

- ``flood``: ``--concurrency`` threads send valid ``GET --path`` requests back
  to back (answered once the first of them has an outcome);
- ``flood-other``: the same flood, aimed at ``--other-port`` (a server in
  another process: the machine's load without the measured process serving it);
- ``quiet``: the flood threads pause;
- ``stop``: every request thread stops (before the server is closed);
- ``exit``: stop (once a probe has had an outcome), wait up to ``--idle-wait``
  seconds for the server to close the idle connections, print one JSON summary
  line and exit.

A probe thread sends one request every ``--probe-interval`` seconds in both
phases; its latencies, by phase, are the "is the endpoint still responsive"
figure. Outcomes (status code or exception name) and latencies of answered
requests are reported by kind: ``flood``, ``flood-other``, ``probe <phase>``.
:class:`LoadClient` drives the process from a test or benchmark, so
the client's own CPU and GIL use stay out of the measured server process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HALF_REQUEST = b"GET /sta"


class _Stats:
    """Outcomes (status code or exception name) of requests, and latencies of the answered ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = {}
        self.outcomes: dict[str, int] = {}

    def add(self, kind: str, outcome: str, seconds: float) -> None:
        """``kind``: e.g. ``flood`` or ``probe quiet``."""
        with self.lock:
            key = f"{kind.split()[0]} {outcome}"
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            if outcome.isdigit():
                self.latency.setdefault(kind, []).append(seconds)


def _request(port: int, path: str, timeout: float) -> str:
    """One GET; returns the status code or the exception name."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return str(resp.status)
    except OSError as exc:
        return type(exc).__name__
    finally:
        conn.close()


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(values), "p50_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, "max_ms": ordered[-1] * 1e3}


def _wait_closed(idle: list[tuple[socket.socket, float]], seconds: float) -> tuple[int, float]:
    """Wait until the server has closed the idle connections; returns (closed, latest close after open, s)."""
    sel = selectors.DefaultSelector()
    for sock, opened in idle:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, opened)
    closed, latest, deadline = 0, 0.0, time.monotonic() + seconds
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
            try:
                if key.fileobj.recv(65536):  # the 408 reply; the end of stream follows
                    continue
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            closed += 1
            latest = max(latest, time.monotonic() - key.data)
            sel.unregister(key.fileobj)
    sel.close()
    return closed, latest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--other-port", type=int, help="a server in another process, for 'flood-other'")
    parser.add_argument("--path", default="/status")
    parser.add_argument("--idle", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=10.0, help="client timeout per request (s)")
    parser.add_argument("--probe-interval", type=float, default=0.02)
    parser.add_argument("--idle-wait", type=float, default=10.0)
    args = parser.parse_args()

    idle = []
    for _ in range(args.idle):
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=10)
        sock.sendall(HALF_REQUEST)
        idle.append((sock, time.monotonic()))
    stats, stop = _Stats(), threading.Event()
    phase = {"name": "quiet", "target": None, "since": 0.0}
    seconds: dict[str, float] = {}
    wake = threading.Event()  # set while flooding
    flooded, probed = threading.Event(), threading.Event()  # a flood request of this phase / a probe has an outcome

    def flood() -> None:
        while not stop.is_set():
            if not wake.wait(0.05):
                continue
            name, target = phase["name"], phase["target"]
            if target is None:
                continue
            start = time.perf_counter()
            outcome = _request(target, args.path, args.timeout)
            stats.add(name, outcome, time.perf_counter() - start)
            flooded.set()

    def probe() -> None:
        while not stop.wait(args.probe_interval):
            name = phase["name"]
            start = time.perf_counter()
            outcome = _request(args.port, args.path, args.timeout)
            stats.add(f"probe {name}", outcome, time.perf_counter() - start)
            probed.set()

    def switch(name: str, target: int | None) -> None:
        now = time.monotonic()
        if phase["target"] is not None:
            seconds[phase["name"]] = seconds.get(phase["name"], 0.0) + now - phase["since"]
        phase.update(name=name, target=target, since=now)
        wake.set() if target is not None else wake.clear()

    threads = [threading.Thread(target=flood) for _ in range(args.concurrency)] + [threading.Thread(target=probe)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command in ("flood", "flood-other"):
            flooded.clear()
            switch(command, args.port if command == "flood" else args.other_port)
            flooded.wait()  # bounded by --timeout: a request that is not answered has an outcome too
        elif command in ("quiet", "stop", "exit"):
            switch("quiet", None)
            if command != "quiet":
                probed.wait()
                stop.set()
                for t in threads:
                    t.join()
            if command == "exit":
                break
        print("ok", flush=True)
    closed, latest = _wait_closed(idle, args.idle_wait)
    for sock, _ in idle:
        sock.close()
    print(json.dumps({
        "idle": args.idle, "idle_closed_by_server": closed, "idle_latest_close_s": latest,
        "outcomes": stats.outcomes, "flood_seconds": seconds,
        "ok_per_s": {name: stats.outcomes.get(f"{name} 200", 0) / t for name, t in seconds.items() if t},
        "latency": {kind: _quantiles(values) for kind, values in stats.latency.items()},
    }), flush=True)


def hook_cost(recorder, ids, seconds: float, batch: int = 50) -> dict[str, float]:
    """Median cost of one recorded pass's hooks (``with_forward_pass`` + ``on_select_experts(ids)``).

    Runs batches of ``batch`` passes in this thread for about ``seconds``;
    returns wall-clock and this thread's CPU time per pass, in microseconds.
    Wall time includes waits for the GIL, CPU time does not.
    """
    wall, cpu, end = [], [], time.perf_counter() + seconds
    while time.perf_counter() < end or not wall:
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(batch):
            with recorder.with_forward_pass():
                recorder.on_select_experts(ids, layer=0)
        wall.append((time.perf_counter() - w0) / batch)
        cpu.append((time.thread_time() - c0) / batch)
    return {"wall_us": statistics.median(wall) * 1e6, "cpu_us": statistics.median(cpu) * 1e6, "batches": len(wall)}


def open_sockets() -> int:
    """Sockets this process holds open (Linux: file descriptors that are sockets)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def server_threads() -> int:
    """Threads of moetrace's HTTP servers in this process (event loops and workers)."""
    return sum(t.name.startswith(("moetrace-http", "moetrace-control", "moetrace-metrics")) for t in threading.enumerate())


class LoadClient:
    """The load generator as a subprocess: ``with LoadClient(port) as c: c.flood(); ...; summary = c.finish()``."""

    def __init__(self, port: int, path: str = "/status", idle: int = 300, concurrency: int = 8,
                 idle_wait: float = 10.0, probe_interval: float = 0.02, other_port: int | None = None) -> None:
        command = [sys.executable, "-m", "tests.control.load", "--port", str(port), "--path", path,
                   "--idle", str(idle), "--concurrency", str(concurrency), "--idle-wait", str(idle_wait),
                   "--probe-interval", str(probe_interval)]
        if other_port is not None:
            command += ["--other-port", str(other_port)]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != word:
            self.proc.kill()
            raise RuntimeError(f"load client said {line!r} instead of {word!r} (exit code {self.proc.poll()})")

    def _send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def flood(self, other: bool = False) -> None:
        """Start the flood of valid requests, at ``other_port`` if ``other`` (returns once one has an outcome)."""
        self._send("flood-other" if other else "flood")
        self._expect("ok")

    def quiet(self) -> None:
        """Pause the flood."""
        self._send("quiet")
        self._expect("ok")

    def stop(self) -> None:
        """Stop every request thread (the idle connections stay open)."""
        self._send("stop")
        self._expect("ok")

    def finish(self, timeout: float = 60.0) -> dict:
        """Stop, let the client wait for the server to drop its idle connections; its JSON summary."""
        self._send("exit")
        out, _ = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise RuntimeError(f"load client failed with exit code {self.proc.returncode}")
        return json.loads(out.strip().splitlines()[-1])

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main()
