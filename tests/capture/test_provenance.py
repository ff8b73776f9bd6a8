"""Provenance of returned routes, replay's weight-version refusal, and the capturer's live row checks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from moetrace.exporters import route_checks as route_check_metrics
from prometheus_client import generate_latest

from moetrace import ExpertDistributionRecorder
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.provenance import ProvenanceError, RouteProvenance, check_weight_version
from moetrace.reference import ModelConfig, ReferenceMoEModel, Request, ServingLoop, replay
from moetrace.replay import ReplayError
from moetrace.route_checks import ROW_CHECKS, row_faults
from moetrace.routes import RoutesError, load_routes, save_routes
from moetrace.wire import decode_routed_experts, encode_routed_experts

CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=3, num_experts=6, top_k=2, dense_layers=(1,), seed=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[ReferenceMoEModel, list, ServingLoop, str]:
    """Six requests served while a recorder records: results carry the recorder's run id, rank and weight version."""
    model = ReferenceMoEModel(CONFIG)
    recorder = ExpertDistributionRecorder(model.recorder_config(mode="stat", output_dir=str(tmp_path_factory.mktemp("rec"))))
    loop = ServingLoop(model, max_running=3, max_tokens_per_pass=16, chunk_size=4, num_kv_slots=128, max_len=32, recorder=recorder,
                       weight_version="step-3")
    rng = np.random.default_rng(0)
    recorder.start_record()
    results = loop.run([Request(f"q{i}", rng.integers(0, 64, 3 + i).tolist(), 2, arrival_step=i, return_routed_experts=True)
                        for i in range(6)])
    recorder.stop_record()
    return model, results, loop, recorder.run_id


def test_results_say_where_their_routes_come_from(served) -> None:
    _, results, _, run_id = served
    assert run_id and {r.provenance for r in results} == {RouteProvenance(run_id=run_id, rank=0, weight_version="step-3", attempt=0)}


def test_provenance_round_trips_and_keeps_the_wire_compact(served, tmp_path: Path) -> None:
    _, results, _, _ = served
    routes = results[0].routed_experts
    plain, tagged = encode_routed_experts(routes), encode_routed_experts(routes, results[0].provenance)
    assert tagged["dtype"] == plain["dtype"] == "int8" and tagged["data"] == plain["data"]  # ids encoded exactly as before
    assert tagged["provenance"] == results[0].provenance.to_dict()
    np.testing.assert_array_equal(decode_routed_experts(tagged), routes)
    per_request = save_routes(tmp_path / "each.json", {r.rid: r.routed_experts for r in results}, num_experts=6,
                              provenance={r.rid: r.provenance.replace(attempt=i) for i, r in enumerate(results)})
    assert [load_routes(per_request).provenance[r.rid].attempt for r in results] == list(range(6))
    shared = save_routes(tmp_path / "one.json", {"a": routes}, provenance=results[0].provenance)
    assert load_routes(shared).provenance == {"a": results[0].provenance}
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps(tagged))
    assert load_routes(payload).provenance == {"0": results[0].provenance}
    old = save_routes(tmp_path / "old.json", {"a": routes})  # written without provenance: still loads, nothing recorded
    assert load_routes(old).provenance == {}
    body = json.loads(shared.read_text())
    body["provenance"]["weight"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(body))
    with pytest.raises(RoutesError, match="unknown fields"):
        load_routes(tmp_path / "bad.json")


def test_check_weight_version_decides_and_says_how(caplog) -> None:
    mine = RouteProvenance(weight_version="w1")
    assert check_weight_version(mine, None) == "unchecked"
    assert check_weight_version(mine, "w1") == "match"
    with pytest.raises(ProvenanceError, match="'w1' but 'w2' was expected"):
        check_weight_version(mine, "w2")
    assert check_weight_version(mine, "w2", allow_other=True) == "other"
    with caplog.at_level(logging.WARNING, logger="moetrace.provenance"):
        assert check_weight_version(None, "w2") == "assumed"
    assert "assumed to be of weight version 'w2'" in caplog.text
    with pytest.raises(ProvenanceError):
        RouteProvenance(rank=-2)


