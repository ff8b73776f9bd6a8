"""`moetrace demo` end to end with small settings: every output file is valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.demo import DemoSettings, planned_tokens, run_demo
from rich.console import Console

from moetrace import PHASES
from moetrace.report.evidence import gather_evidence
from moetrace.report.sections import build_sections
from moetrace.trace import open_trace

from ..report.browser import available, browser, check_page, choose_request, open_report
from ..servers import default_sigint

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
    # Which rank is slowest on the machine's clock is the scheduler's business (printed): the summary must
    # name the rank the report finds slowest, and rank 1's expert phase must hold its sleeps in every pass.
    timing = report["timing"]
    with open_trace(tmp_path / "demo" / "trace.h5") as trace:
        rows = trace.timing_rows()
    rank1 = np.nansum(rows["phase"][rows["rank"] == 1][:, :, PHASES.index("expert")], axis=1)  # [passes] seconds
    assert timing["passes"] > 0 and len(rank1) > 0 and (rank1 >= 2 * settings.slow_ms / 1e3).all()  # 2 layers x slow_ms
    named = int(np.argmax(timing["slowest_rank_share"]))
    timeline = json.loads((tmp_path / "demo" / "timeline.json").read_text())
    assert summary["timeline"] == tmp_path / "demo" / "timeline.json"
    assert {e["pid"] for e in timeline["traceEvents"]} == {0, 1} and any(e["ph"] == "X" for e in timeline["traceEvents"])
    printed = capsys.readouterr().out
    print(f"rank 1 slowest in {timing['slowest_rank_share'][1]:.0%} of passes (machine's clock)")  # after the capture: not the demo's
    words = " ".join(printed.split())  # prose wraps at word boundaries
    slowest = f"slowest rank (expert compute): rank {timing['rank_labels'][named]} in {100 * timing['slowest_rank_share'][named]:.0f}% of"
    for needle in (slowest, "timeline.json", "Prometheus http://127.0.0.1:", "control http://127.0.0.1:",
                   "balancedness", "all-to-all: EP exact sent", "routed experts", "placement: plan", "in-sample (planned and scored on this run)",
                   "held-out (planned on", "report.html", "trace.h5"):
        assert needle in words, needle
    # Issue 52: the bar counts tokens computed (it moves from the first pass, not the first finished request),
    # and its total is what the ranks computed: the trace's token rows, counted independently.
    with open_trace(tmp_path / "demo" / "trace.h5") as trace:
        rows = trace.num_rows("tokens/topk_ids")
    assert planned_tokens(settings) == rows == report["totals"]["tokens"]
    assert f"{rows:,}/{rows:,} tokens 10/10 served" in words and "starting 2 rank processes: torch, gloo, the model, the recorder" in words
    assert "(positions x model layers x k; L0 dense: no experts, -1)" in words and "a dense layer, then 2 MoE layers x 4 experts" in words
    lines = printed.splitlines()
    wide = [line for line in lines if len(line) > 80]
    assert not wide, "lines wider than 80 columns:\n" + "\n".join(wide)
    assert len(lines) <= 42, f"{len(lines)} lines: the summary must fit one screen\n{printed}"
    _check_report(tmp_path / "demo", summary)


def _check_report(out: Path, summary: dict) -> None:
    """report.html in a real browser; the per-rank files of the run give the same readings as the merged trace."""
    assert summary["html"] == out / "report.html" and summary["routes"] == out / "routes.json"
    assert available() is None, available()  # .ci/run installs Chromium: missing is an error, not a skip
    with browser() as driver:
        check_page(open_report(driver, out / "report.html"), ["headline", "experts", "ranks", "timing", "placement", "routes", "coactivation"])
        before, after = choose_request(driver, 1)
        assert before["z"] != after["z"]
    merged = build_sections(gather_evidence([out / "trace.h5"]))
    per_rank = build_sections(gather_evidence(sorted((out / "ranks").glob("trace-rank*.h5"))))
    assert [(s.key, s.reading) for s in per_rank] == [(s.key, s.reading) for s in merged]


def test_demo_ctrl_c_keeps_a_valid_trace(tmp_path):
    """Ctrl-C once a rank has recorded passes, with far more requests left than any machine serves
    meanwhile (with 400, an idle machine once served them all before a loaded one delivered the
    signal): the run stops, exits 0 and keeps a valid trace of what it served."""
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "moetrace.cli", "demo", "--requests", "100000", "--moe-layers", "2", "--experts", "4", "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=default_sigint)
    lines = []
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "control http" in line:  # a rank's control endpoint: Ctrl-C once it has recorded a pass
            status = line.split("control ", 1)[1].strip()
            while json.loads(urllib.request.urlopen(status, timeout=30).read())["passes"] == 0:
                assert time.monotonic() < deadline, "no pass recorded in 240 s"
                time.sleep(0.2)
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
