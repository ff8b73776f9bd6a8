"""``moetrace audit``: the routes a serving loop returned against what it computed, faults planted and named.

One honest run of the reference serving loop (continuous batching, chunked prefill,
interleaved requests) serves every test of the module. Each fault kind is planted in
a seeded random subset of requests: the audit names it in every affected request and
in no other, and exits 1; with its check turned off (and the ``mismatch`` fallback)
the same routes pass, so each check is what catches its fault (negative control).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder
from moetrace.analysis.route_audit import (
    FAULTS,
    AuditError,
    audit_routes,
    routeset_source,
    trace_source,
)
from moetrace.analysis.route_faults import INJECTABLE, inject_faults
from moetrace.reference import ModelConfig, ReferenceMoEModel, Request, ServingLoop, zipf_bias
from moetrace.routes import RouteSet, save_routes
from moetrace.wire import encode_routed_experts

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_experts=8, top_k=2,
                     dense_layers=(1,), router_bias=tuple(zipf_bias(8, 0.5, seed=2).tolist()), seed=7)
MOE = [0, 2, 3]
VERSION = "w7"
runner = CliRunner()


def _requests(count: int = 20, seed: int = 4) -> list[Request]:
    """Interleaved requests, a third sharing a 6-token prefix, prompts longer than the chunk, some prefill-only."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, CONFIG.vocab_size, 6).tolist()
    out = []
    for i in range(count):
        prompt = rng.integers(0, CONFIG.vocab_size, int(rng.integers(2, 20))).tolist()
        if i % 3 == 0:
            prompt = prefix + prompt
        out.append(Request(f"req-{i}", prompt, 0 if i % 7 == 0 else int(rng.integers(1, 6)), arrival_step=int(rng.integers(0, 6)),
                           return_routed_experts=True))
    return out


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> tuple[RouteSet, RouteSet, Path]:
    """``(returned, recorded, trace)``: the loop's returned routes (model layers, with provenance), the same over MoE
    layers, and the recorder's ``per_token`` trace of the run (rows tied to requests by the loop's batches)."""
    model = ReferenceMoEModel(CONFIG)
    recorder = ExpertDistributionRecorder(model.recorder_config(mode="per_token", output_dir=str(tmp_path_factory.mktemp("trace"))))
    loop = ServingLoop(model, max_running=6, max_tokens_per_pass=24, chunk_size=8, num_kv_slots=400, max_len=48, weight_version=VERSION,
                       recorder=recorder)
    recorder.start_record()
    results = loop.run(_requests())
    trace = recorder.dump_record()
    recorder.stop_record()
    assert loop.capturer is not None and loop.capturer.row_checks.snapshot()["requests_failed"] == 0
    assert {r.provenance.run_id for r in results} == {recorder.run_id}
    returned = RouteSet({r.rid: (r.routed_experts_start, r.routed_experts) for r in results}, num_experts=CONFIG.num_experts,
                        provenance={r.rid: r.provenance for r in results})
    recorded = RouteSet({r.rid: (0, r.routed_experts[:, MOE].astype(np.int64)) for r in results}, num_experts=CONFIG.num_experts, layer_ids=MOE)
    return returned, recorded, Path(trace)


@pytest.fixture(scope="module")
def trace_side(honest):
    """The recorder's side read from the trace alone (what ``moetrace audit TRACE`` compares with)."""
    return trace_source([honest[2]])