def test_replay_refuses_routes_of_another_weight_version(served, tmp_path: Path) -> None:
    model, results, _, _ = served
    first = min(results, key=lambda r: r.rid)
    path = save_routes(tmp_path / "r.json", {first.rid: first.routed_experts}, num_experts=6, provenance={first.rid: first.provenance})
    ids = torch.tensor([first.routed_experts.shape[0] * [0]])
    with pytest.raises(ReplayError, match="weight version 'step-3' but 'step-4'"):
        replay(model, path, weight_version="step-4")
    with pytest.raises(ReplayError, match="weight version 'step-3' but 'step-4'"):
        replay(model, encode_routed_experts(first.routed_experts, first.provenance), weight_version="step-4")
    for routes, kwargs in ((path, {"weight_version": "step-3"}), (path, {"weight_version": "step-4", "allow_other_weight_version": True}),
                           (first.routed_experts, {"weight_version": "step-4"})):  # an array records no version: assumed
        with replay(model, routes, **kwargs) as handle, torch.no_grad():
            model(ids)
        assert handle.audit_report().ok


def test_capturer_checks_each_request_it_hands_out(served) -> None:
    _, results, loop, _ = served
    counts = loop.capturer.row_checks.snapshot()
    rows = sum(r.routed_experts.shape[0] for r in results) * CONFIG.num_layers
    assert counts == {"requests": 6, "rows": rows, "requests_failed": 0, "failed": dict.fromkeys(ROW_CHECKS, 0)}
    # a capture whose ids are wrong, one kind per layer (out of range, a duplicate, zeros; layer 3 never captured)
    capturer = RoutedExpertsCapturer(4, 2, 8, 16, num_experts=6, routed_layers=[0, 1, 2, 3])
    capturer.capture(0, torch.tensor([[0, 1], [2, 9], [3, 4]]))
    capturer.capture(1, torch.tensor([[5, 5], [1, 2], [3, 4]]))
    capturer.capture(2, torch.tensor([[0, 0], [0, 0], [1, 2]]))
    capturer.on_forward_end([5, 6, 7])
    got = capturer.get_routed_experts(torch.tensor([[5, 6, 7]]), 0, 3)
    expected = {check: int(mask.sum()) for check, mask in row_faults(got, num_experts=6, routed_layers=[0, 1, 2, 3]).items()}
    assert expected == {"zero_row": 2, "missing_layer": 3, "partial_row": 0, "out_of_range": 1, "duplicate": 1}
    assert capturer.row_checks.snapshot() == {"requests": 1, "rows": 12, "requests_failed": 1, "failed": expected}
    text = generate_latest(route_check_metrics.register(capturer)).decode()
    assert 'moetrace_routes_failed_rows_total{check="missing_layer"} 3.0' in text
    assert "moetrace_routes_checked_rows_total 12.0" in text and "moetrace_routes_failed_requests_total 1.0" in text
    # negative control: each check off lets exactly its rows through
    for check in ROW_CHECKS:
        rest = row_faults(got, num_experts=6, routed_layers=[0, 1, 2, 3], checks=[c for c in ROW_CHECKS if c != check])
        assert check not in rest and all(int(rest[c].sum()) == expected[c] for c in rest)


def test_row_check_definitions_are_disjoint_where_they_could_overlap() -> None:
    rows = np.array([[[0, 0], [-1, -1], [-1, 3], [7, 1], [4, 4]]])
    faults = row_faults(rows, num_experts=6, routed_layers=[0, 1, 2, 3, 4])
    assert {c: faults[c][0].nonzero()[0].tolist() for c in ROW_CHECKS} == {
        "zero_row": [0], "missing_layer": [1], "partial_row": [2], "out_of_range": [3], "duplicate": [4],
    }
    assert not row_faults(rows, routed_layers=None)["missing_layer"].any()  # dense layers legitimately read -1
