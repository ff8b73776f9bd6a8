"""Expert-level balance on a single-rank trace of real routes, against plain-Python oracles.

One process is one EP rank: every rank figure is 1 there, so the headline must
lead with the expert figures and say that rank balance needs EP.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from moetrace.cli.analysis import print_report
from moetrace.exporters import prometheus
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from moetrace import ExpertDistributionRecorder, RecorderConfig, balance
from moetrace.analysis import analyze_trace

from .helpers import random_passes, record, write_stat_trace
from .real_routes import LAYER_IDS, NUM_EXPERTS, TOP_K, olmoe_router_ids, olmoe_router_trace

README = Path(__file__).resolve().parents[2] / "README.md"


def oracle(row: np.ndarray) -> dict[str, float]:
    """Expert figures of one layer's counts, straight from the definitions in docs/analysis.md."""
    values = [int(x) for x in row]
    n, total = len(values), sum(values)
    mean = total / n
    hot = math.ceil(n / 10)
    return {
        "imbalance": max(values) / mean,
        "cv": math.sqrt(sum((v - mean) ** 2 for v in values) / n) / mean,
        "hot_share": sum(sorted(values, reverse=True)[:hot]) / total,
        "dead": sum(v == 0 for v in values),
        "max": max(values),
        "mean": mean,
    }


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """``(path, counts [3, 64])``: a one-rank trace of real (OLMoE-biased) routes."""
    return olmoe_router_trace(tmp_path_factory.mktemp("expert-balance"))


def render(report) -> str:
    buffer = io.StringIO()
    print_report(report, Console(file=buffer, width=80))
    return buffer.getvalue()


def test_expert_imbalance_per_layer_matches_oracle(routed):
    path, counts = routed
    report = analyze_trace(path)
    np.testing.assert_array_equal(report.logical_count, counts)
    d = report.to_dict()
    assert d["layers"] == list(LAYER_IDS) and len(d["expert_imbalance"]) == len(LAYER_IDS)
    for i, row in enumerate(d["per_layer"]):
        ref = oracle(counts[i])
        assert d["expert_imbalance"][i] == pytest.approx(ref["imbalance"], rel=1e-12)
        assert row["expert_imbalance"] == pytest.approx(ref["imbalance"], rel=1e-12)
        assert row["expert_cv"] == pytest.approx(ref["cv"], rel=1e-12)
        assert row["hot_expert_share"] == pytest.approx(ref["hot_share"], rel=1e-12)
        assert len(row["dead_experts"]) == ref["dead"]
        assert row["balancedness"] == 1.0 and row["imbalance"] == 1.0  # one rank: rank figures are 1 by definition
    refs = [oracle(c) for c in counts]
    overall = d["overall"]
    assert overall["expert_imbalance"] == pytest.approx(sum(r["max"] for r in refs) / sum(r["mean"] for r in refs), rel=1e-12)
    assert overall["max_layer_expert_imbalance"] == pytest.approx(max(r["imbalance"] for r in refs), rel=1e-12)
    assert overall["hot_expert_share"] == pytest.approx(
        sum(sum(sorted(c.tolist(), reverse=True)[:7]) for c in counts) / counts.sum(), rel=1e-12)
    assert overall["hot_experts"] == 7 and overall["rank_balance_needs_ep"] is True
    # The real routing is skewed: the hottest expert gets several times its share.
    assert min(d["expert_imbalance"]) > 3


def test_headline_leads_with_expert_balance_on_one_rank(routed):
    path, counts = routed
    report = analyze_trace(path)
    headline = report.headline()
    figure = sum(c.max() for c in counts) / sum(c.mean() for c in counts)
    assert headline[0].startswith(f"expert imbalance {figure:.2f} (hottest/mean")
    assert "hottest 10% (7 of 64 experts)" in headline[1]
    assert headline[-1].startswith("rank balance: needs EP")
    text = render(report)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "balancedness 1.000" not in text and "window balancedness" not in text
    assert "needs EP" in text and "Per EP rank" not in text
    assert "EP projection" in text and text.index("expert imbalance") < text.index("Per layer")
    for i, layer in enumerate(LAYER_IDS):  # a whole table row per layer, hottest experts included, not wrapped
        hottest = np.argsort(-counts[i], kind="stable")[:3]
        cells = ", ".join(f"{e}:{counts[i, e] / counts[i].mean():.1f}" for e in hottest)
        assert any(line.strip().startswith(str(layer)) and line.rstrip().endswith(cells) for line in text.splitlines()), cells


def test_headline_with_ep_shows_rank_balance(tmp_path):
    passes = random_passes(np.random.default_rng(3), num_passes=12, num_layers=2, num_experts=16, top_k=4)
    report = analyze_trace(record(tmp_path, "stat", passes, num_experts=16, ep_size=4))
    headline = report.headline()
    assert headline[0].startswith("expert imbalance")
    assert headline[-1].startswith(f"rank balance over 4 EP ranks: balancedness {report.balancedness:.3f}")
    assert report.to_dict()["overall"]["rank_balance_needs_ep"] is False
    text = render(report)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "Per layer: balance over 4 EP ranks" in text and "Per EP rank" in text


