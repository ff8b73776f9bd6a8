"""A deployment routed by the real ``sglang-router`` (PyPI, cache_aware) in front of 3 HTTP reference replicas.

Evidence is recorded from the replica side (what each replica served, its
cached tokens and times) and checked against the router's own Prometheus
metrics (requests per worker). Loopback only; skipped when sglang-router is
not installed (``pip install 'moetrace[router]'``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from moetrace.drivers.http_replica import record_response
from moetrace.drivers.live import run_unrouted
from moetrace.reference import free_port
from moetrace.replicas import ReplicaRecorder
from moetrace.trace.replica_requests import read_requests

from .test_live import _sessions

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install 'moetrace[router]')")
pytestmark = pytest.mark.slow


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            _get(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not come up")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang-router")
    ports = [free_port() for _ in range(3)]
    router_port, metrics_port = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "moetrace.drivers.http_replica", "--port", str(p), "--index", str(i)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, p in enumerate(ports)]
    router = None
    try:
        deadline = time.monotonic() + 120
        for p in ports:
            _wait(f"http://127.0.0.1:{p}/health", deadline)
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(router_port),
             "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports], "--policy", "cache_aware",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", "warn"],
            stdout=(out / "router.log").open("w"), stderr=subprocess.STDOUT)
        _wait(f"http://127.0.0.1:{metrics_port}/metrics", deadline)
        while time.monotonic() < deadline and "smg_worker_health" not in _get(f"http://127.0.0.1:{metrics_port}/metrics"):
            time.sleep(0.3)
        while time.monotonic() < deadline:  # the router answers once its workers are registered
            try:
                _post(f"http://127.0.0.1:{router_port}/generate", {"text": "1 2 3", "sampling_params": {"max_new_tokens": 1}, "rid": "warmup"}, 10)
                break
            except OSError:
                time.sleep(0.5)
        sessions = _sessions()
        rec = ReplicaRecorder(3, output_dir=out, block_size=16, engine="sglang-router")
        rec.start_record()
        outputs: dict[str, list[int]] = {}
        lock = threading.Lock()

        def one(session) -> None:
            history: list[int] = []
            for turn in range(len(session.turns)):
                prompt = [*history, *session.turns[turn]] if turn else [*session.system, *session.turns[0]]
                rid = f"{session.sid}-t{turn}"
                rec.on_arrival(rid, len(prompt), session=session.sid)
                answer = _post(f"http://127.0.0.1:{router_port}/generate",
                               {"text": " ".join(map(str, prompt)), "sampling_params": {"max_new_tokens": session.max_new_tokens}, "rid": rid})
                record_response(rec, rid, answer, session=session.sid)
                with lock:
                    outputs[rid] = answer["output_ids"]
                history = prompt + answer["output_ids"]

        threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        table = read_requests(rec.dump_record(out / "routed.h5"))
        rec.close()
        stats = [json.loads(_get(f"http://127.0.0.1:{p}/moetrace_stats")) for p in ports]
        metrics = _get(f"http://127.0.0.1:{metrics_port}/metrics")
        yield sessions, outputs, table, stats, metrics, ports
    finally:
        for proc in [*procs, router]:
            if proc is not None:
                proc.terminate()
        for proc in [*procs, router]:
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_replica_side_evidence_matches_the_routers_metrics(deployment):
    _, outputs, table, stats, metrics, ports = deployment
    q = table.requests
    assert len(table) == len(outputs) == 48 and (q["finished"] == 1).all()
    assert set(table.policies[p] for p in q["policy"]) == {"external"}
    # requests per worker: the router's own counter (warm-up request included) = what the replicas served
    per_worker = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r'smg_worker_cb_outcomes_total\{worker="http://127\.0\.0\.1:(\d+)",outcome="success"\} (\S+)', metrics)}
    served = [len(s) for s in stats]
    assert [per_worker.get(p, 0.0) for p in ports] == served
    recorded = np.bincount(q["replica"], minlength=3)
    assert (served - recorded).tolist() in ([1, 0, 0], [0, 1, 0], [0, 0, 1])  # the warm-up request is not recorded
    for i, rid in enumerate(q["id"]):
        mine = stats[q["replica"][i]][rid]
        assert q["cached_tokens"][i] == mine["cached_tokens"]
        assert q["ttft"][i] == pytest.approx(mine["first_token"] - q["arrival"][i], abs=1e-9)
    # cache_aware on the text of token ids keeps sessions on the replica holding their prefix
    assert q["cached_tokens"].sum() > 0.3 * q["input_tokens"].sum()


def test_outputs_equal_unrouted(deployment):
    sessions, outputs, *_ = deployment
    assert outputs == run_unrouted(sessions)
