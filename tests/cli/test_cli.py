"""Every command through typer's CliRunner: 0 on success, 2 on bad usage/input with one stderr line."""

from __future__ import annotations

import json
import shutil
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import h5py
import numpy as np
import pytest
from moetrace.cli import reference
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.control import serve_control
from moetrace.trace import open_trace

from ..analysis.helpers import olmoe, random_passes, record, write_stat_trace

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_bad_input(result, fragment: str = "") -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrace: error: "), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("traces")
    rng = np.random.default_rng(11)
    passes = random_passes(rng, num_passes=24, num_layers=3, num_experts=16, top_k=4)
    token = record(tmp, "per_token", passes, num_experts=16, ep_size=4, layer_ids=(1, 4, 7))
    data = olmoe()
    stat = write_stat_trace(tmp / "olmoe.h5", np.asarray(data["expert_counts"]["c4"]), 8, 8, data["layers"], model="OLMoE-1B-7B")
    return {"token": token, "stat": stat, "dir": tmp}


@pytest.fixture(scope="module")
def bad_files(traces):
    tmp = traces["dir"]
    text = tmp / "notes.h5"
    text.write_text("not hdf5")
    truncated = tmp / "truncated.h5"
    raw = traces["token"].read_bytes()
    truncated.write_bytes(raw[: len(raw) // 2])
    newer = tmp / "newer.h5"
    shutil.copy(traces["stat"], newer)
    with h5py.File(newer, "r+") as f:
        f.attrs["schema_version"] = 99
    foreign = tmp / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.zeros(3)
    return {"missing": (tmp / "nope.h5", "no such"), "text": (text, "not an HDF5 file"), "truncated": (truncated, "truncated"), "newer": (newer, "newer than this moetrace"), "foreign": (foreign, "not a moetrace trace")}


def png_size(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR" and raw[-8:-4] == b"IEND"
    return struct.unpack(">II", raw[16:24])


# ------------------------------------------------------------------------- analyze
def test_analyze_table_and_json(traces):
    result = invoke("analyze", traces["token"], "--window", "6", "--no-progress")
    assert result.exit_code == 0, result.stderr
    for text in ("balancedness", "Per layer", "Per EP rank", "Co-activation", "Cross-layer transitions", "drift: 4 windows"):
        assert text in result.stdout
    result = invoke("analyze", traces["stat"], "--json", "--layers", "0,15", "--top", "3")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == "moetrace.analysis" and doc["layers"] == [0, 15]
    assert len(doc["per_layer"][0]["hottest"]) == 3 and doc["coactivation"] is None
    assert result.stderr == ""


def test_progress_bar_goes_to_stderr(traces):
    result = invoke("analyze", traces["token"], "--json", "--progress")
    assert result.exit_code == 0, result.stderr
    assert "analyzing" in result.stderr and "tokens" in result.stderr
    json.loads(result.stdout)  # stdout stays clean JSON
    quiet = invoke("analyze", traces["token"], "--json")  # not a terminal: no bar by default
    assert quiet.stderr == ""


@pytest.mark.parametrize("command", ["analyze", "plot", "placement", "inspect"])
@pytest.mark.parametrize("kind", ["missing", "text", "truncated", "newer", "foreign"])
def test_bad_trace_inputs(tmp_path, bad_files, command, kind):
    path, fragment = bad_files[kind]
    extra = {"plot": ["-o", tmp_path / "x.png"], "placement": ["--slots", "8", "--groups", "1", "--nodes", "1", "--gpus", "1"]}.get(command, [])
    assert_bad_input(invoke(command, path, *extra), fragment)


def test_bad_usage_and_options(traces, tmp_path):
    result = invoke("analyze", traces["token"], "--no-such-option")
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert invoke("analyze").exit_code == 2
    assert_bad_input(invoke("analyze", traces["token"], "--layers", "2"), "not MoE layers")
    assert_bad_input(invoke("analyze", traces["token"], "--layers", "a-b"), "--layers")
    assert_bad_input(invoke("plot", traces["token"], "-o", tmp_path / "x.png", "--kind", "pie"), "--kind")
    assert_bad_input(invoke("plot", traces["token"], "-o", tmp_path / "no" / "x.png"), "does not exist")
    assert_bad_input(invoke("plot", traces["stat"], "-o", tmp_path / "c.png", "--kind", "coactivation"), "per_token")


# ------------------------------------------------------------------------- plot
@pytest.mark.parametrize("kind", ["heatmap", "ranks", "timeline", "coactivation"])
def test_plot_writes_png(traces, tmp_path, kind):
    out = tmp_path / f"{kind}.png"
    result = invoke("plot", traces["token"], "-o", out, "--kind", kind, "--window", "4", "--layer", "4", "--no-progress")
    assert result.exit_code == 0, result.stderr
    width, height = png_size(out)
    assert (width, height) == {"ranks": (1000, 700), "coactivation": (800, 700)}.get(kind, (1000, 600))
    assert out.stat().st_size > 10_000  # a drawn figure, not an empty canvas


# ------------------------------------------------------------------------- placement
def test_placement_prints_and_writes_plan(traces, tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("placement", traces["stat"], "--slots", "72", "--groups", "8", "--nodes", "2", "--gpus", "8", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert "hierarchical" in result.stdout and "greedy" in result.stdout
    plan = json.loads(out.read_text())
    assert np.asarray(plan["phy2log"]).shape == (3, 72)
    assert np.asarray(plan["logcnt"]).sum(axis=1).tolist() == [72, 72, 72]
    log2phy = np.asarray(plan["log2phy"])
    assert log2phy.shape[:2] == (3, 64) and (log2phy >= -1).all()
    b = plan["in_sample"]["balancedness"]  # a stat trace: planned and scored on its totals (a fit)
    assert b["moetrace"] >= b["greedy"] - 1e-12 and b["moetrace"] > b["current"]
    assert plan["held_out_estimate"] is None and "a fit, not a forecast" in result.stdout
    assert_bad_input(invoke("placement", traces["stat"], "--slots", "60", "--groups", "8", "--nodes", "2", "--gpus", "8"), "smaller than the 64 experts")
    assert_bad_input(invoke("placement", traces["stat"], "--slots", "72", "--groups", "8", "--nodes", "3", "--gpus", "8"), "not divisible by nodes=3")


# ------------------------------------------------------------------------- convert / merge / inspect
def test_convert_merge_inspect(traces, tmp_path):
    log = tmp_path / "routing.jsonl"
    log.write_text("".join(json.dumps({"layer": layer, "topk_ids": [t % 4, (t + 1) % 4], "pass_id": t // 3, "position": t % 3}) + "\n" for t in range(9) for layer in (0, 2)))
    result = invoke("convert", log, "-o", tmp_path / "log.h5")
    assert result.exit_code == 0, result.stderr
    with open_trace(tmp_path / "log.h5") as trace:
        assert trace.num_rows("tokens/topk_ids") == 9 and list(trace.layers) == [0, 2]
    assert_bad_input(invoke("convert", tmp_path / "none.jsonl", "-o", tmp_path / "o.h5"), "no such")
    counts = np.arange(16).reshape(2, 8)
    ranks = [write_stat_trace(tmp_path / f"r{r}.h5", counts, 2, 2, [0, 1], run_id="same", rank=r, world_size=2) for r in range(2)]
    result = invoke("merge", *ranks, "-o", tmp_path / "merged.h5")
    assert result.exit_code == 0, result.stderr
    other = write_stat_trace(tmp_path / "other.h5", counts, 2, 2, [0, 1], run_id="else", rank=1, world_size=2)
    assert_bad_input(invoke("merge", ranks[0], other, "-o", tmp_path / "bad.h5"), "different runs")
    result = invoke("inspect", tmp_path / "merged.h5", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["attrs"]["rank"] == -1 and doc["attrs"]["world_size"] == 2
    shapes = {d["name"]: d["shape"] for d in doc["datasets"]}
    assert shapes["/stat/physical_count"] == [2, 2, 8]
    result = invoke("inspect", traces["token"])
    assert result.exit_code == 0 and "/tokens/topk_ids" in result.stdout


# ------------------------------------------------------------------------- control
def test_control_commands_against_moetrace_endpoint(tmp_path):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, output_dir=tmp_path))
    server = serve_control(rec, token="s3cret")
    try:
        url = server.url
        base = ["--url", url, "--token", "s3cret"]
        result = invoke("start", *base)
        assert result.exit_code == 0 and "recording started" in result.stdout, result.stderr
        assert rec.recording
        result = invoke("status", *base)
        assert result.exit_code == 0 and json.loads(result.stdout)["recording"] is True
        result = invoke("start", *base)  # 409: already recording
        assert result.exit_code == 1 and "409" in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert invoke("stop", *base).exit_code == 0 and not rec.recording
        result = invoke("dump", *base, "--name", "cli.h5")
        assert result.exit_code == 0, result.stderr
        assert Path(result.stdout.strip()) == tmp_path / "cli.h5" and (tmp_path / "cli.h5").exists()
        result = invoke("status", "--url", url, "--token", "wrong")
        assert result.exit_code == 1 and "401" in result.stderr
        assert_bad_input(invoke("status", "--url", "ftp://x"), "--url")
    finally:
        server.close()
    result = invoke("status", "--url", url, "--token", "s3cret", "--timeout", "2")
    assert result.exit_code == 1 and "cannot reach" in result.stderr


class FakeSGLang(BaseHTTPRequestHandler):
    """A stand-in for SGLang's HTTP server (its three expert-distribution routes and /server_info)."""

    calls: ClassVar[list[tuple[str, str, str | None]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        FakeSGLang.calls.append(("POST", self.path, self.headers.get("Authorization")))
        if self.path.endswith("_expert_distribution_record"):
            self._reply(200, b"Dump expert distribution record.\n", "text/plain")
        else:
            self._reply(404, b'{"detail":"Not Found"}', "application/json")

    def do_GET(self) -> None:
        FakeSGLang.calls.append(("GET", self.path, self.headers.get("Authorization")))
        if self.path == "/server_info":
            self._reply(200, json.dumps({"expert_distribution_recorder_mode": "stat", "ep_size": 8}).encode(), "application/json")
        else:
            self._reply(404, b'{"detail":"Not Found"}', "application/json")


def test_control_commands_sglang_mode():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeSGLang.calls = []
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for command in ("start", "stop", "dump"):
            result = invoke(command, "--url", url, "--sglang", "--token", "k")
            assert result.exit_code == 0, result.stderr
        result = invoke("status", "--url", url, "--sglang")
        assert result.exit_code == 0 and json.loads(result.stdout)["expert_distribution_recorder_mode"] == "stat"
        assert_bad_input(invoke("dump", "--url", url, "--sglang", "--name", "x.h5"), "--name")
    finally:
        server.shutdown()
        server.server_close()
    assert FakeSGLang.calls[:3] == [
        ("POST", "/start_expert_distribution_record", "Bearer k"),
        ("POST", "/stop_expert_distribution_record", "Bearer k"),
        ("POST", "/dump_expert_distribution_record", "Bearer k"),
    ]


# ------------------------------------------------------------------------- docs
def test_docs_cli_reference_is_current():
    document = DOCS.read_text()
    assert reference.splice(document, reference.render()) == document, "docs/cli.md is stale: run python -m moetrace.cli.reference"
