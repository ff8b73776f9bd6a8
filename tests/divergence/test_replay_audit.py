"""The replay audit on the Hugging Face and reference replays: used == requested, read at the experts' input.

Megatron's replay audit is tested on real gloo ranks in tests/megatron/test_replay.py.
Each positive check has its negative control: a layer the forward never reaches fails
the forward, and experts called with other ids than the replayed ones lower the share.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moetrace.adapters import hf

from moetrace.reference import ModelConfig, ReferenceMoEModel, replay
from moetrace.replay_audit import ReplayAudit, ReplayUnreachedError
from moetrace.routes import save_routes
from moetrace.testing import assert_no_host_sync
from tests.adapters.hf_models import FAMILIES, VOCAB

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2, dense_layers=(1,), seed=3)


def _forced(shape: tuple[int, ...], layers: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((*shape, layers, experts)), axis=-1)[..., :top_k].astype(np.int64)


def _ids(batch: int = 2, length: int = 7, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def mixtral() -> torch.nn.Module:
    return FAMILIES["mixtral"].build()


def test_hf_forced_routes_are_used_exactly_and_counted_once_under_checkpointing(mixtral: torch.nn.Module) -> None:
    ids = _ids()
    forced = _forced(ids.shape, 2, 8, 2)
    mixtral.train()
    mixtral.activation_checkpointing_enable()  # the blocks run again inside backward: audited once
    try:
        with hf.replay(mixtral, forced) as handle:
            mixtral(ids, labels=ids, use_cache=False).loss.backward()
            report = handle.audit_report()
    finally:
        mixtral.activation_checkpointing_disable()
        mixtral.eval()
        mixtral.zero_grad()
    assert report.ok and report.share == 1.0 and report.forwards == 1
    assert report.requested.tolist() == [ids.numel()] * 2 and report.matched.tolist() == [ids.numel()] * 2
    assert report.check() is report


def test_hf_experts_called_with_other_ids_lower_the_share(mixtral: torch.nn.Module) -> None:
    """Negative control: what the experts are called with is what the audit reads, not what replay asked."""
    ids = _ids()
    forced = _forced(ids.shape, 2, 8, 2, seed=1)
    experts = hf.find_moe_sites(mixtral)[0].module

    def shift(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        hidden, index, weights = args
        return (hidden, (index + 1) % 8, weights), kwargs

    tamper = experts.register_forward_pre_hook(shift, with_kwargs=True)
    try:
        with hf.replay(mixtral, forced) as handle, torch.no_grad():
            mixtral(ids)
        report = handle.audit_report()
    finally:
        tamper.remove()
    assert report.matched.tolist() == [0, ids.numel()] and report.share == 0.5 and not report.ok
    with pytest.raises(AssertionError, match="did not use the requested experts"):
        report.check()


def test_hf_a_router_never_reached_fails_the_forward(mixtral: torch.nn.Module) -> None:
    ids = _ids()
    layers = mixtral.model.layers
    with hf.replay(mixtral, _forced(ids.shape, 2, 8, 2)) as handle:
        mixtral.model.layers = torch.nn.ModuleList(list(layers)[:1])  # the second MoE layer never runs
        try:
            with pytest.raises(ReplayUnreachedError, match="never reached the router of"), torch.no_grad():
                mixtral(ids)
        finally:
            mixtral.model.layers = layers
    report = handle.audit_report()
    assert report.unreached == ("model.layers.1.mlp.experts",) and not report.ok


def test_hf_router_hooked_family_is_checked_for_reach_only() -> None:
    model = FAMILIES["llama4"].build()
    family = FAMILIES["llama4"]
    ids = _ids()
    with hf.replay(model, _forced(ids.shape, len(family.layer_ids), family.num_experts, family.top_k)) as handle, torch.no_grad():
        model(ids)
    report = handle.audit_report()
    assert report.ok and report.requested.sum() == 0 and len(report.to_dict()["unobserved"]) == len(family.layer_ids)


def test_reference_forced_routes_from_a_routes_file_are_used_exactly(tmp_path) -> None:
    model = ReferenceMoEModel(CONFIG)
    ids = _ids(batch=1)
    forced = _forced((ids.shape[1],), 2, 8, 2)  # one request [S, MoE layers, k]
    path = save_routes(tmp_path / "routes.json", {"r0": forced}, num_experts=8)
    with replay(model, str(path)) as handle, torch.no_grad():
        model(ids)
        model(ids)
    report = handle.audit_report()
    assert report.ok and report.forwards == 2 and report.matched.tolist() == [2 * ids.numel()] * 2


def test_reference_unreached_router_fails_and_partial_rows_are_not_audited() -> None:
    model = ReferenceMoEModel(CONFIG)
    ids = _ids()
    forced = _forced(ids.shape, 2, 8, 2)
    forced[:, -1] = -1  # the last position keeps its own top-k
    blocks = model.blocks
    with replay(model, forced) as handle, torch.no_grad():
        model(ids)
        model.blocks = torch.nn.ModuleList(list(blocks)[:2])  # model layer 2 (MoE layer 1) never runs
        try:
            with pytest.raises(ReplayUnreachedError, match="MoE layer 1"):
                model(ids)
        finally:
            model.blocks = blocks
    report = handle.audit_report()
    rows = ids.shape[0] * (ids.shape[1] - 1)
    assert report.requested.tolist() == [2 * rows, 2 * rows] and report.matched.tolist() == [2 * rows, rows]
    assert report.unreached == ("MoE layer 1 (model layer 2)",)


def test_audit_observation_does_not_sync() -> None:
    audit = ReplayAudit(["a"], "cpu")
    ids = torch.tensor([[0, 1], [2, 3]])
    valid = torch.ones(2, 1, dtype=torch.bool)
    with assert_no_host_sync():
        audit.observe_ids(0, ids.flip(-1), ids, valid)  # the same set in another order matches
        audit.observe_map(0, torch.zeros(2, 8, dtype=torch.bool).scatter(1, ids, True), ids, valid, 2)
    assert audit.report().matched.tolist() == [4]


def _captured(model: ReferenceMoEModel, ids: torch.Tensor) -> np.ndarray:
    """MoE-layer routes ``[S, L_moe, k]`` of a batch-1 forward, captured by the capturer (not the replay)."""
    from moetrace.capturer import RoutedExpertsCapturer

    length = ids.shape[1]
    capturer = RoutedExpertsCapturer(CONFIG.num_layers, CONFIG.top_k, length, length)
    with torch.no_grad():
        model(ids, capturer=capturer)
    capturer.on_forward_end(torch.arange(length))
    routes = capturer.get_routed_experts(torch.arange(length).view(1, length), 0, length).astype(np.int64)
    return routes[:, list(model.moe_layer_ids)]


def test_diff_replay_audit_and_the_metric(tmp_path) -> None:
    from moetrace.cli.app import app
    from moetrace.exporters import replay_audit as audit_metrics
    from prometheus_client import generate_latest
    from typer.testing import CliRunner

    model = ReferenceMoEModel(CONFIG)
    ids = _ids(batch=1)
    forced = _forced((ids.shape[1],), 2, 8, 2, seed=4)
    with replay(model, forced) as handle:
        used = _captured(model, ids)
        scrape = generate_latest(audit_metrics.register(handle)).decode()
    assert 'moetrace_replay_match_ratio{engine="reference"} 1.0' in scrape
    assert 'moetrace_replay_matched_rows_total{engine="reference",layer="MoE layer 1 (model layer 2)"} 7.0' in scrape
    requested = save_routes(tmp_path / "requested.json", {"r": forced}, num_experts=8)
    runner = CliRunner()

    def audit(routes: np.ndarray, name: str) -> tuple[int, str]:
        path = save_routes(tmp_path / f"{name}.json", {"r": routes}, num_experts=8)
        result = runner.invoke(app, ["diff", str(requested), str(path), "--replay-audit", "--json"])
        return result.exit_code, result.output

    code, out = audit(used, "used")
    assert code == 0 and '"share": 1.0' in out
    wrong = used.copy()
    wrong[:3, 0] = (wrong[:3, 0] + 1) % 8  # three rows of layer 0 used other experts
    code, out = audit(wrong, "wrong")
    assert code == 1 and '"matched": 4' in out
    unreached = used.copy()
    unreached[:, 1] = -1  # layer 1 never took routes
    code, out = audit(unreached, "unreached")
    assert code == 1 and '"unreached": [\n    "1"' in out
