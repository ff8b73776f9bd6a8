"""Live attribution on the reference runtime: labelled requests through the serving loop, a planted population.

Population "code" repeats one token (repetitive traffic: every token of it routes
alike), population "chat" draws random tokens. The loop's LabelLoad, scraped through
a real Prometheus text exposition, must equal the offline attribution of the routes
the same requests returned, and name "code" as the label behind the hot experts.
"""

from __future__ import annotations

import numpy as np
import pytest
from moetrace.exporters import label_load as label_metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moetrace.analysis.attribution import attribute
from moetrace.label_load import OTHER, LabelError, LabelLoad
from moetrace.reference import ModelConfig, ReferenceMoEModel, Request, ServingLoop
from moetrace.routes import load_routes, save_routes

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=16, top_k=2, seed=4)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    rng = np.random.default_rng(0)
    requests = []
    for i in range(48):
        code = i % 4 == 0
        prompt = [7] * 24 if code else rng.integers(0, CONFIG.vocab_size, 24).tolist()
        requests.append(Request(f"r{i}", prompt, 4, arrival_step=i // 6, return_routed_experts=True,
                                labels={"workload": "code" if code else "chat"}))
    load = LabelLoad(CONFIG.num_layers, CONFIG.num_experts, key="workload", max_tracked=4)
    loop = ServingLoop(ReferenceMoEModel(CONFIG), max_running=6, max_tokens_per_pass=64, num_kv_slots=512, max_len=64, label_load=load)
    results = loop.run(requests)
    path = save_routes(tmp_path_factory.mktemp("live") / "routes.json", {r.rid: r.routed_experts for r in results},
                       num_experts=CONFIG.num_experts, labels={r.rid: r.labels for r in results})
    return load, results, path


def test_results_carry_labels(served):
    _, results, _ = served
    assert {r.labels["workload"] for r in results} == {"code", "chat"}


def test_live_equals_offline_and_names_the_planted_population(served):
    load, _, path = served
    offline = attribute(load_routes(path), by="label", key="workload")
    assert offline.culprits == ["code"]
    snap = load.snapshot()
    order = [offline.groups.index(name) for name in snap.labels]
    np.testing.assert_array_equal(snap.counts, offline.group_counts[order])
    np.testing.assert_array_equal(snap.tokens, offline.group_tokens[order])
    np.testing.assert_allclose(snap.hot_excess_share, offline.hot_excess_share[order])
    np.testing.assert_allclose(snap.divergence, offline.divergence[order])
    scraped = {}
    for family in text_string_to_metric_families(generate_latest(label_metrics.register(load, top=5)).decode()):
        for sample in family.samples:
            scraped[(sample.name, sample.labels["label"])] = sample.value
    code = snap.labels.index("code")
    assert scraped[("moetrace_label_hot_expert_excess_share", "code")] == pytest.approx(snap.hot_excess_share[code])
    assert scraped[("moetrace_label_tokens_total", "code")] == snap.tokens[code]
    assert snap.hot_excess_share[code] > snap.token_share[code] * 2


def test_label_set_is_bounded():
    load = LabelLoad(2, 4, key="tenant", max_tracked=3)
    routes = np.array([[[0, 1], [2, 3]]])
    for i in range(10):
        load.add({"tenant": f"t{i}"}, routes)
    snap = load.snapshot(top=2)
    assert snap.labels == ["t0", "t1", OTHER] and list(snap.requests) == [1, 1, 8]
    with pytest.raises(LabelError, match="at most 64"):
        load.add({"tenant": "x" * 65}, routes)
    with pytest.raises(ValueError, match="logical ids"):
        load.add({"tenant": "t0"}, np.array([[[0, 9], [2, 3]]]))
