"""``moetrace timeline``: the Chrome trace-event JSON parses, has the required fields, nests per track
and its pass windows match the trace (on the shared 2-rank gloo run)."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import PHASES
from moetrace.trace.reader import open_trace

REQUIRED = {"X": ("name", "ph", "ts", "dur", "pid", "tid", "args"), "C": ("name", "ph", "ts", "pid", "args"), "M": ("name", "ph", "pid", "args")}


def _validate(document: dict) -> dict[tuple[int, int], list[dict]]:
    """Check fields and nesting; returns the X events by track."""
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in document["traceEvents"]:
        for field in REQUIRED[event["ph"]]:
            assert field in event, (field, event)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0
            tracks[(event["pid"], event["tid"])].append(event)
        if event["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in event["args"].values())
    for events in tracks.values():
        stack: list[float] = []  # end times of the open enclosing events
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            end = event["ts"] + event["dur"]
            while stack and event["ts"] >= stack[-1] - 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, f"events overlap on one track: {event}"
            stack.append(end)
    return tracks


def test_timeline_validates_and_matches_the_trace(ep_run, tmp_path):
    out, _ = ep_run
    trace_path, target = out / "exact-timed.h5", tmp_path / "timeline.json"
    result = CliRunner().invoke(app, ["timeline", str(trace_path), "-o", str(target), "--passes", "2:7"])
    assert result.exit_code == 0, result.output
    document = json.loads(target.read_text())
    tracks = _validate(document)
    names = {(e["pid"], e["args"]["name"]) for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert set(PHASES) <= threads
    with open_trace(trace_path) as trace:
        rows = trace.timing_rows()
        layers = list(trace.layers)
    epoch = document["otherData"]["epoch_unix"]
    steps = [e for e in document["traceEvents"] if e.get("cat") == "step"]
    assert sorted({e["args"]["pass"] for e in steps}) == [2, 3, 4, 5, 6]
    for step in steps:  # pass windows match the trace's rows, on one clock for both ranks
        row = np.flatnonzero((rows["pass_id"] == step["args"]["pass"]) & (rows["rank"] == step["pid"]))[0]
        assert step["ts"] == pytest.approx((rows["start_unix"][row] - epoch) * 1e6, abs=1.0)
        assert step["dur"] == pytest.approx(rows["step"][row] * 1e6, rel=1e-9)
        inside = [e for (pid, _), events in tracks.items() if pid == step["pid"] for e in events
                  if e["args"]["pass"] == step["args"]["pass"] and e is not step]
        assert len(inside) == len(layers) * (1 + len(PHASES))
        for event in inside:
            assert step["ts"] - 1e-3 <= event["ts"] and event["ts"] + event["dur"] <= step["ts"] + step["dur"] + 1e-3
            assert event["args"]["layer"] in layers and event["args"]["tokens"] >= 0
    # Both ranks' windows of one pass overlap: their clocks line up.
    for p in range(2, 7):
        a, b = (next(e for e in steps if e["args"]["pass"] == p and e["pid"] == r) for r in (0, 1))
        assert a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
    counters = [e for e in document["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == 2 * 5


def test_timeline_errors_are_clear(ep_run, tmp_path):
    out, _ = ep_run
    runner = CliRunner()
    bad = runner.invoke(app, ["timeline", str(out / "exact-timed.h5"), "-o", str(tmp_path / "t.json"), "--passes", "5-9"])
    assert bad.exit_code == 2 and "expected A:B" in bad.output
    untimed = runner.invoke(app, ["timeline", str(out / "exact-plain.h5"), "-o", str(tmp_path / "t.json")])
    assert untimed.exit_code == 2 and "timing=True" in untimed.output
    empty = runner.invoke(app, ["timeline", str(out / "exact-timed.h5"), "-o", str(tmp_path / "t.json"), "--passes", "500:"])
    assert empty.exit_code == 2 and "widen --passes" in empty.output
    assert not (tmp_path / "t.json").exists()
