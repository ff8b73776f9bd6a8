"""``moetrace placement`` deploys what its own held-out estimate says wins on this trace."""

from __future__ import annotations

import json

import numpy as np
from moetrace.cli.app import app
from moetrace.cli.placement import command
from typer.testing import CliRunner

from moetrace.placement.eplb import greedy_rebalance
from moetrace.trace import open_trace

from ..analysis.helpers import record


def _trace(tmp_path):
    rng = np.random.default_rng(9)
    return record(tmp_path, "per_pass", [rng.integers(0, 8, size=(32, 2, 2)) for _ in range(10)], num_experts=8, ep_size=2)


def test_eplbs_plan_is_deployed_when_the_estimate_has_it_ahead(tmp_path, monkeypatch):
    trace = _trace(tmp_path)
    real = command.held_out_estimate

    def greedy_ahead(series, config, **kwargs):
        result = real(series, config, **kwargs)
        result.realized["greedy"] = result.realized["moetrace"] + 0.01  # planted: EPLB's plan realised more on this trace
        return result

    monkeypatch.setattr(command, "held_out_estimate", greedy_ahead)
    result = CliRunner().invoke(app, ["placement", str(trace), "--gpus", "2", "--slots", "10", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["planner"] == "greedy" and document["preferred_by_estimate"] == "greedy"
    assert "greedy (EPLB's plan) ahead" in document["preferred_reason"]
    with open_trace(trace) as tr:  # the deployed plan is EPLB's on the planned loads (every pass of the trace)
        loads = tr.logical_count().astype(np.float64)
    np.testing.assert_array_equal(document["phy2log"], greedy_rebalance(loads, 10, 1, 1, 2))


def test_the_validated_plan_stays_when_the_estimate_does_not_prefer_eplb(tmp_path):
    trace = _trace(tmp_path)
    result = CliRunner().invoke(app, ["placement", str(trace), "--gpus", "2", "--slots", "10", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    realized = document["held_out_estimate"]["summary"]
    assert document["preferred_by_estimate"] == ("moetrace" if realized["moetrace"]["mean"] >= realized["greedy"]["mean"] else "greedy")
    assert ("preferred_reason" in document) == (document["preferred_by_estimate"] == "greedy")
