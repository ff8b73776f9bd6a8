"""analyze_trace against an independent numpy computation: real OLMoE counts and random traces."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from moetrace.analysis import analyze_trace
from moetrace.trace import TraceError

from .helpers import (
    js_bits,
    olmoe,
    olmoe_token_passes,
    oracle_counts,
    oracle_figures,
    random_passes,
    record,
    write_stat_trace,
)

DOMAINS = ["arxiv", "book", "c4", "github", "wikipedia", "tulu"]


@pytest.mark.parametrize("domain", DOMAINS)
def test_olmoe_stat_trace_matches_numpy(tmp_path, domain):
    data = olmoe()
    counts = np.asarray(data["expert_counts"][domain], dtype=np.int64)  # [3, 64]
    path = write_stat_trace(tmp_path / "olmoe.h5", counts, top_k=8, ep_size=8, layer_ids=data["layers"], model="OLMoE-1B-7B")
    report = analyze_trace(path)
    ref = oracle_figures(counts, ep_size=8)
    np.testing.assert_allclose(report.balancedness, ref["balancedness"], rtol=1e-12)
    np.testing.assert_allclose(report.layer_balancedness, ref["layer_balancedness"], rtol=1e-12)
    np.testing.assert_allclose(report.layer_imbalance, ref["imbalance"], rtol=1e-12)
    np.testing.assert_allclose(report.entropy_ratio, ref["entropy"], rtol=1e-12)
    np.testing.assert_array_equal(report.rank_load, ref["load"])
    d = report.to_dict()
    assert d["totals"]["assignments"] == int(counts.sum())
    assert d["totals"]["tokens"] == int(counts[0].sum()) // 8
    if domain != "tulu":  # the README's figure for the text domains
        assert d["totals"]["assignments"] == 3 * 1_671_168
    for i, row in enumerate(d["per_layer"]):
        assert row["layer"] == data["layers"][i]
        assert [h["expert"] for h in row["hottest"]] == list(np.argsort(-counts[i], kind="stable")[:5])
        assert row["hottest"][0]["load_ratio"] == pytest.approx(counts[i].max() / counts[i].mean())
        assert row["dead_experts"] == [int(e) for e in np.flatnonzero(counts[i] == 0)]
    # The real routing is skewed: the hottest expert takes far more than its share.
    assert max(r["hottest"][0]["load_ratio"] for r in d["per_layer"]) > 3
    json.dumps(d)  # JSON-ready


def test_olmoe_tokens_replayed_through_recorder(tmp_path):
    """Real OLMoE counts dealt into tokens, recorded per token: analyze == numpy, co-activation == brute force."""
    exact, passes = olmoe_token_passes("github", scale=200, tokens_per_pass=128)
    path = record(tmp_path, "per_token", passes, num_experts=64, ep_size=4, layer_ids=(0, 7, 15))
    report = analyze_trace(path, window=5, top=3)
    np.testing.assert_array_equal(report.logical_count, exact)
    ref = oracle_figures(exact, ep_size=4)
    np.testing.assert_allclose(report.balancedness, ref["balancedness"], rtol=1e-12)
    np.testing.assert_allclose(report.entropy_ratio, ref["entropy"], rtol=1e-12)
    ids = np.concatenate(passes)  # [T, 3, 8]
    co = np.zeros((3, 64, 64), np.int64)
    trans = np.zeros((2, 64, 64), np.int64)
    for t in range(len(ids)):
        for layer in range(3):
            for a, b in itertools.combinations(sorted(set(ids[t, layer].tolist())), 2):
                co[layer, a, b] += 1
                co[layer, b, a] += 1
        for layer in range(2):
            for slot in range(8):
                trans[layer, ids[t, layer, slot], ids[t, layer + 1, slot]] += 1
    np.testing.assert_array_equal(report.coactivation.coactivation, co)
    np.testing.assert_array_equal(report.coactivation.transitions, trans)
    d = report.to_dict()
    top = d["coactivation"]["per_layer"][0]["top_pairs"][0]
    upper = np.triu(co[0], 1)
    assert top["count"] == upper.max()
    n_a = sum(top["a"] in set(row.tolist()) for row in ids[:, 0])
    n_b = sum(top["b"] in set(row.tolist()) for row in ids[:, 0])
    assert top["lift"] == pytest.approx(top["count"] * len(ids) / (n_a * n_b))
    assert [t["from_layer"] for t in d["transitions"]] == [0, 7]
    assert d["transitions"][0]["top"][0]["count"] == trans[0].max()


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_random_trace_every_mode_matches_numpy(tmp_path, mode):
    rng = np.random.default_rng(7)
    passes = random_passes(rng, num_passes=37, num_layers=3, num_experts=16, top_k=4)
    path = record(tmp_path, mode, passes, num_experts=16, ep_size=4, layer_ids=(2, 5, 9))
    report = analyze_trace(path, window=6)
    counts = oracle_counts(passes, 16)
    np.testing.assert_array_equal(report.logical_count, counts)
    ref = oracle_figures(counts, ep_size=4)
    np.testing.assert_allclose(report.balancedness, ref["balancedness"], rtol=1e-12)
    np.testing.assert_allclose(report.layer_imbalance, ref["imbalance"], rtol=1e-12)
    np.testing.assert_allclose(report.entropy_ratio, ref["entropy"], rtol=1e-12)
    np.testing.assert_array_equal(report.dead_experts, ref["dead"])
    d = report.to_dict()
    assert d["totals"]["passes"] == 37
    assert d["totals"]["tokens"] == sum(len(p) for p in passes)
    assert d["totals"]["invalid_ids"] == sum(int((p == 19).sum()) for p in passes)
    assert not d["notes"] or "co-activation" in d["notes"][0]
    # Drift: windows of 6 passes; balancedness and JS from the definitions.
    windows = [passes[i : i + 6] for i in range(0, 37, 6)]
    drift = d["drift"]
    assert drift["num_windows"] == len(windows) == 7
    previous = None
    for w, got in zip(windows, drift["windows"], strict=True):
        wc = oracle_counts(w, 16)
        assert got["passes"] == len(w)
        assert got["tokens"] == sum(len(p) for p in w)
        assert got["balancedness"] == pytest.approx(oracle_figures(wc, 4)["balancedness"], rel=1e-12)
        if previous is None:
            assert got["js_from_previous"] is None
        else:
            js = [js_bits(previous[layer], wc[layer]) for layer in range(3)]
            assert got["js_from_previous"] == pytest.approx(np.mean(js), rel=1e-9, abs=1e-12)
            assert got["js_max_layer"]["layer"] == (2, 5, 9)[int(np.argmax(js))]
        previous = wc


def test_layer_selection_and_logical_map(tmp_path):
    rng = np.random.default_rng(3)
    passes = random_passes(rng, num_passes=12, num_layers=3, num_experts=8, top_k=2)
    # 8 physical slots holding 6 logical experts (two replicated).
    mapping = np.array([0, 1, 2, 3, 4, 5, 0, 1])
    path = record(tmp_path, "per_token", passes, num_experts=8, ep_size=2, physical_to_logical=mapping, layer_ids=(1, 2, 3))
    report = analyze_trace(path, layers=[3, 1])
    physical = oracle_counts(passes, 8)[[0, 2]]
    logical = np.zeros((2, 6), np.int64)
    for p in range(8):
        logical[:, mapping[p]] += physical[:, p]
    assert list(report.layer_ids) == [1, 3]
    np.testing.assert_array_equal(report.physical_count, physical)
    np.testing.assert_array_equal(report.logical_count, logical)
    co = report.coactivation.coactivation
    assert co.shape == (2, 6, 6) and (np.diagonal(co, axis1=1, axis2=2) == 0).all()
    np.testing.assert_array_equal(co, co.transpose(0, 2, 1))
    with pytest.raises(TraceError, match="not MoE layers"):
        analyze_trace(path, layers=[4])
    with pytest.raises(ValueError, match="window"):
        analyze_trace(path, window=0)


def test_stat_window_drift_and_empty_recording(tmp_path):
    rng = np.random.default_rng(5)
    passes = random_passes(rng, num_passes=30, num_layers=2, num_experts=8, top_k=2)
    path = record(tmp_path, "stat", passes, num_experts=8, ep_size=2, window=20)
    report = analyze_trace(path, window=5)
    # The stat window keeps the last 20 passes, oldest first.
    assert [w["first_pass"] for w in report.to_dict()["drift"]["windows"]] == [10, 15, 20, 25]
    np.testing.assert_array_equal(report.logical_count, oracle_counts(passes, 8))
    empty = record(tmp_path, "per_pass", passes[:0] or [np.zeros((1, 2, 2), np.int64) - 1], num_experts=8, name="empty.h5")
    d = analyze_trace(empty).to_dict()
    assert d["totals"]["assignments"] == 0 and d["overall"]["balancedness"] == 1.0