def test_snapshot_and_prometheus_carry_expert_figures(tmp_path):
    """The live path: recorder snapshot and a Prometheus scrape give the oracle's per-layer figures."""
    ids = olmoe_router_ids(tokens=1024, seed=5)
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=3, num_physical_experts=NUM_EXPERTS, top_k=TOP_K,
                                                    layer_ids=LAYER_IDS, output_dir=tmp_path, max_tokens_per_pass=256))
    rec.start_record()
    for start in range(0, len(ids), 256):
        with rec.with_forward_pass():
            for layer in range(3):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.as_tensor(ids[start : start + 256, layer]))
    snap = rec.snapshot()
    counts = np.stack([np.bincount(ids[:, layer].reshape(-1), minlength=NUM_EXPERTS) for layer in range(3)])
    np.testing.assert_array_equal(snap.logical_count, counts)
    refs = [oracle(c) for c in counts]
    np.testing.assert_allclose(snap.expert_imbalance, [r["imbalance"] for r in refs], rtol=1e-12)
    np.testing.assert_allclose(snap.expert_cv, [r["cv"] for r in refs], rtol=1e-12)
    np.testing.assert_allclose(snap.hot_expert_share, [r["hot_share"] for r in refs], rtol=1e-12)
    scraped: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(generate_latest(prometheus.register(rec)).decode()):
        for s in family.samples:
            scraped.setdefault(s.name, {})[s.labels.get("layer", "")] = s.value
    for i, layer in enumerate(LAYER_IDS):
        assert scraped["moetrace_layer_expert_imbalance"][str(layer)] == pytest.approx(refs[i]["imbalance"], rel=1e-12)
        assert scraped["moetrace_layer_expert_cv"][str(layer)] == pytest.approx(refs[i]["cv"], rel=1e-12)
        assert scraped["moetrace_layer_hot_expert_share"][str(layer)] == pytest.approx(refs[i]["hot_share"], rel=1e-12)
        assert scraped["moetrace_layer_balancedness"][str(layer)] == 1.0  # one rank
    assert scraped["moetrace_expert_imbalance"][""] == pytest.approx(
        sum(r["max"] for r in refs) / sum(r["mean"] for r in refs), rel=1e-12)
    rec.stop_record()
    rec.reset()  # nothing to keep


def test_metric_edge_cases():
    counts = np.array([[0, 0, 0, 0], [5, 5, 5, 5], [8, 0, 0, 0]])
    np.testing.assert_allclose(balance.expert_imbalance(counts), [1.0, 1.0, 4.0])
    np.testing.assert_allclose(balance.expert_cv(counts), [0.0, 0.0, math.sqrt(3)])
    np.testing.assert_allclose(balance.hot_expert_share(counts), [0.0, 0.25, 1.0])
    assert balance.overall_expert_imbalance(counts) == pytest.approx((0 + 5 + 8) / (0 + 5 + 2))
    assert balance.overall_expert_imbalance(np.zeros((2, 4))) == 1.0
    assert balance.overall_hot_expert_share(np.zeros((2, 4))) == 0.0
    assert [balance.hot_expert_count(e) for e in (1, 8, 10, 11, 30, 64, 256)] == [1, 1, 1, 2, 3, 7, 26]


def _readme_block(lang: str, needle: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if needle in b]
    return block


def test_readme_hf_snippet_headline_reflects_real_skew(tmp_path, monkeypatch):
    """The README's HF snippet, run as written on a tiny random Qwen3-MoE, then its `moetrace analyze` line."""
    from moetrace.cli.app import app
    from typer.testing import CliRunner

    from ..adapters.hf_models import FAMILIES, VOCAB, capture_routers

    family = FAMILIES["qwen3_moe"]
    model = family.build()
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    monkeypatch.chdir(tmp_path)
    with capture_routers(model, family) as routes:  # independent of moetrace's hooks
        exec(_readme_block("python", "moetrace.adapters.hf import instrument"), {"model": model, "input_ids": input_ids})
    counts = routes.counts(len(family.layer_ids), family.num_experts).numpy()
    assert counts.sum() > 0
    command = _readme_block("sh", "moetrace analyze").split("#")[0].split()
    assert command[:2] == ["moetrace", "analyze"]
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(app, command[1:])
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    figure = sum(c.max() for c in counts) / sum(c.mean() for c in counts)
    assert figure > 1.5  # the tiny model's router is really skewed
    assert f"expert imbalance {figure:.2f} (hottest/mean; worst layer {max(oracle(c)['imbalance'] for c in counts):.2f})" in text
    hot = sum(sum(sorted(c.tolist(), reverse=True)[:1]) for c in counts) / counts.sum()
    assert f"hottest 10% (1 of 8 experts) take {100 * hot:.1f}% (even: 12.5%)" in text
    assert "rank balance: needs EP" in text and "balancedness 1.000" not in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_empty_trace_headline_says_so(tmp_path):
    report = analyze_trace(write_stat_trace(tmp_path / "empty.h5", np.zeros((2, 6), np.int64), 2, 1, [0, 1]))
    assert report.headline() == ["no expert assignments recorded: no balance to report (was the recorder started?)"]
    assert [row["ranks"] for row in report.to_dict()["ep_projection"]] == [2, 3, 6]
