"""Bad input gets one clear error: malformed trace lines (named), unknown policy, zero replicas, duplicate ids."""

from __future__ import annotations

import json

import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.replicas import ReplicaRecorder, ReplicaStateError
from moetrace.replicas.router import ReplicaRouter
from moetrace.replicas.workload import TraceFormatError, load_trace

runner = CliRunner()
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def _write(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ({**GOOD, "timestamp": -1}, "line 2: 'timestamp'"),
        ({k: v for k, v in GOOD.items() if k != "input_length"}, "line 2: missing field 'input_length'"),
        ({**GOOD, "hash_ids": [1]}, "line 2: 1 hash_ids for input_length 600"),
        ({**GOOD, "hash_ids": [1, "x"]}, "line 2: 'hash_ids' must be a list of integers"),
    ],
)
def test_malformed_line_is_named(tmp_path, bad, message):
    path = _write(tmp_path / "t.jsonl", [GOOD, bad])
    with pytest.raises(TraceFormatError, match=message):
        load_trace(path)
    result = runner.invoke(app, ["replicas", "replay", str(path), "--replicas", "2"])
    assert result.exit_code == 2
    assert message.split(":")[0] in result.output and "Traceback" not in result.output


def test_duplicate_request_ids(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{**GOOD, "request_id": "a"}, {**GOOD, "request_id": "b"}, {**GOOD, "request_id": "a"}])
    with pytest.raises(TraceFormatError, match=r"line 3: duplicate request_id 'a' \(first on line 1\)"):
        load_trace(path)
    result = runner.invoke(app, ["replicas", "compare", str(path), "--replicas", "2"])
    assert result.exit_code == 2 and "duplicate request_id" in result.output
    rec = ReplicaRecorder(1, output_dir=tmp_path)
    rec.start_record()
    rec.on_arrival("x", 10)
    with pytest.raises(ReplicaStateError, match="arrived twice"):
        rec.on_arrival("x", 10)
    rec.close()


def test_unknown_policy_and_zero_replicas(tmp_path):
    path = _write(tmp_path / "t.jsonl", [GOOD])
    with pytest.raises(ValueError, match="unknown router policy 'fastest'; choose one of"):
        ReplicaRouter(2, "fastest", block_size=512)
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaRouter(0, "random", block_size=512)
    result = runner.invoke(app, ["replicas", "replay", str(path), "--policy", "fastest"])
    assert result.exit_code == 2 and "unknown policy" in result.output and "round_robin" in result.output
    result = runner.invoke(app, ["replicas", "replay", str(path), "--replicas", "0"])
    assert result.exit_code == 2 and "at least one replica" in result.output


def test_missing_and_empty_trace(tmp_path):
    result = runner.invoke(app, ["replicas", "replay", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "no such request trace file" in result.output
    with pytest.raises(TraceFormatError, match="holds no requests"):
        load_trace(_write(tmp_path / "e.jsonl", [""]))
