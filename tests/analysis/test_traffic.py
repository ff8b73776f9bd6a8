"""``moetrace traffic`` against hand counts: rank x rank copies in every mode, nodes per token on a spreading and a
local router, the what-if of a placement that keeps a group on one node, and the command's JSON and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis.traffic import inter_node_share, trace_traffic
from moetrace.placement.sglang_plan import write_sglang_plan

from .traffic_runs import (
    GPUS_PER_NODE,
    LAYER_IDS,
    NODES,
    RANKS,
    SLOTS,
    hand_count,
    local_routes,
    spread_routes,
    write_rank_traces,
)

SLOT_RANK = [slot // (SLOTS // RANKS) for slot in range(SLOTS)]
runner = CliRunner()


def _passes(router: str, seed: int = 0) -> dict[int, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    if router == "spread":
        return {rank: [spread_routes(rng, 3 + rank), spread_routes(rng, 5)] for rank in range(RANKS)}
    return {rank: [local_routes(rng, 4 + rank, rank), local_routes(rng, 2, rank)] for rank in range(RANKS)}


@pytest.mark.parametrize("mode", ["per_token", "per_pass", "stat"])
def test_rank_matrix_equals_the_hand_count_in_every_mode(tmp_path: Path, mode: str) -> None:
    passes = _passes("spread")
    passes[1][0][0, 0, 1] = -1  # padding is no copy
    result = trace_traffic(write_rank_traces(tmp_path, mode, passes), GPUS_PER_NODE)
    expected, _ = hand_count(passes, SLOT_RANK)
    assert np.array_equal(result.rank_tokens, expected)
    d = result.to_dict()
    assert d["rank_tokens"] == expected.sum(axis=0).tolist() and d["complete"] and d["sources"] == list(range(RANKS))
    assert [row["rank_tokens"] for row in d["layers"]] == expected.tolist()
    node = expected.sum(axis=0).reshape(NODES, GPUS_PER_NODE, NODES, GPUS_PER_NODE).sum(axis=(1, 3))
    assert d["node_tokens"] == node.tolist() and d["inter_node_share"] == pytest.approx(1 - np.trace(node) / node.sum())
    assert d["bytes"]["inter_node"] == 2 * (node.sum() - np.trace(node)) * 16 * 2  # seed 002: 2·copies·H·b
    assert (d["nodes_per_token"] is None) == (mode != "per_token")
    wrong, _ = hand_count(passes, [(r + 1) % RANKS for r in SLOT_RANK])  # negative control: another slot -> rank map
    assert not np.array_equal(result.rank_tokens, wrong)


@pytest.mark.parametrize("router, reached", [("spread", 2), ("local", 1)])
def test_nodes_per_token_equals_the_hand_count(tmp_path: Path, router: str, reached: int) -> None:
    passes = _passes(router)
    d = trace_traffic(write_rank_traces(tmp_path, "per_token", passes), GPUS_PER_NODE).to_dict()
    _, nodes = hand_count(passes, SLOT_RANK)
    tokens = sum(len(ids) for own in passes.values() for ids in own)
    assert [row["nodes_per_token"] for row in d["layers"]] == nodes.tolist()
    assert d["nodes_per_token"][reached] == tokens * len(LAYER_IDS) == sum(d["nodes_per_token"])  # the router's design, both ways
    assert d["remote_nodes_per_token"][reached - 1] == tokens * len(LAYER_IDS)
    dedup = np.asarray(d["node_dedup_tokens"])
    assert dedup.sum() - np.trace(dedup) == (tokens * len(LAYER_IDS) if router == "spread" else 0)  # one RDMA copy per token per remote node
    assert (d["inter_node_share"] == 0.0) == (router == "local")


def _hand_share(passes: dict[int, list[np.ndarray]], recorded: np.ndarray, plan: np.ndarray) -> float:
    """Inter-node share of the recorded routes (physical ids under ``recorded [P]``) moved onto ``plan [P]`` (no replicas), by loops."""
    node_of_expert = {int(plan[slot]): SLOT_RANK[slot] // GPUS_PER_NODE for slot in range(SLOTS)}
    inter = total = 0
    for source, own in passes.items():
        for ids in own:
            for slot in ids.ravel():
                total += 1
                inter += node_of_expert[int(recorded[slot])] != source // GPUS_PER_NODE
    return inter / total


def test_a_plan_that_keeps_each_group_on_one_node_lowers_the_share_by_the_hand_computed_amount(tmp_path: Path) -> None:
    # Groups of 4 experts: node-0 ranks route to group 0 (experts 0-3), node-1 ranks to group 1. The recorded placement
    # interleaves the groups over the nodes; the plan keeps each group on one node (slot p holds expert p).
    recorded = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    logical = _passes("local", seed=1)  # ids 0-3 from node 0's ranks, 4-7 from node 1's: read as experts of the own node's group
    physical = {rank: [np.argsort(recorded)[ids] for ids in own] for rank, own in logical.items()}  # slot holding each expert
    paths = write_rank_traces(tmp_path, "per_token", physical, phy2log=np.tile(recorded, (len(LAYER_IDS), 1)))
    plan = np.tile(np.arange(SLOTS), (len(LAYER_IDS), 1))
    before = trace_traffic(paths, GPUS_PER_NODE).to_dict()["inter_node_share"]
    after = trace_traffic(paths, GPUS_PER_NODE, plan=plan).to_dict()["inter_node_share"]
    hand_before, hand_after = _hand_share(physical, recorded, recorded), _hand_share(physical, recorded, np.arange(SLOTS))
    assert before == pytest.approx(hand_before) and after == pytest.approx(hand_after) == 0.0
    assert before - after == pytest.approx(hand_before - hand_after) and hand_before > 0.4  # negative control: the recorded one is not local
    (tmp_path / "stat").mkdir()
    stat_paths = write_rank_traces(tmp_path / "stat", "stat", physical, phy2log=np.tile(recorded, (len(LAYER_IDS), 1)))
    assert trace_traffic(stat_paths, GPUS_PER_NODE, plan=plan).to_dict()["inter_node_share"] == pytest.approx(0.0)
    # The command reads the plan in moetrace's and SGLang's formats alike.
    moetrace_plan = tmp_path / "plan.json"
    moetrace_plan.write_text(json.dumps({"phy2log": plan.tolist(), "layers": list(LAYER_IDS)}))
    sglang_plan = write_sglang_plan(tmp_path / "sglang.json", plan, LAYER_IDS, max(LAYER_IDS) + 1, SLOTS)
    for plan_file in (moetrace_plan, sglang_plan):
        done = runner.invoke(app, ["traffic", *map(str, paths), "--gpus-per-node", str(GPUS_PER_NODE), "--plan", str(plan_file), "--json"])
        assert done.exit_code == 0, done.output
        assert json.loads(done.stdout)["inter_node_share"] == pytest.approx(0.0)


def test_command_json_keys_layers_and_refusals(tmp_path: Path) -> None:
    passes = _passes("spread")
    paths = write_rank_traces(tmp_path, "per_token", passes)
    done = runner.invoke(app, ["traffic", *map(str, paths), "--gpus-per-node", "2", "--layers", "3", "--json"])
    assert done.exit_code == 0, done.output
    d = json.loads(done.stdout)
    assert {"rank_tokens", "node_tokens", "inter_node_share", "nodes_per_token", "layers"} <= set(d)
    expected, nodes = hand_count(passes, SLOT_RANK)
    assert [row["layer"] for row in d["layers"]] == [3] and d["rank_tokens"] == expected[1].tolist() and d["nodes_per_token"] == nodes[1].tolist()
    cases = [
        (["--gpus-per-node", "3"], "gpus_per_node=3 must divide the 4 EP ranks"),
        (["--gpus-per-node", "2", "--layers", "2"], "are not MoE layers"),
        (["--gpus-per-node", "2", "--plan", str(paths[0])], "not a readable JSON placement file"),
    ]
    for args, message in cases:
        bad = runner.invoke(app, ["traffic", *map(str, paths), *args])
        assert bad.exit_code == 2 and message in bad.output, bad.output
    twice = runner.invoke(app, ["traffic", *map(str, paths), str(paths[1]), "--gpus-per-node", "2"])
    assert twice.exit_code == 2 and "rank 1's routing is also in" in twice.output
    (tmp_path / "other").mkdir()
    other = write_rank_traces(tmp_path / "other", "per_token", {3: passes[3]})
    mixed = runner.invoke(app, ["traffic", *map(str, paths[:3]), str(other[0]), "--gpus-per-node", "2"])
    assert mixed.exit_code == 2 and "give the traces of one run" in mixed.output
    partial = json.loads(runner.invoke(app, ["traffic", *map(str, paths[:3]), "--gpus-per-node", "2", "--json"]).stdout)
    assert not partial["complete"] and partial["sources"] == [0, 1, 2]


def test_inter_node_share_of_an_empty_matrix_is_none() -> None:
    assert inter_node_share(np.zeros((2, 2))) is None and inter_node_share(np.array([[1, 1], [0, 2]])) == 0.25


def test_placement_reports_the_inter_node_share_of_the_plan_beside_the_current_one(tmp_path: Path) -> None:
    recorded = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # the groups interleaved over the nodes, as in the what-if above
    physical = {rank: [np.argsort(recorded)[ids] for ids in own] for rank, own in _passes("local", seed=2).items()}
    paths = write_rank_traces(tmp_path, "per_pass", physical, phy2log=np.tile(recorded, (len(LAYER_IDS), 1)))
    out = tmp_path / "plan.json"
    done = runner.invoke(app, ["placement", *map(str, paths), "--gpus", "4", "--nodes", "2", "--groups", "2", "--json", "-o", str(out)])
    assert done.exit_code == 0, done.output
    shares = json.loads(done.stdout)["inter_node_share"]
    assert shares["current"] == pytest.approx(trace_traffic(paths, GPUS_PER_NODE).to_dict()["inter_node_share"]) and shares["current"] > 0.4
    replayed = runner.invoke(app, ["traffic", *map(str, paths), "--gpus-per-node", "2", "--plan", str(out), "--json"])
    assert shares["plan"] == pytest.approx(json.loads(replayed.stdout)["inter_node_share"])
    assert shares["plan"] == pytest.approx(0.0)  # hierarchical: each group's experts on one node, and each node's ranks route to its own group
    text = runner.invoke(app, ["placement", *map(str, paths), "--gpus", "4", "--nodes", "2", "--groups", "2"], env={"COLUMNS": "1000"}).stdout
    assert f"inter-node share of token copies: current {shares['current']:.0%}, plan 0%" in text
    one_node = runner.invoke(app, ["placement", *map(str, paths), "--gpus", "4", "--json"])
    assert json.loads(one_node.stdout)["inter_node_share"] is None  # negative control: nothing to compare on one node


def test_chunks_smaller_than_a_pass_give_the_same_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token rows read 64 at a time (passes of 150 tokens split over chunks) give what one chunk gives, with a plan too."""
    from moetrace.analysis import traffic

    rng = np.random.default_rng(9)
    passes = {rank: [spread_routes(rng, 150), local_routes(rng, 150, rank)] for rank in range(RANKS)}
    paths = write_rank_traces(tmp_path, "per_token", passes)
    plan = np.tile(np.array([0, 4, 1, 5, 2, 6, 3, 7]), (len(LAYER_IDS), 1))
    whole = [trace_traffic(paths, GPUS_PER_NODE, plan=p).to_dict() for p in (None, plan)]
    monkeypatch.setattr(traffic, "TOKEN_CHUNK_CELLS", 1)  # the floor: 64 tokens a chunk
    chunked = [trace_traffic(paths, GPUS_PER_NODE, plan=p).to_dict() for p in (None, plan)]
    assert chunked == whole
    expected, nodes = hand_count(passes, SLOT_RANK)
    assert whole[0]["rank_tokens"] == expected.sum(axis=0).tolist() and whole[0]["nodes_per_token"] == nodes.sum(axis=0).tolist()
    assert whole[1]["inter_node_share"] != whole[0]["inter_node_share"]  # negative control: the plan changes the answer


