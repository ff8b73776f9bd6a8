"""``moetrace replicas replay/compare/why/calibrate`` and ``moetrace analyze`` on a replica trace."""

from __future__ import annotations

import json

import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.replicas.router import CostModel
from moetrace.trace.replica_requests import read_requests

runner = CliRunner()
SLICE = ["--limit", "600", "--replicas", "4", "--utilization", "0.8"]


@pytest.fixture(scope="module")
def routing_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "routing.h5"
    result = runner.invoke(app, ["replicas", "replay", "mooncake", "--policy", "constrained_locality", "--out", str(out),
                                 "--plot-load", str(out.with_suffix(".png")), *SLICE])
    assert result.exit_code == 0, result.output
    assert "constrained_locality" in result.output and f"replica trace: {out}" in result.output
    return out


def test_replay_writes_a_routing_trace(routing_trace):
    table = read_requests(routing_trace)
    assert len(table) == 600 and table.clock == "simulated" and table.num_replicas == 4 and table.block_size == 512
    assert routing_trace.with_suffix(".png").stat().st_size > 1000
    lines = runner.invoke(app, ["replicas", "replay", "mooncake", "--policy", "random", *SLICE]).output.splitlines()
    assert max(len(line) for line in lines) <= 80


def test_analyze_prints_the_same_evidence_as_replay(routing_trace):
    result = runner.invoke(app, ["analyze", str(routing_trace), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    replay = json.loads(runner.invoke(app, ["replicas", "replay", "mooncake", "--policy", "constrained_locality", "--json", *SLICE]).output)["summary"]
    assert summary == replay
    text = runner.invoke(app, ["analyze", str(routing_trace)]).output
    assert "replica trace, 600 requests" in text and "min_est_ttft" in text


def test_why(routing_trace):
    table = read_requests(routing_trace)
    rid = table.requests["id"][table.requests["cached_tokens"] > 0][0]
    result = runner.invoke(app, ["replicas", "why", str(routing_trace), rid])
    assert result.exit_code == 0, result.output
    assert f"request {rid} -> replica" in result.output and "reason=min_est_ttft" in result.output and "smallest estimated TTFT" in result.output
    assert len([line for line in result.output.splitlines() if line.strip()[:1] in "*0123456789"]) >= 4
    assert max(len(line) for line in result.output.splitlines()) <= 80
    answer = json.loads(runner.invoke(app, ["replicas", "why", str(routing_trace), rid, "--json"]).output)
    chosen = answer["request"]["replica"]
    assert min(answer["candidates"], key=lambda c: (c["est_ttft"], c["replica"]))["replica"] == chosen
    missing = runner.invoke(app, ["replicas", "why", str(routing_trace), "no-such-request"])
    assert missing.exit_code == 2 and "not in this trace" in missing.output


def test_compare(tmp_path):
    png = tmp_path / "ttft.png"
    result = runner.invoke(app, ["replicas", "compare", "mooncake", "--json", "--plot-ttft", str(png), *SLICE])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows = {r["policy"]: r for r in data["policies"]}
    assert set(rows) == {"round_robin", "random", "shortest_queue", "cache_aware", "session_sticky", "constrained_locality", "kv_cost"}
    for r in rows.values():
        assert r["block_hit_rate"] <= data["upper_bound_block_hit_rate"]
        assert r["finished"] == 600 and r["ttft_p50"] <= r["ttft_p95"] <= r["ttft_p99"]
    assert png.stat().st_size > 1000
    text = runner.invoke(app, ["replicas", "compare", "mooncake", "--policies", "random,kv_cost", *SLICE]).output
    assert max(len(line) for line in text.splitlines()) <= 80 and "unlimited-cache bound" in text


def test_cost_model_file(tmp_path):
    bad = tmp_path / "cost.json"
    bad.write_text("{oops")
    result = runner.invoke(app, ["replicas", "replay", "mooncake", "--cost-model", str(bad), *SLICE])
    assert result.exit_code == 2 and "not JSON" in result.output
    bad.write_text(json.dumps({"prefill_per_token": -1}))
    result = runner.invoke(app, ["replicas", "replay", "mooncake", "--cost-model", str(bad), *SLICE])
    assert result.exit_code == 2 and "prefill_per_token must be" in result.output


def test_calibrate_writes_a_cost_model_replay_accepts(tmp_path):
    path = tmp_path / "cost.json"
    result = runner.invoke(app, ["replicas", "calibrate", "--out", str(path)])
    assert result.exit_code == 0, result.output
    cost = json.loads(path.read_text())
    # The fitted times depend on the machine's load (a busy machine can fit a slope of 0): only the model's
    # shape is checked here, every field present and valid; what calibration measures is a benchmark's job.
    assert CostModel.from_dict(cost).to_dict() == cost and cost["max_batch"] == 8
    result = runner.invoke(app, ["replicas", "replay", "mooncake", "--cost-model", str(path), "--json", "--limit", "200", "--replicas", "2"])
    assert result.exit_code == 0 and json.loads(result.output)["cost_model"] == cost


def test_sessions_stick_and_migrate(tmp_path):
    """A trace with session ids: session_sticky keeps turns on the owner until its load passes --migrate-threshold."""
    lines = []
    for i in range(40):  # 2 sessions, a burst of turns 2 ms apart, each prompt = the previous one + 4 new blocks
        session = i % 2
        blocks = [1000 * session + b for b in range(4 * (1 + i // 2))]
        lines.append({"timestamp": 2 * i, "input_length": 512 * len(blocks), "output_length": 4, "hash_ids": blocks,
                      "request_id": f"q{i}", "session_id": f"s{session}"})
    trace = tmp_path / "sessions.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    base = ["replicas", "replay", str(trace), "--replicas", "3", "--policy", "session_sticky", "--json"]
    sticky = json.loads(runner.invoke(app, [*base, "--out", str(tmp_path / "sticky.h5")]).output)["summary"]
    assert sticky["migrations"] == 0 and sticky["reasons"] == {"session_owner": 38, "new_session": 2}
    moved = json.loads(runner.invoke(app, [*base, "--migrate-threshold", "1", "--out", str(tmp_path / "moved.h5")]).output)["summary"]
    assert moved["migrations"] > 0 and moved["reasons"]["session_migrated"] == moved["migrations"]
    table = read_requests(tmp_path / "moved.h5")
    rid = table.requests["id"][table.requests["reason"] == table.reasons.index("session_migrated")][0]
    text = runner.invoke(app, ["replicas", "why", str(tmp_path / "moved.h5"), rid]).output
    assert "reason=session_migrated" in text and "yes" in text  # the owner is marked among the candidates


def test_replay_and_compare_take_one_definition_of_each_shared_option():
    """The 14 options ``replay`` and ``compare`` share are one definition each (``_SHARED_OPTIONS``): the same flags,
    defaults and help in both commands, and the fields of ``ReplaySettings``; each command's own options stay its own."""
    import dataclasses

    from moetrace.cli.replicas import _SHARED_OPTIONS, ReplaySettings, replicas_app
    from typer.main import get_command

    commands = get_command(replicas_app).commands  # type: ignore[attr-defined]
    params = {name: {p.name: p for p in commands[name].params} for name in ("replay", "compare")}
    shared = [param.name for param in _SHARED_OPTIONS]
    assert len(shared) == 14 and [f.name for f in dataclasses.fields(ReplaySettings)] == shared
    for name in shared:
        replay, compare = params["replay"][name], params["compare"][name]
        assert (replay.opts, replay.default, getattr(replay, "help", None)) == (compare.opts, compare.default, getattr(compare, "help", None))
    # Negative control: what only one command takes is not shared.
    assert {"policy", "out", "plot_load"} <= set(params["replay"]) - set(params["compare"])
    assert {"policies", "plot_ttft"} <= set(params["compare"]) - set(params["replay"])
