"""``moetrace placement --current``: a replan is recommended only when the MoE time it saves exceeds its weight copies' stall.

The deployed plan is a contiguous placement (expert ``e`` on slot ``e``) and
the trace is real OLMoE skew under drift, so a replan gains a lot of balance
for a bounded number of copies. The figures are checked against the cost
model's formula computed here from the trace's counts, not from the code.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from moetrace.cli.app import app
from moetrace.cli.placement import command
from typer.testing import CliRunner

from moetrace.reference.domain_drift import DriftSpec, drift_routes

from .test_backtest import record_routes

GPUS, EXPERTS, HIDDEN, INTERMEDIATE = 8, 64, 32, 128
EXPERT_BYTES = 3 * HIDDEN * INTERMEDIATE * 2  # gate, up, down in bf16

runner = CliRunner()


@pytest.fixture(scope="module")
def drifted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replan")
    passes, _, _ = drift_routes(DriftSpec(num_passes=120, tokens_per_pass=64, seed=5))
    counts = np.stack([np.stack([np.bincount(p[:, layer].ravel(), minlength=EXPERTS) for layer in range(3)]) for p in passes])  # [P, 3, E]
    deployed = tmp / "contiguous.json"
    deployed.write_text(json.dumps({"phy2log": [list(range(EXPERTS))] * 3}))
    return {"trace": record_routes(tmp / "pass.h5", "per_pass", passes), "counts": counts, "deployed": deployed, "tmp": tmp}


def replan(drifted, *args: object, out: str = "plan.json") -> tuple[dict, np.ndarray]:
    path = drifted["tmp"] / out
    result = runner.invoke(app, [str(a) for a in ("placement", drifted["trace"], "--gpus", GPUS, "--current", drifted["deployed"],
                                                   "--intermediate-size", INTERMEDIATE, "--out", path, *args)])
    assert result.exit_code == 0, result.stderr  # advice, never an error
    return json.loads(path.read_text()), result.stdout


def balancedness(load: np.ndarray, phy2log: np.ndarray) -> float:
    """vLLM's ``sum_l mean_g / sum_l max_g`` of the GPU loads ``phy2log`` gives ``load [L, E]`` (each expert's load split over its replicas)."""
    replicas = np.stack([np.bincount(row, minlength=load.shape[1]) for row in phy2log])
    per_slot = np.take_along_axis(load / replicas, phy2log, axis=1)  # [L, N]
    gpu = per_slot.reshape(len(phy2log), GPUS, -1).sum(axis=2)
    return float(gpu.mean(axis=1).sum() / gpu.max(axis=1).sum())


def test_a_replan_that_pays_is_recommended_with_the_cost_models_figures(drifted):
    plan, stdout = replan(drifted, "--pass-ms", "50", "--link-gbps", "25")
    advice = plan["recommendation"]
    deployed = np.asarray([list(range(EXPERTS))] * 3)
    new = np.asarray(plan["phy2log"])
    assert advice["recommended"] is True and advice["plan_written"] == "new" and not (new == deployed).all()
    assert "replan: recommended" in stdout
    # copies: slots whose expert changes, per GPU; the busiest GPU's bytes over the link set the stall
    changed = (new != deployed).reshape(3, GPUS, -1).sum(axis=(0, 2))
    assert advice["moved"] == changed.sum() == plan["replicas_moved_from_current"] and advice["moved_peak"] == changed.max()
    assert advice["stall_s"] == pytest.approx(changed.max() * EXPERT_BYTES / 25e9)
    # balance: the deployed plan on the held-out estimate's scored windows against the estimate's realised next-window figure
    estimate = plan["held_out_estimate"]
    span = estimate["scored_passes"]
    keep = np.array([balancedness(drifted["counts"][t : t + span].sum(axis=0), deployed) for t in span * np.arange(1, estimate["windows"] + 1)])
    realised = np.asarray(estimate["realized"][plan["preferred_by_estimate"]])
    saved = float(np.mean(1 - keep / realised))
    assert advice["balance_source"] == "held-out estimate" and advice["b_keep"] == pytest.approx(keep.mean()) and advice["saved_share"] == pytest.approx(saved)
    assert saved > 0.1  # contiguous under OLMoE skew: the replan saves over a tenth of the MoE time
    assert advice["every"] == span and advice["gain_s"] == pytest.approx(span * 0.05 * saved) and advice["gain_s"] > advice["stall_s"]
    assert advice["break_even_pass_s"] == pytest.approx(advice["stall_s"] / (span * saved))


def test_a_replan_whose_copies_cost_more_than_it_saves_keeps_the_deployed_plan(drifted, monkeypatch):
    deployed = [list(range(EXPERTS))] * 3
    for args in (("--pass-ms", "0.0001"), ("--pass-ms", "50", "--link-gbps", "0.001")):  # a tiny pass time, a very slow link
        plan, stdout = replan(drifted, *args)
        advice = plan["recommendation"]
        assert advice["recommended"] is False and advice["plan_written"] == "current" and advice["gain_s"] < advice["stall_s"]
        assert plan["phy2log"] == deployed and plan["replicas_moved_from_current"] == 0 and advice["moved"] > 0
        assert "replan: not recommended" in stdout and "--out holds the deployed plan" in stdout
    forced, _ = replan(drifted, "--pass-ms", "0.0001", "--replan-anyway", out="forced.json")
    assert forced["recommendation"]["recommended"] is False and forced["recommendation"]["plan_written"] == "new"
    assert forced["phy2log"] != deployed and forced["replicas_moved_from_current"] == forced["recommendation"]["moved"]
    # negative control: without the weighing, the same run writes the new plan (the check above can fail)
    monkeypatch.setattr(command, "weigh_replan", lambda *a: None)
    unweighed, _ = replan(drifted, "--pass-ms", "0.0001", out="unweighed.json")
    assert unweighed["phy2log"] == forced["phy2log"] != deployed


def test_without_the_pass_time_the_replan_is_not_weighed(drifted):
    plan, stdout = replan(drifted)
    advice = plan["recommendation"]
    assert advice["recommended"] is None and advice["gain_s"] is None and advice["plan_written"] == "new"
    assert "the MoE time per pass is unknown (give --pass-ms)" in advice["reason"] and "replan: not weighed" in stdout
    assert advice["break_even_pass_s"] == pytest.approx(advice["stall_s"] / (advice["every"] * advice["saved_share"]))


def test_without_an_estimate_both_plans_are_weighed_in_sample_over_the_trace(drifted):
    plan, _ = replan(drifted, "--holdout", "0.25", "--pass-ms", "50")
    advice = plan["recommendation"]
    deployed = np.asarray([list(range(EXPERTS))] * 3)
    keep = balancedness(drifted["counts"].sum(axis=0), deployed)
    new = plan["in_sample"]["balancedness"]["moetrace"]
    assert advice["balance_source"] == "in-sample" and advice["every"] == len(drifted["counts"])  # the trace's passes
    assert advice["b_keep"] == pytest.approx(keep) and advice["b_new"] == pytest.approx(new) and advice["saved_share"] == pytest.approx(1 - keep / new)