def test_honest_routes_pass(honest, trace_side) -> None:
    """The routes the loop returned equal, request by request and position by position, the rows its trace holds."""
    returned, _, _ = honest
    report = audit_routes(returned, trace_side, weight_version=VERSION)
    figures = report.to_dict()
    assert report.ok and figures["requests"] == 20 and figures["faults"] == {} and figures["recorded_only_requests"] == 0
    assert figures["compared_rows"] == figures["matched_rows"] == sum(len(a) for _, a in returned.requests.values()) * len(MOE)
    assert [layer["layer_id"] for layer in figures["layers"]] == MOE
    assert all(r["weight_version"] == "match" for r in figures["per_request"])
    # the returned routes' provenance names this trace's run (the recorder's hooks wrote it, the capturer the answers)
    assert trace_side.run_id == next(iter(returned.provenance.values())).run_id
    # read three requests at a time (bounded memory): the same figures
    grouped = audit_routes(returned, trace_source([honest[2]], group=3), weight_version=VERSION).to_dict()
    assert grouped == figures


@pytest.mark.parametrize("kind", INJECTABLE)
def test_each_fault_is_named_in_every_affected_request_and_no_other(honest, trace_side, kind: str) -> None:
    returned, _, _ = honest
    source = trace_side
    faulty, affected = inject_faults(returned, kind, rng=np.random.default_rng(sum(map(ord, kind))), fraction=0.3,
                                     num_experts=CONFIG.num_experts, routed_layers=MOE)
    assert 2 <= len(affected) < len(returned.requests)
    report = audit_routes(faulty, source, weight_version=VERSION)
    failed = {r.request: set(r.faults) for r in report.failed}
    assert set(failed) == set(affected.values()), kind
    assert all(names == {kind} for names in failed.values()), failed
    assert not report.ok
    if kind == "foreign":
        assert all(r.foreign_of for r in report.failed)
    if kind == "shifted":
        assert {r.shift for r in report.failed} == {1}
    # negative control: without this check (and the catch-all comparison) the same routes pass
    unchecked = audit_routes(faulty, source, weight_version=VERSION, checks=[c for c in FAULTS if c not in (kind, "mismatch")])
    assert unchecked.ok, unchecked.fault_totals()


@pytest.mark.parametrize("kind", ["zero_row", "out_of_range", "duplicate", "shifted", "foreign"])
def test_without_its_check_a_fault_falls_to_mismatch(honest, trace_side, kind: str) -> None:
    """The comparison with the trace still catches rows whose own check is off: they differ (``mismatch``)."""
    returned, _, _ = honest
    faulty, affected = inject_faults(returned, kind, rng=np.random.default_rng(11), num_experts=CONFIG.num_experts, routed_layers=MOE)
    report = audit_routes(faulty, trace_side, checks=[c for c in FAULTS if c != kind])
    assert {r.request for r in report.failed} == set(affected.values())
    assert all(set(r.faults) == {"mismatch"} for r in report.failed)


def test_weight_version_without_provenance_is_assumed(honest) -> None:
    returned, recorded, _ = honest
    bare = RouteSet(dict(returned.requests), num_experts=CONFIG.num_experts)
    report = audit_routes(bare, routeset_source(recorded), weight_version=VERSION)
    assert report.ok and report.to_dict()["weight_version_assumed_requests"] == 20


def test_refuses_routes_of_another_model(honest, trace_side) -> None:
    returned, _, _ = honest
    other = RouteSet({rid: (s, a[..., :1]) for rid, (s, a) in returned.requests.items()})
    with pytest.raises(AuditError, match="top-2"):
        audit_routes(other, trace_side)
    with pytest.raises(AuditError, match="unknown checks"):
        audit_routes(returned, trace_side, checks=["nope"])


def _files(tmp_path: Path, returned: RouteSet, recorded: RouteSet, name: str = "returned") -> tuple[Path, Path]:
    """Returned routes as an API would hand them out (request id -> payload with provenance; faulty rows allowed) and a routes file."""
    ret = tmp_path / f"{name}.json"
    ret.write_text(json.dumps({
        rid: {"start": s, "routed_experts": encode_routed_experts(a, returned.provenance.get(rid))} for rid, (s, a) in returned.requests.items()
    }))
    rec = save_routes(tmp_path / "recorded.json", {rid: a for rid, (_, a) in recorded.requests.items()}, num_experts=CONFIG.num_experts,
                      layer_ids=MOE)
    return ret, rec


