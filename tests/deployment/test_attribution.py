"""Attribution: which labels (populations) drive the hot experts, checked against an independent numpy count.

Population A ("code") routes most of its tokens of layer 1 to experts 5 and 9;
population B ("chat") routes uniformly. A must be named for experts 5 and 9, with
figures equal to a numpy computation from the raw ids written out from the
definitions; a control in which the same requests get labels at random names no
culprit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis.attribution import attribute
from moetrace.routes import RoutesError, load_routes, save_routes

E, L, K = 16, 3, 2


def _request(rng: np.random.Generator, hot: bool) -> np.ndarray:
    n = int(rng.integers(4, 20))
    ids = np.empty((n, L, K), dtype=np.int64)
    for t in range(n):
        for layer in range(L):
            if hot and layer == 1 and rng.random() < 0.8:
                ids[t, layer] = [5, 9]
            else:
                ids[t, layer] = rng.choice(E, K, replace=False)
    return ids


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    rng = np.random.default_rng(3)
    requests, labels = {}, {}
    for i in range(120):
        code = i % 3 == 0  # a third of the requests
        requests[f"q{i}"] = _request(rng, code)
        labels[f"q{i}"] = {"workload": "code" if code else "chat", "tenant": f"t{i % 4}"}
    path = save_routes(tmp_path_factory.mktemp("routes") / "routes.json", requests, num_experts=E, labels=labels)
    return path, requests, labels


def _independent(requests, labels, key):
    """Per label: copies [L, E] and tokens, by loops; excess of a cell = copies - layer copies / E."""
    groups: dict[str, np.ndarray] = {}
    tokens: dict[str, int] = {}
    for rid, ids in requests.items():
        g = labels[rid][key]
        c = groups.setdefault(g, np.zeros((L, E)))
        for t in range(ids.shape[0]):
            for layer in range(L):
                for e in ids[t, layer]:
                    c[layer, e] += 1
        tokens[g] = tokens.get(g, 0) + ids.shape[0]
    return groups, tokens


def test_planted_population_is_named_and_figures_match_numpy(workload):
    path, requests, labels = workload
    result = attribute(load_routes(path), by="label", key="workload", top=3)
    doc = result.to_dict()
    assert doc["culprits"] == ["code"]
    groups, tokens = _independent(requests, labels, "workload")
    total = sum(groups.values())
    layer1 = doc["layers"][1]
    assert {h["expert"] for h in layer1["hot_experts"]} >= {5, 9}
    for h in layer1["hot_experts"]:
        e = h["expert"]
        excess = total[1, e] - total[1].sum() / E
        assert h["excess"] == pytest.approx(excess)
        by_who = {c["who"]: c for c in h["contributors"]}
        for who, c in by_who.items():
            mine = groups[who][1, e] - groups[who][1].sum() / E
            assert c["share_of_excess"] == pytest.approx(mine / excess)
            assert c["share_of_load"] == pytest.approx(groups[who][1, e] / total[1, e])
        if e in (5, 9):
            assert by_who["code"]["share_of_excess"] > 0.95
    hot = {layer: np.argsort(-total[layer], kind="stable")[:2] for layer in range(L)}  # 10% of 16 experts: 2
    pos = {layer: [e for e in hot[layer] if total[layer, e] - total[layer].sum() / E > 0] for layer in range(L)}
    denom = sum(total[layer, e] - total[layer].sum() / E for layer in range(L) for e in pos[layer])
    for g in doc["groups"]:
        mine = sum(groups[g["who"]][layer, e] - groups[g["who"]][layer].sum() / E for layer in range(L) for e in pos[layer])
        assert g["hot_excess_share"] == pytest.approx(mine / denom)
        assert g["token_share"] == pytest.approx(tokens[g["who"]] / sum(tokens.values()))
    code = next(g for g in doc["groups"] if g["who"] == "code")
    assert code["p_value"] < 0.005 and code["lift"] > 2


def test_labels_mixed_at_random_name_no_culprit(workload):
    path, requests, _ = workload
    rng = np.random.default_rng(11)
    mixed = {rid: {"workload": str(rng.choice(["code", "chat"]))} for rid in requests}
    control = save_routes(path.with_name("mixed.json"), requests, num_experts=E, labels=mixed)
    doc = attribute(load_routes(control), by="label").to_dict()
    assert doc["culprits"] == []
    tenants = attribute(load_routes(path), by="label", key="tenant").to_dict()  # tenant is independent of workload
    assert tenants["culprits"] == []


def test_by_request_ranks_requests_of_the_planted_population_first(workload):
    path, _, labels = workload
    doc = attribute(load_routes(path), by="request", top=5).to_dict()
    assert doc["culprits"] == []  # no significance test for single requests
    assert all(labels[g["who"]]["workload"] == "code" for g in doc["groups"])


def test_rank_excess_attributed(workload):
    path, _, _ = workload
    doc = attribute(load_routes(path), by="label", key="workload", ep_size=4).to_dict()
    rank = doc["layers"][1]["hottest_rank"]
    assert rank["rank"] in (1, 2)  # experts 5 (rank 1) and 9 (rank 2) of 4 ranks x 4 experts
    assert rank["contributors"][0]["who"] == "code"


def test_cli_by_label_and_errors(workload, tmp_path):
    path, _, _ = workload
    runner = CliRunner()
    out = runner.invoke(app, ["analyze", str(path), "--by", "label:workload", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["culprits"] == ["code"]
    text = runner.invoke(app, ["analyze", str(path), "--by", "label:workload"])
    assert text.exit_code == 0 and "culprit: code" in text.output
    assert max(len(line) for line in text.output.splitlines()) <= 80
    several = runner.invoke(app, ["analyze", str(path), "--by", "label"])
    assert several.exit_code == 2 and "choose the label" in several.output
    bad = runner.invoke(app, ["analyze", str(path), "--by", "tenant"])
    assert bad.exit_code == 2 and "--by" in bad.output
    with pytest.raises(RoutesError, match="at most 8"):
        save_routes(tmp_path / "x.json", {"a": np.tile([0, 1], (1, L, 1))}, labels={"a": {str(i): "v" for i in range(9)}})
