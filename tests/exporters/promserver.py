"""Run the real ``prometheus`` binary (Debian package) for a test and query it over its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
from moetrace.exporters.spec import MetricSpec

from moetrace.reference import free_port

SCRAPE_INTERVAL_S = 0.5


def require_prometheus() -> str:
    """Path of the ``prometheus`` binary; skip without it, but fail in CI (``CI`` set)."""
    binary = shutil.which("prometheus")
    if binary:
        return binary
    message = "the prometheus binary is not installed (apt-get install prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; .ci/run installs it and CI must run this test")
    pytest.skip(f"{message}; CI requires it")


class Prometheus:
    """A Prometheus server on a free loopback port scraping ``targets`` every 0.5 s.

    ``targets`` maps a job name to ``host:port`` addresses of ``/metrics`` endpoints;
    ``rule_files`` are recording-rule files, evaluated at the same interval (``interval_s``).
    """

    def __init__(self, tmp: Path, targets: dict[str, list[str]], rule_files: Sequence[Path] = (),
                 interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self.binary = require_prometheus()
        self.dir = Path(tmp)
        self.port = free_port()
        interval = f"{int(interval_s * 1000)}ms"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "rule_files": [str(Path(f).resolve()) for f in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": addrs}]} for job, addrs in targets.items()],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = self.dir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after 60 s:\n{self.log.read_text()}")
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """Instant PromQL query: ``[(labels, value)]`` (``__name__``, ``job``, ``instance`` dropped)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        data = body["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [
            ({k: v for k, v in item["metric"].items() if k not in ("__name__", "job", "instance")}, float(item["value"][1]))
            for item in data["result"]
        ]

    def value(self, expr: str) -> float | None:
        """The single value of ``expr``, or ``None`` when it has no result yet."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return result[0][1] if result else None

    def wait_for(self, expr: str, expected: float, timeout: float = 30.0) -> None:
        """Poll until ``expr`` equals ``expected`` (a later scrape reached the value)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.value(expr)
            if last == expected:
                return
            time.sleep(SCRAPE_INTERVAL_S / 2)
        pytest.fail(f"{expr} stayed {last}, expected {expected} after {timeout} s:\n{self.log.read_text()[-2000:]}")

    def series(self, spec: MetricSpec, selector: str = "") -> dict[frozenset, float]:
        """Every series of ``spec`` as ``{frozenset(labels): value}``."""
        return {frozenset(labels.items()): value for labels, value in self.query(f"{spec.prom_name}{{{selector}}}")}