def test_cli_exit_codes_and_report(honest, tmp_path: Path) -> None:
    returned, recorded, trace = honest
    ret, rec = _files(tmp_path, returned, recorded)
    for side in (trace, rec):  # the run's trace, or a routes file as the recorded side
        ok = runner.invoke(app, ["audit", str(side), "--returned", str(ret), "--weight-version", VERSION])
        assert ok.exit_code == 0, ok.output
        assert "every returned request matches" in ok.stdout
    faulty, affected = inject_faults(returned, "duplicate", rng=np.random.default_rng(5), num_experts=CONFIG.num_experts, routed_layers=MOE)
    bad, _ = _files(tmp_path, faulty, recorded, "faulty")
    report_path = tmp_path / "report.json"
    result = runner.invoke(app, ["audit", str(trace), "-r", str(bad), "--json", "-o", str(report_path)])
    assert result.exit_code == 1, result.output
    figures = json.loads(result.stdout)
    assert figures == json.loads(report_path.read_text())
    assert figures["faults"]["duplicate"]["requests"] == len(affected)
    assert {r["request"] for r in figures["per_request"] if not r["ok"]} == set(affected)
    assert sum(layer["faults"].get("duplicate", 0) for layer in figures["layers"]) == figures["faults"]["duplicate"]["count"]
    other = runner.invoke(app, ["audit", str(rec), "-r", str(ret), "--weight-version", "w8"])
    assert other.exit_code == 1 and "other_weight_version" in other.stdout
    allowed = runner.invoke(app, ["audit", str(rec), "-r", str(ret), "--weight-version", "w8", "--allow-other-weight-version"])
    assert allowed.exit_code == 0, allowed.output
    skipped = runner.invoke(app, ["audit", str(rec), "-r", str(bad), "--skip", "duplicate", "--skip", "mismatch"])
    assert skipped.exit_code == 0, skipped.output


def test_cli_reads_sglang_answers(honest, tmp_path: Path) -> None:
    """SGLang's answers (``meta_info['routed_experts']``: base64 of int32 ``[positions, model layers, k]``) as returned routes."""
    import base64

    returned, recorded, _ = honest
    _, rec = _files(tmp_path, returned, recorded)
    answers = [{"text": "", "meta_info": {"id": rid, "routed_experts": base64.b64encode(a.astype("<i4").tobytes()).decode()}}
               for rid, (_, a) in returned.requests.items()]
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(answers))
    result = runner.invoke(app, ["audit", str(rec), "-r", str(path), "--model-layers", str(CONFIG.num_layers)])
    assert result.exit_code == 0, result.output
    zeroed = next(a for a in answers if a["meta_info"]["id"] == "req-3")
    zeroed["meta_info"]["routed_experts"] = base64.b64encode(np.zeros_like(returned.requests["req-3"][1]).astype("<i4").tobytes()).decode()
    path.write_text(json.dumps(answers))
    result = runner.invoke(app, ["audit", str(rec), "-r", str(path), "--json"])
    assert result.exit_code == 1
    figures = json.loads(result.stdout)
    assert [r["request"] for r in figures["per_request"] if not r["ok"]] == ["req-3"]
    assert set(figures["faults"]) == {"zero_row"}


def test_cli_refuses_unusable_input(honest, tmp_path: Path) -> None:
    returned, recorded, _ = honest
    ret, rec = _files(tmp_path, returned, recorded)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    for args, fragment in (
        (["audit", str(rec), "-r", str(tmp_path / "missing.json")], "no such"),
        (["audit", str(rec), "-r", str(garbage)], "garbage.json"),
        (["audit", str(rec), "-r", str(ret), "--skip", "nope"], "no such check"),
        (["audit", str(rec), "-r", str(ret), "-r", str(ret)], "already returned"),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.startswith("moetrace: error: ") and fragment in result.stderr and "Traceback" not in result.output