@pytest.mark.parametrize("mode", ["per_token", "per_pass", "stat"])
def test_phase_keeps_the_passes_of_one_pass_phase(tmp_path: Path, mode: str) -> None:
    rng = np.random.default_rng(11)
    passes = {rank: [spread_routes(rng, 5), local_routes(rng, 3 + rank, rank)] for rank in range(RANKS)}
    paths = write_rank_traces(tmp_path, mode, passes, phases=["prefill", "decode"])
    for phase, index in (("prefill", 0), ("decode", 1)):
        expected, _ = hand_count({rank: [own[index]] for rank, own in passes.items()}, SLOT_RANK)
        assert trace_traffic(paths, GPUS_PER_NODE, phase=phase).rank_tokens.tolist() == expected.tolist(), phase
    assert trace_traffic(paths, GPUS_PER_NODE, phase="decode").to_dict()["inter_node_share"] == 0.0  # the local passes only


def test_tp_attention_counts_each_token_group_once(tmp_path: Path) -> None:
    """Four ranks of one TP group route the same tokens: rank 0's file is the one counted, the others replicate it."""
    own = [spread_routes(np.random.default_rng(4), 6)]
    paths = write_rank_traces(tmp_path, "per_pass", {rank: own for rank in range(RANKS)}, tp_attention=True)
    result = trace_traffic(paths, GPUS_PER_NODE)
    expected, _ = hand_count({0: own}, SLOT_RANK)
    assert result.sources == (0,) and result.complete and result.rank_tokens.tolist() == expected.tolist()
    assert trace_traffic(paths[1:], GPUS_PER_NODE).sources == (1,)  # negative control: without rank 0, rank 1 is the view counted
