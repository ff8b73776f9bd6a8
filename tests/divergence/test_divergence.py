"""Divergence figures against an independent computation; alignment of traces and routes files; `moetrace diff`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis.divergence import DivergenceError, diff_sources, route_divergence
from moetrace.routes import (
    RoutesError,
    check_routes,
    load_routes,
    logical_ids,
    pad_routes,
    save_routes,
)
from moetrace.wire import encode_routed_experts
from tests.analysis.helpers import record, replay_pass

from .oracle import assert_matches_oracle, oracle, perturb, random_routes

EXPERTS, LAYERS, TOP_K = 16, 4, 3


@pytest.fixture(scope="module")
def pair() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    a = random_routes(rng, 400, LAYERS, EXPERTS, TOP_K)
    b = perturb(rng, a, EXPERTS, 0.3)
    a[:7] = -1  # tokens without routes on one side (padding)
    b[-3:, 2] = -1  # a layer without routes for some tokens
    a[:, 1][:5] = -1
    return a, b


def test_figures_equal_independent_computation_on_random_routes(pair: tuple[np.ndarray, np.ndarray]) -> None:
    a, b = pair
    result = route_divergence(a, b)
    assert_matches_oracle(result, oracle(a, b, EXPERTS))
    assert 0 < result.router_agreement < 1 and 0 < result.tokens_any_differ < 1
    assert result.tokens == 400 - 7
    # Reordered-only rows agree as sets but not in order.
    assert (result.order_agreement < result.set_agreement).all()


def test_identical_routes_agree_fully_and_batch_shape_is_flattened(pair: tuple[np.ndarray, np.ndarray]) -> None:
    a, _ = pair
    result = route_divergence(a.reshape(8, 50, LAYERS, TOP_K), a.reshape(8, 50, LAYERS, TOP_K))
    assert result.router_agreement == 1.0 and result.tokens_any_differ == 0.0
    assert (result.set_agreement == 1).all() and (result.jaccard == 1).all()
    assert result.differing_layers.tolist() == [result.tokens] + [0] * LAYERS
    assert result.top_divergent(0) == []


def test_dense_layer_is_reported_as_not_compared() -> None:
    rng = np.random.default_rng(1)
    a = random_routes(rng, 50, 3, 8, 2)
    a[:, 1] = -1  # a dense layer: no routes on either side
    b = perturb(rng, a, 8, 0.5)
    b[:, 1] = -1
    result = route_divergence(a, b, layer_ids=[0, 1, 2])
    assert result.layer_tokens[1] == 0 and np.isnan(result.set_agreement[1])
    assert result.to_dict()["layers"][1]["set_agreement"] is None
    assert_matches_oracle(result, oracle(a, b, 8))


def test_top_divergent_experts() -> None:
    a = np.array([[[0, 1]], [[0, 1]], [[2, 3]]])
    b = np.array([[[0, 5]], [[0, 5]], [[3, 2]]])
    result = route_divergence(a, b)
    assert result.top_divergent(0) == [{"expert": 1, "tokens": 2, "dropped": 2, "added": 0}, {"expert": 5, "tokens": 2, "dropped": 0, "added": 2}]
    assert result.set_agreement[0] == pytest.approx(1 / 3) and result.order_agreement[0] == 0
    assert result.jaccard[0] == pytest.approx((1 / 3 + 1 / 3 + 1) / 3)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.array([[[0, -1]]]), "mixes -1"),
        (np.array([[[2, 2]]]), "repeats an expert id"),
        (np.array([[[0, 40]]]), "physical ids"),
        (np.array([[[0.0, 1.0]]]), "integer"),
        (np.array([[[0, -3]]]), "below -1"),
    ],
)
def test_bad_routes_are_refused(bad: np.ndarray, match: str) -> None:
    with pytest.raises(DivergenceError, match=match):
        route_divergence(bad, np.zeros_like(bad), num_experts=16)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(DivergenceError, match="differ in shape"):
        route_divergence(np.tile([0, 1], (4, 2, 1)), np.tile([0, 1], (4, 3, 1)))


def test_more_than_256_experts_travel_as_16_bit_ids(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = random_routes(rng, 60, 2, 300, 4) + 0
    a[:, :, 0] = 299 - a[:, :, 0] % 40  # ids above 255 on every row
    b = perturb(rng, a, 300, 0.4)
    assert encode_routed_experts(a)["dtype"] == "uint16"
    save_routes(tmp_path / "a.json", {"r": a}, num_experts=300)
    save_routes(tmp_path / "b.json", {"r": b}, num_experts=300)
    result = diff_sources(tmp_path / "a.json", tmp_path / "b.json")
    assert_matches_oracle(result, oracle(a, b, 300))


def test_routes_files_align_by_request_and_position(tmp_path: Path) -> None:
    """Request ``x`` has one more position in A (its last token has no routes in B); B starts ``y`` at 2 (multi-turn)."""
    rng = np.random.default_rng(3)
    x, y, z = (random_routes(rng, n, LAYERS, EXPERTS, TOP_K) for n in (9, 12, 4))
    x2, y2 = perturb(rng, x, EXPERTS, 0.5), perturb(rng, y, EXPERTS, 0.5)
    save_routes(tmp_path / "a.json", {"x": x, "y": y, "z": z}, model="m", num_experts=EXPERTS)
    # B as API response bodies: request id -> {"routed_experts": payload, "start": s}.
    (tmp_path / "b.json").write_text(json.dumps({
        "x": {"routed_experts": encode_routed_experts(x2[:-1])},
        "y": {"routed_experts": encode_routed_experts(y2[2:]), "start": 2},
    }))
    result = diff_sources(tmp_path / "a.json", tmp_path / "b.json")
    expected = oracle(np.concatenate([x[:-1], y[2:]]), np.concatenate([x2[:-1], y2[2:]]), EXPERTS)
    assert_matches_oracle(result, expected)
    assert result.alignment == {
        "by": "request and position", "requests": 2, "matched_tokens": 8 + 10, "only_in_a": 1 + 2 + 4, "only_in_b": 0,
        "requests_only_in_a": 1, "requests_only_in_b": 0,
    }


def test_physical_routes_are_compared_in_logical_ids(tmp_path: Path) -> None:
    """Under a replica map two physical ids of one expert are the same logical expert."""
    phy2log = np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3]])
    a = np.array([[[0, 1], [2, 3]], [[4, 2], [1, 5]]])  # physical
    b = np.array([[[0, 5], [4, 3]], [[0, 2], [1, 3]]])  # logical (slot 5 of layer 0 is expert 1 in A's map)
    save_routes(tmp_path / "a.json", {"r": a}, id_space="physical", physical_to_logical=phy2log)
    with pytest.raises(RoutesError, match="physical_to_logical"):
        save_routes(tmp_path / "c.json", {"r": a}, id_space="physical")
    save_routes(tmp_path / "b.json", {"r": logical_ids(b, phy2log)})
    result = diff_sources(tmp_path / "a.json", tmp_path / "b.json")
    assert result.router_agreement == 1.0
    assert load_routes(tmp_path / "a.json").logical().num_experts == 4


def test_mismatched_inputs_are_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    r = random_routes(rng, 5, LAYERS, EXPERTS, TOP_K)
    save_routes(tmp_path / "a.json", {"r": r}, model="m1")
    save_routes(tmp_path / "b.json", {"r": r}, model="m2")
    save_routes(tmp_path / "k.json", {"r": r[..., :2]})
    save_routes(tmp_path / "other.json", {"q": r})
    with pytest.raises(DivergenceError, match="different models"):
        diff_sources(tmp_path / "a.json", tmp_path / "b.json")
    assert diff_sources(tmp_path / "a.json", tmp_path / "b.json", ignore_model=True).router_agreement == 1.0
    with pytest.raises(DivergenceError, match="shapes"):
        diff_sources(tmp_path / "a.json", tmp_path / "k.json")
    with pytest.raises(DivergenceError, match="no request id"):
        diff_sources(tmp_path / "a.json", tmp_path / "other.json")
    np.save(tmp_path / "x.npy", r)
    assert diff_sources(tmp_path / "x.npy", tmp_path / "x.npy").router_agreement == 1.0
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(DivergenceError, match="JSON object"):
        diff_sources(tmp_path / "a.json", tmp_path / "junk.json")


def test_pad_routes_left_and_right() -> None:
    x, y = np.tile([0, 1], (2, 1, 1)), np.tile([2, 3], (3, 1, 1))
    right, left = pad_routes([x, y]), pad_routes([x, y], side="left")
    assert right.shape == left.shape == (2, 3, 1, 2)
    assert (right[0, 2] == -1).all() and (left[0, 0] == -1).all() and (left[0, 1:] == x).all()
    check_routes(right)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[np.ndarray], list[np.ndarray]]:
    """Two per_token traces of the same passes (B perturbed), recorded by the real recorder with a replica map."""
    tmp = tmp_path_factory.mktemp("traces")
    rng = np.random.default_rng(5)
    phy2log = np.tile(np.concatenate([np.arange(EXPERTS), np.arange(4)]), (LAYERS, 1))  # 4 redundant slots
    passes_a = [random_routes(rng, int(n), LAYERS, EXPERTS, TOP_K) for n in rng.integers(1, 20, size=12)]
    passes_b = [perturb(rng, p, EXPERTS, 0.3) for p in passes_a]
    # A routes some copies of experts 0-3 through their replicas (physical slots 16-19): the same logical experts.
    passes_a_phys = [np.where((p < 4) & (rng.random(p.shape) < 0.5), p + EXPERTS, p) for p in passes_a]
    path_a = record(tmp, "per_token", passes_a_phys, EXPERTS + 4, name="a.h5", physical_to_logical=phy2log)
    path_b = record(tmp, "per_token", passes_b, EXPERTS, name="b.h5")
    return path_a, path_b, passes_a, passes_b


def test_traces_align_by_pass_and_position(traces: tuple[Path, Path, list[np.ndarray], list[np.ndarray]]) -> None:
    path_a, path_b, passes_a, passes_b = traces
    result = diff_sources(path_a, path_b)
    assert_matches_oracle(result, oracle(np.concatenate(passes_a), np.concatenate(passes_b), EXPERTS))
    assert result.alignment["only_in_a"] == result.alignment["only_in_b"] == 0


def test_cli_diff_table_and_json(traces: tuple[Path, Path, list[np.ndarray], list[np.ndarray]], tmp_path: Path) -> None:
    path_a, path_b, passes_a, passes_b = traces
    runner = CliRunner()
    out = runner.invoke(app, ["diff", str(path_a), str(path_b), "--json"])
    assert out.exit_code == 0, out.output
    figures = json.loads(out.output)
    expected = oracle(np.concatenate(passes_a), np.concatenate(passes_b), EXPERTS)
    assert figures["router_agreement"] == expected["router_agreement"]
    assert figures["differing_layers_histogram"] == expected["differing_layers"].tolist()
    table = runner.invoke(app, ["diff", str(path_a), str(path_b)])
    assert table.exit_code == 0 and "router agreement" in table.output and "same set" in table.output
    save_routes(tmp_path / "r.json", {"r": passes_a[0]})
    mixed = runner.invoke(app, ["diff", str(path_a), str(tmp_path / "r.json")])
    assert mixed.exit_code == 2 and "one input is a trace" in mixed.output
    missing = runner.invoke(app, ["diff", str(path_a), str(tmp_path / "nope.h5")])
    assert missing.exit_code == 2 and "no such" in missing.output


def test_mismatched_traces_are_refused(traces: tuple[Path, Path, list[np.ndarray], list[np.ndarray]], tmp_path: Path) -> None:
    path_a, _, passes_a, _ = traces
    per_pass = record(tmp_path, "per_pass", passes_a, EXPERTS, name="pp.h5")
    with pytest.raises(DivergenceError, match="per_token"):
        diff_sources(path_a, per_pass)
    other_layers = record(tmp_path, "per_token", passes_a, EXPERTS + 4, name="layers.h5", layer_ids=(0, 2, 4, 6),
                          physical_to_logical=np.tile(np.concatenate([np.arange(EXPERTS), np.arange(4)]), (LAYERS, 1)))
    with pytest.raises(DivergenceError, match="MoE layers"):
        diff_sources(path_a, other_layers)
    fewer_experts = record(tmp_path, "per_token", [np.minimum(p, 11) for p in passes_a], 12, name="e12.h5")
    with pytest.raises(DivergenceError, match="id spaces"):
        diff_sources(path_a, fewer_experts)


def _ranked_worker(rank: int, world: int, out: str) -> dict[str, list[np.ndarray]]:
    """Each EP rank records its own tokens of the same passes twice (run A, run B perturbed), per_token."""
    from moetrace import ExpertDistributionRecorder, RecorderConfig

    rng = np.random.default_rng(10 + rank)
    passes = {"a": [random_routes(rng, int(n), LAYERS, EXPERTS, TOP_K) for n in rng.integers(1, 9, size=5)]}
    passes["b"] = [perturb(rng, p, EXPERTS, 0.4) for p in passes["a"]]
    for run, data in passes.items():
        cfg = RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=world, ep_rank=rank, mode="per_token",
                             output_dir=out, max_tokens_per_pass=16, stream_chunk_tokens=4096, model="test-moe")
        rec = ExpertDistributionRecorder(cfg)
        rec.start_record()
        for pass_id, ids in enumerate(data):
            replay_pass(rec, ids, pass_id)
        rec.stop_record()
        rec.dump_record(Path(out) / f"{run}.h5")
    return passes


@pytest.mark.slow
def test_merged_multi_rank_traces_align_by_pass_rank_and_position(tmp_path: Path) -> None:
    from moetrace.reference import launch
    from moetrace.trace.merge import merge_traces

    results = launch(_ranked_worker, 2, str(tmp_path), backend="gloo", threads_per_rank=1)
    merged = {run: merge_traces([tmp_path / f"{run}-rank{r}.h5" for r in range(2)], tmp_path / f"{run}-merged.h5") for run in ("a", "b")}
    result = diff_sources(merged["a"], merged["b"])
    # Rows in (pass, rank) order on both sides: the same pass id and position on two ranks are different tokens.
    order = [(p, r) for p in range(5) for r in range(2)]
    a = np.concatenate([results[r]["a"][p] for p, r in order])
    b = np.concatenate([results[r]["b"][p] for p, r in order])
    assert_matches_oracle(result, oracle(a, b, EXPERTS))
    assert result.alignment["only_in_a"] == result.alignment["only_in_b"] == 0
