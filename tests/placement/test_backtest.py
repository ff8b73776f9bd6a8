"""Placement on the next window: series reading, hold-out, backtest, robust planning, the CLI.

The routes are synthetic drift of real counts (:mod:`moetrace.reference.domain_drift`):
real OLMoE domain skew, a drifting domain mix, recorded by the real recorder.
Expected figures are recomputed here from the routes with plain numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis import source
from moetrace.analysis.source import load_series, select_layers
from moetrace.data import olmoe_counts
from moetrace.placement import backtesting as bt
from moetrace.placement.backtesting import backtest, holdout
from moetrace.placement.checks import PlacementConfig, PlacementError
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import align_to, plan_experts, predicted_gpu_load, replicas_moved
from moetrace.placement.planners import CANDIDATES, RobustSettings, robust_inputs, robust_rebalance
from moetrace.placement.series import PassSeries
from moetrace.reference.domain_drift import DriftSpec, drift_routes
from moetrace.trace import open_trace

from ..analysis.helpers import record
from .test_plan import check_plan

PASSES, TOKENS, HIDDEN = 240, 64, 32
runner = CliRunner()


def record_routes(path: Path, mode: str, passes: list[np.ndarray]) -> Path:
    """Replay routes ``[T, 3, 8]`` through the real recorder (64 experts on 8 EP ranks, hidden size recorded)."""
    return record(path.parent, mode, passes, 64, ep_size=8, window=len(passes), name=path.name, layer_ids=(0, 7, 15), hidden_size=HIDDEN)


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drift")
    passes, _, _ = drift_routes(DriftSpec(num_passes=PASSES, tokens_per_pass=TOKENS, seed=5))
    counts = np.stack([np.stack([np.bincount(p[:, layer].ravel(), minlength=64) for layer in range(3)]) for p in passes])  # [P, 3, 64]
    return {
        "counts": counts,
        "token": record_routes(tmp / "token.h5", "per_token", passes),
        "pass": record_routes(tmp / "pass.h5", "per_pass", passes),
        "stat": record_routes(tmp / "stat.h5", "stat", passes),
        "dir": tmp,
    }


def series_of(path: Path, bucket: int | None = None) -> PassSeries:
    with open_trace(path) as tr:
        return load_series(tr, select_layers(tr, None), bucket)


def balance(load: np.ndarray) -> float:
    """Balancedness straight from the definition: sum of layer means over sum of layer peaks."""
    return float(load.mean(axis=1).sum() / load.max(axis=1).sum())


def gpu_load(weight: np.ndarray, phy2log: np.ndarray, gpus: int) -> np.ndarray:
    """Per-GPU load by loops: each slot carries its expert's load over the expert's replica count."""
    layers, slots = phy2log.shape
    out = np.zeros((layers, gpus))
    for layer in range(layers):
        copies = np.bincount(phy2log[layer], minlength=weight.shape[1])
        for slot, expert in enumerate(phy2log[layer]):
            out[layer, slot // (slots // gpus)] += weight[layer, expert] / copies[expert]
    return out


# ------------------------------------------------------------------------- reading
@pytest.mark.parametrize("kind", ["token", "pass", "stat"])
def test_series_holds_every_pass_in_order(drift, kind):
    series = series_of(drift[kind])
    assert series.bucket == 1 and len(series) == PASSES
    np.testing.assert_array_equal(series.logical, drift["counts"])
    np.testing.assert_array_equal(series.physical, drift["counts"])  # identity map
    bucketed = series_of(drift[kind], bucket=7)
    assert bucketed.passes.tolist() == [7] * (PASSES // 7) + [PASSES % 7]
    np.testing.assert_array_equal(bucketed.logical[1], drift["counts"][7:14].sum(axis=0))


def test_series_merges_buckets_beyond_the_cap(drift, monkeypatch):
    monkeypatch.setattr(source, "MAX_BUCKETS", 16)
    series = series_of(drift["token"])
    assert series.bucket == 8 and len(series) == PASSES // 8 and series.passes.sum() == PASSES
    np.testing.assert_array_equal(series.logical.sum(axis=0), drift["counts"].sum(axis=0))


# ------------------------------------------------------------------------- hold-out and backtest
def test_holdout_figures_from_the_definition(drift):
    series = series_of(drift["token"])
    config = PlacementConfig(72, 8, 2, 8)
    result = holdout(series, 0.25, config)
    cut = 180
    assert (result.plan_passes, result.scored_passes) == (cut, PASSES - cut)
    before, after = drift["counts"][:cut], drift["counts"][cut:]
    for name in ("greedy", "moetrace", "moetrace-fit"):
        plan = result.plans[name]
        assert plan.shape == (3, 72) and (np.sort(np.unique(plan, axis=None)) == np.arange(64)).all()
        assert result.in_sample[name] == pytest.approx(balance(gpu_load(before.sum(axis=0), plan, 8)))
        assert result.held_out[name] == pytest.approx(balance(gpu_load(after.sum(axis=0), plan, 8)))
        assert len(result.held_out_windows[name]) == 4
    np.testing.assert_array_equal(result.plans["greedy"], greedy_rebalance(before.sum(axis=0), 72, 8, 2, 8))
    contiguous = after.sum(axis=0).reshape(3, 8, 8).sum(axis=2)
    assert result.held_out["current"] == pytest.approx(balance(contiguous))
    # The in-sample fit flatters: on held-out passes the greedy plan loses balance.
    assert result.held_out["greedy"] < result.in_sample["greedy"]
    with pytest.raises(PlacementError, match="fraction in"):
        holdout(series, 1.0, config)


def test_backtest_replays_the_schedule(drift):
    series = series_of(drift["token"], bucket=10)
    config = PlacementConfig(64, 1, 1, 8)
    result = backtest(series, 60, 30, config, expert_bytes=1000)
    starts = list(range(60, PASSES - 30 + 1, 30))
    assert result.first_pass.tolist() == starts
    counts = drift["counts"]
    for i, t in enumerate(starts):
        plan = greedy_rebalance(counts[t - 60 : t].sum(axis=0), 64, 1, 1, 8)
        assert result.realized["greedy"][i] == pytest.approx(balance(gpu_load(counts[t : t + 30].sum(axis=0), plan, 8)))
        assert result.realized["current"][i] == pytest.approx(balance(counts[t : t + 30].sum(axis=0).reshape(3, 8, 8).sum(axis=2)))
    summary = result.summary()
    assert summary["greedy"]["moved_bytes_mean"] == pytest.approx(summary["greedy"]["moved_mean"] * 1000)
    assert set(summary) == {"moetrace", "moetrace-robust", "moetrace-fit", "greedy", "current", "oracle"}
    with pytest.raises(PlacementError, match="multiple of"):
        backtest(series, 65, 30, config)
    with pytest.raises(PlacementError, match="at least"):
        backtest(series, 200, 50, config)


def test_robust_planner_holds_better_on_the_next_window(drift):
    """The must-show, small: next-window balancedness above greedy on average, rarely below."""
    series = series_of(drift["token"], bucket=bt.bucket_for(80, 20))  # 5-pass buckets: 16 per window, 10 sub-windows
    assert series.bucket == 5
    realized = {"moetrace-robust": [], "greedy": []}
    for config in (PlacementConfig(64, 1, 1, 8), PlacementConfig(80, 8, 2, 8)):
        result = backtest(series, 80, 20, config, planners={k: CANDIDATES[k] for k in realized})
        for k in realized:
            realized[k].append(result.realized[k])
    ours, greedy = np.concatenate(realized["moetrace-robust"]), np.concatenate(realized["greedy"])
    assert ours.mean() > greedy.mean()
    assert (ours < greedy).mean() <= 0.25


# ------------------------------------------------------------------------- planner guarantees
def test_robust_plans_are_valid_and_moves_are_counted(drift):
    counts = drift["counts"].astype(np.float64)
    for replicas, groups, nodes, gpus in [(64, 1, 1, 8), (80, 8, 2, 8), (72, 8, 3, 24), (96, 4, 2, 16)]:
        config = PlacementConfig(replicas, groups, nodes, gpus)
        plan = robust_rebalance(counts[:120], 60, config)
        check_plan(plan, plan_weight(counts[:120], 60), replicas, groups, nodes, gpus)
        previous = plan.phy2log
        again = robust_rebalance(counts[:180], 60, config, current=previous)
        check_plan(again, plan_weight(counts[:180], 60), replicas, groups, nodes, gpus)
        assert replicas_moved(previous, again.phy2log, gpus) <= replicas_moved(previous, robust_rebalance(counts[:180], 60, config).phy2log, gpus)
        # Keeping is always possible: with an infinite tolerance nothing moves.
        kept = robust_rebalance(counts[:180], 60, config, RobustSettings(keep_tolerance=np.inf), current=previous)
        np.testing.assert_array_equal(kept.phy2log, previous)


def plan_weight(history: np.ndarray, window: int) -> np.ndarray:
    return robust_inputs(history, window, RobustSettings())[0]


def test_moves_and_alignment():
    a = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    reordered = a[:, [1, 0, 3, 2, 5, 4, 7, 6]]  # the same experts on each GPU, in other slots: each slot is a weight copy
    assert replicas_moved(a, reordered, 4) == 8
    np.testing.assert_array_equal(align_to(a, reordered, 1, 4), a)
    swapped = a[:, [2, 3, 0, 1, 4, 5, 6, 7]]  # GPUs 0 and 1 exchange contents
    assert replicas_moved(a, swapped, 4) == 4
    assert replicas_moved(a, a[:, [3, 2, 1, 0, 4, 5, 6, 7]], 4) == 4  # GPUs exchange contents and reorder: still 4 slots change
    aligned = align_to(a, swapped, 1, 4)
    assert replicas_moved(a, aligned, 4) == 0
    weight = np.arange(1.0, 9.0)[None]
    np.testing.assert_allclose(np.sort(predicted_gpu_load(weight, aligned, 4)), np.sort(predicted_gpu_load(weight, swapped, 4)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scenarios": np.ones((2, 3, 8))}, "scenarios must be"),
        ({"scenarios": -np.ones((2, 2, 8))}, "non-negative"),
        ({"current": np.zeros((2, 8), dtype=np.int64)}, "without a slot"),
        ({"current": np.zeros((2, 9), dtype=np.int64)}, "shape"),
        ({"current": np.full((2, 8), 9)}, r"ids in \[0, 8\)"),
        ({"keep_tolerance": -0.1}, "keep_tolerance"),
    ],
)
def test_robust_inputs_refused_clearly(kwargs, message):
    with pytest.raises(PlacementError, match=message):
        plan_experts(np.ones((2, 8)), 8, 1, 1, 4, **kwargs)


# ------------------------------------------------------------------------- CLI
def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_defaults_and_held_out_estimate(drift, tmp_path):
    result = invoke("placement", drift["token"], "--gpus", "8", "--out", tmp_path / "plan.json")
    assert result.exit_code == 0, result.stderr
    assert "defaults used: --slots 64 (the expert count), --groups 1, --nodes 1" in result.stdout
    assert "a fit, not a forecast" in result.stdout and "held-out estimate (planned on 48 passes, scored on the next 48" in result.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["defaults_used"] and len(plan["held_out_estimate"]["realized"]["moetrace"]) == 4
    # Which planner was deployed, and why: validated on the fifths of the trace.
    selection = plan["selection"]
    assert selection["folds"] == 4 and set(selection["validation"]) == set(CANDIDATES)
    # deployed: the validated choice, unless the held-out estimate on this trace has EPLB's plan ahead of it
    realized = plan["held_out_estimate"]["summary"]
    ahead = realized["greedy"]["mean"] > realized["moetrace"]["mean"]
    text = " ".join(result.stdout.split())
    assert plan["planner"] == ("greedy" if ahead else selection["chosen"])
    if ahead:  # one line says what is deployed, and that the estimate overruled the validation
        assert f"deployed: greedy. Validation on 4 folds of the trace's past (plan on 48 passes, score on the next 48) chose {selection['chosen']}, but" in text
    else:
        assert f"deployed: {selection['chosen']}, chosen by validation on 4 folds of the trace's past" in text
    assert text.count("deployed:") == 1 and "Candidates against greedy on the validation folds" in text
    assert "oracle" in plan["held_out_estimate"]["realized"] and "of the greedy-to-oracle gap" in result.stdout
    odd = invoke("placement", drift["token"], "--gpus", "6", "--json", "--progress")
    assert odd.exit_code == 0, odd.stderr
    assert "validating the planners (folds)" in odd.stderr and "held-out estimate (rebalances)" in odd.stderr  # progress on stderr, the JSON alone on stdout
    assert json.loads(odd.stdout)["num_replicas"] == 66 and "rounded up" in json.loads(odd.stdout)["defaults_used"][0]
    stat = json.loads(invoke("placement", drift["stat"], "--gpus", "8", "--json").stdout)  # a stat trace's window is time-ordered too
    assert stat["in_sample"]["passes"] == PASSES and stat["held_out_estimate"]["windows"] == 4
    moved = invoke("placement", drift["token"], "--gpus", "8", "--current", tmp_path / "plan.json", "--json")
    assert json.loads(moved.stdout)["replicas_moved_from_current"] == 0  # the same data: the deployed plan stays


def test_cli_holdout_and_backtest(drift, tmp_path):
    result = invoke("placement", drift["pass"], "--gpus", "8", "--slots", "72", "--holdout", "0.25", "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)["holdout"]
    assert set(document["held_out"]) == {"moetrace", "moetrace-robust", "moetrace-fit", "greedy", "current", "oracle"} and document["plan_passes"] == 180
    assert document["held_out"]["oracle"] >= document["held_out"]["greedy"] and set(document["gap_closed"]) == {"moetrace", "moetrace-robust", "moetrace-fit", "current"}
    assert document["selection"]["chosen"] in CANDIDATES
    table = invoke("placement", drift["pass"], "--gpus", "8", "--holdout", "0.25")
    assert "Hold-out: planned on the first 180 passes" in table.stdout and "in-sample (fit)" in table.stdout and "gap closed" in table.stdout
    png = tmp_path / "backtest.png"
    replay = invoke("placement", drift["token"], "--gpus", "8", "--backtest", "--window", "60", "--every", "30", "--intermediate-size", "128", "--plot", png, "--pass-ms", "5")
    assert replay.exit_code == 0, replay.stderr
    assert "realised mean" in replay.stdout and "bytes/rebalance" in replay.stdout and png.stat().st_size > 10_000
    assert "Rebalance cost vs benefit" in replay.stdout and "rebalancing every 30 passes" in replay.stdout and "moetrace deployed, by validation" in replay.stdout
    as_json = json.loads(invoke("placement", drift["token"], "--gpus", "8", "--backtest", "--window", "60", "--every", "30", "--intermediate-size", "128", "--json").stdout)
    assert as_json["backtest"]["expert_bytes"] == 3 * HIDDEN * 128 * 2 and as_json["backtest"]["rebalances"] == 6
    value = as_json["backtest"]["rebalance_value"]["planners"]["moetrace"]
    assert value["rebalances"] == 5 and value["bytes_moved"] == pytest.approx(value["moved"] * 3 * HIDDEN * 128 * 2)
    assert value["stall_s"] == pytest.approx(value["moved_peak"] * 3 * HIDDEN * 128 * 2 / 25e9) and value["recommendation"].startswith("rebalancing every 30 passes")
    assert len(as_json["backtest"]["chosen"]["moetrace"]) == 6 and as_json["backtest"]["summary"]["oracle"]["realized_mean"] > 0.99
    assert "(plan on 60 passes, score on the next 30)" in as_json["backtest"]["reasons"]["moetrace"]  # 6-pass buckets, explained in passes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backtest"], "needs --window"),
        (["--window", "10"], "add --backtest"),
        (["--pass-ms", "3"], "add --backtest"),
        (["--replan-anyway"], "add --current"),
        (["--holdout", "0.5", "--backtest", "--window", "10", "--every", "10"], "pass one of them"),
        (["--holdout", "1.5"], "fraction in (0, 1)"),
        (["--backtest", "--window", "400", "--every", "10"], "at least"),
        (["--slots", "60"], "smaller than the 64 experts"),
        (["--intermediate-size", "64", "--backtest", "--window", "60", "--every", "30", "--layers", "7"], None),
    ],
)
def test_cli_bad_input(drift, args, message):
    result = invoke("placement", drift["token"], "--gpus", "8", *args)
    if message is None:
        assert result.exit_code == 0, result.stderr
        return
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_refuses_what_it_cannot_evaluate(drift, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = invoke("placement", drift["token"], "--gpus", "8", "--current", bad)
    assert result.exit_code == 2 and "phy2log" in result.stderr
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"phy2log": [[0] * 64] * 3}))
    result = invoke("placement", drift["token"], "--gpus", "8", "--current", wrong)
    assert result.exit_code == 2 and "without a slot" in result.stderr


# ------------------------------------------------------------------------- the drift data
def test_drift_routes_drift_and_follow_the_real_skew():
    spec = DriftSpec(num_passes=120, tokens_per_pass=32, seed=2)
    passes, request_domain, domains = drift_routes(spec)
    again, _, _ = drift_routes(spec)
    assert len(passes) == 120 and passes[0].shape == (32, 3, 8) and passes[0].dtype == np.int64
    assert all((a == b).all() for a, b in zip(passes, again, strict=True))  # seeded
    assert all(len(np.unique(p[t, layer])) == 8 for p in passes[:5] for t in range(32) for layer in range(3))  # distinct top-8
    assert sorted(domains) == sorted(olmoe_counts()["expert_counts"]) and request_domain.shape == (120, 4)
    # The mix moves: the first and last 30 passes draw their requests from different domains.
    first, last = (np.bincount(request_domain[s].ravel(), minlength=6) for s in (slice(0, 30), slice(90, 120)))
    assert np.abs(first / first.sum() - last / last.sum()).sum() > 0.3
    # The skew is real: a domain's hottest real experts stay hot in its routes.
    counts = np.bincount(np.concatenate([p[:, 0].ravel() for p in passes]), minlength=64)
    real = np.zeros(64)
    for d, n in zip(*np.unique(request_domain, return_counts=True), strict=True):
        real += n * np.asarray(olmoe_counts()["expert_counts"][domains[d]][0], dtype=np.float64) / np.sum(olmoe_counts()["expert_counts"][domains[d]][0])
    assert np.corrcoef(np.argsort(np.argsort(counts)), np.argsort(np.argsort(real)))[0, 1] > 0.7
    with pytest.raises(ValueError, match="multiple of requests_per_pass"):
        DriftSpec(tokens_per_pass=30, requests_per_pass=4)
    with pytest.raises(ValueError, match="positive integer"):
        DriftSpec(num_passes=0)
