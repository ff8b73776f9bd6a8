"""EP projection: contiguous placement against an independent numpy computation, planned never below it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetrace.analysis import analyze_trace
from moetrace.analysis.projection import ep_projection, projection_ranks
from moetrace.data import olmoe_counts
from moetrace.placement.plan import plan_experts

from .real_routes import olmoe_router_trace


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """``(path, counts [3, 64])``: a one-rank trace of real (OLMoE-biased) routes."""
    return olmoe_router_trace(tmp_path_factory.mktemp("projection"))


def contiguous_oracle(counts: np.ndarray, ranks: int) -> tuple[float, list[float]]:
    """Balancedness of ``rank r holds experts [r·E/R, (r+1)·E/R)``, written out with plain loops."""
    num_experts = counts.shape[1]
    size = num_experts // ranks
    means, peaks = [], []
    for layer in counts:
        loads = [int(sum(layer[r * size : (r + 1) * size])) for r in range(ranks)]
        means.append(sum(loads) / ranks)
        peaks.append(max(loads))
    return sum(means) / sum(peaks), [m / p for m, p in zip(means, peaks, strict=True)]


def test_contiguous_projection_matches_numpy_on_real_routes(routed):
    path, counts = routed
    report = analyze_trace(path)
    assert report.ep_size == 1
    np.testing.assert_array_equal(report.logical_count, counts)
    rows = report.to_dict()["ep_projection"]
    assert [row["ranks"] for row in rows] == [2, 4, 8, 16, 32, 64]
    for row in rows:
        expected, per_layer = contiguous_oracle(counts, row["ranks"])
        assert row["contiguous_balancedness"] == pytest.approx(expected, rel=1e-12)
        np.testing.assert_allclose(row["contiguous_layer_balancedness"], per_layer, rtol=1e-12)
        assert row["experts_per_rank"] == 64 // row["ranks"] and row["redundant_slots"] == row["ranks"]
    # The real skew shows: contiguous placement loses balance as ranks grow, and it is far from 1 at 8 ranks.
    contiguous = [row["contiguous_balancedness"] for row in rows]
    assert contiguous == sorted(contiguous, reverse=True)
    assert contiguous[2] < 0.9
    json.dumps(rows)


def test_planned_never_below_contiguous_on_real_routes(routed):
    _, counts = routed
    for row in ep_projection(counts):
        assert row.planned_balancedness >= row.contiguous_balancedness
        assert row.planned_redundant_balancedness >= row.planned_balancedness
        assert (row.planned_layer_balancedness >= row.contiguous_layer_balancedness).all()
        assert (row.planned_redundant_layer_balancedness >= row.planned_layer_balancedness).all()


@pytest.mark.parametrize("domain", sorted(olmoe_counts()["expert_counts"]))
def test_planner_beats_contiguous_on_real_olmoe_counts(domain):
    """On the real counts the planner's own plan is used everywhere (no fallback) and helps until R = E."""
    counts = np.asarray(olmoe_counts()["expert_counts"][domain])
    for row in ep_projection(counts):
        assert row.layers_kept_contiguous == 0
        plan = plan_experts(counts, 64, 1, 1, row.ranks)
        assert row.planned_balancedness == pytest.approx(plan.balancedness, rel=1e-12)
        if row.ranks < 64:
            assert row.planned_balancedness > row.contiguous_balancedness
        else:  # one expert per rank: every placement is a permutation
            assert row.planned_balancedness == pytest.approx(row.contiguous_balancedness, rel=1e-12)
        assert row.planned_redundant_balancedness > row.contiguous_balancedness or row.ranks == 2


def test_planned_never_below_contiguous_on_random_loads():
    rng = np.random.default_rng(7)
    for _ in range(40):
        num_experts = int(rng.choice([6, 8, 12, 16, 32]))
        counts = rng.integers(0, 60, size=(3, num_experts)) * (rng.random((3, num_experts)) < 0.8)
        for row in ep_projection(counts, redundant_per_rank=int(rng.integers(1, 3))):
            expected, _ = contiguous_oracle(counts, row.ranks)
            assert row.contiguous_balancedness == pytest.approx(expected, rel=1e-12)
            assert (row.planned_layer_balancedness >= row.contiguous_layer_balancedness).all()
            assert (row.planned_redundant_layer_balancedness >= row.planned_layer_balancedness).all()


def test_projection_ranks_and_errors():
    assert projection_ranks(64) == [2, 4, 8, 16, 32, 64]
    assert projection_ranks(60) == [2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60]
    assert projection_ranks(7) == [7] and projection_ranks(1) == []
    assert ep_projection(np.ones((2, 1))) == []
    with pytest.raises(ValueError, match="non-empty"):
        ep_projection(np.ones(8))
    with pytest.raises(ValueError, match="redundant_per_rank"):
        ep_projection(np.ones((1, 8)), redundant_per_rank=0)


def test_analyze_and_plot_projection_through_the_cli(routed, tmp_path):
    from moetrace.cli.app import app
    from typer.testing import CliRunner

    path, counts = routed
    runner = CliRunner()
    result = runner.invoke(app, ["analyze", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["ep_projection"]
    assert [r["contiguous_balancedness"] for r in rows] == pytest.approx([contiguous_oracle(counts, r["ranks"])[0] for r in rows], rel=1e-12)
    text = runner.invoke(app, ["analyze", str(path)]).stdout
    assert "EP projection" in text and "planned +1/rank" in text
    out = tmp_path / "projection.png"
    result = runner.invoke(app, ["plot", str(path), "-o", str(out), "--kind", "projection"])
    assert result.exit_code == 0, result.stderr
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 10_000


def test_one_rank_plots_do_not_show_rank_balance(routed, tmp_path):
    from moetrace.analysis import plot_report

    path, _ = routed
    report = analyze_trace(path)
    with pytest.raises(ValueError, match="rank balance needs EP; --kind projection"):
        plot_report(report, tmp_path / "ranks.png", kind="ranks")
    written = plot_report(report, tmp_path / "timeline.png", kind="timeline")  # drift only
    assert written.stat().st_size > 10_000
