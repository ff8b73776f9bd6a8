"""`moetrace demo` end to end with small settings: every output file is valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.demo import DemoSettings, run_demo
from rich.console import Console

from moetrace.trace import open_trace

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_outputs(out: Path, ranks: int, layers: int, experts: int) -> dict:
    with open_trace(out / "trace.h5") as trace:
        assert trace.mode == "per_token" and trace.attrs["world_size"] == ranks and trace.attrs["rank"] == -1
        assert trace.num_layers == layers and trace.num_physical_experts == experts
        np.testing.assert_array_equal(trace.layers, np.arange(1, layers + 1))  # dense layer 0 leaves a gap
        counts = trace.physical_count()
        tokens = trace.num_rows("tokens/topk_ids")
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["tokens"] == tokens
    assert 0 < report["overall"]["balancedness"] <= 1
    assert report["demo"]["bytes"]["ep_ideal"] > 0
    assert report["demo"]["placement"]["balancedness_after"] >= report["demo"]["placement"]["balancedness_before"] - 1e-9
    held = report["demo"]["placement"]["held_out"]  # plan on earlier passes, score on later ones
    assert held is None or 0 < held["moetrace"]["min"] <= held["moetrace"]["mean"] <= held["moetrace"]["max"] <= 1
    png = (out / "heatmap.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    placement = json.loads((out / "placement.json").read_text())
    assert np.asarray(placement["phy2log"]).shape == (layers, experts + ranks)
    assert counts.sum() > 0
    return report


def test_demo_small_end_to_end(tmp_path, capsys):
    settings = DemoSettings(ranks=2, requests=10, layers=2, experts=4, top_k=2, skew=1.0, out=tmp_path / "demo", slow_rank=1, slow_ms=10)
    console = Console(width=80, force_terminal=False)  # an 80-column terminal
    summary = run_demo(settings, console)
    assert summary["served"] == 10 and not summary["interrupted"]
    report = check_outputs(tmp_path / "demo", ranks=2, layers=2, experts=4)
    assert report["totals"]["assignments"] == 2 * report["totals"]["tokens"] * 2  # 2 layers x top-2
    assert report["timing"]["passes"] > 0 and report["timing"]["slowest_rank_share"][1] >= 0.9
    timeline = json.loads((tmp_path / "demo" / "timeline.json").read_text())
    assert summary["timeline"] == tmp_path / "demo" / "timeline.json"
    assert {e["pid"] for e in timeline["traceEvents"]} == {0, 1} and any(e["ph"] == "X" for e in timeline["traceEvents"])
    printed = capsys.readouterr().out
    for needle in ("Phase time per layer-pass", "slowest rank (expert compute): rank 1", "timeline.json","Prometheus http://127.0.0.1:", "control http://127.0.0.1:", "balancedness", "All-to-all bytes", "routed experts", "placement plan", "in-sample fit", "held-out estimate (planned on"):
        assert needle in printed
    wide = [line for line in printed.splitlines() if len(line) > 80]
    assert not wide, "lines wider than 80 columns:\n" + "\n".join(wide)


def test_demo_ctrl_c_keeps_a_valid_trace(tmp_path):
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "moetrace.cli", "demo", "--requests", "400", "--layers", "2", "--experts", "4", "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if sum("Prometheus http" in x for x in lines) == 2:  # both ranks are serving
            time.sleep(2.0)
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
            break
        assert time.monotonic() < deadline, "".join(lines)
    rest, _ = proc.communicate(timeout=240)
    text = "".join(lines) + rest
    assert proc.returncode == 0, text
    assert "interrupted" in text
    report = check_outputs(out, ranks=2, layers=2, experts=4)
    assert report["demo"]["interrupted"] is True
    assert report["totals"]["passes"] > 0
