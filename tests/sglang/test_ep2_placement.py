"""A live SGLang ``tp_size=2, ep_size=2`` engine with redundant expert slots, and a placement moetrace plans for it.

The checkpoint's router is biased so that experts 0 and 1 are hot (both on rank 0 in
SGLang's trivial placement). Two engines, ``--ep-num-redundant-experts 2`` (10 physical
slots, 5 per rank), moetrace in ``per_token`` mode, the same requests one at a time:

1. trivial placement: record; ``moetrace placement --gpus 2 --slots 10 --format sglang
   -o plan.json`` on that trace;
2. restarted with ``--init-expert-location plan.json``: replay the same requests.

SGLang's CPU MoE path cannot skip the ``-1`` ids of other ranks' experts; the EP shim in
tests/sglang/shims computes each rank's local experts (after routing and dispatch: the
ids moetrace sees are untouched).

Independent count: the Hugging Face router's top-k on the same positions, put into
physical slots by SGLang's own rules: no dispatch map under the trivial placement
(logical id = slot id), and with a plan its rank-invariant dynamic dispatch (token row
``t`` of a pass goes to replica ``t mod n``; ``moetrace.placement.sglang_plan``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetrace import balance
from moetrace.analysis.traffic import trace_traffic
from moetrace.placement.plan import replicas_moved
from moetrace.placement.sglang_plan import (
    SGLANG_MAP_KEY,
    read_sglang_plan,
    rows_in_pass,
    sglang_physical_count,
)
from moetrace.trace.reader import open_trace

from ..servers import moetrace_cli
from .checkpoint import NUM_EXPERTS, NUM_LAYERS, build_checkpoint
from .engine import GENERATION, PROMPTS, engine
from .multirank import TWO_RANKS, expert_count, generate_sequentially, hf_computed_routes

pytestmark = pytest.mark.slow

RANKS, REDUNDANT = 2, 2
SLOTS = NUM_EXPERTS + REDUNDANT
HOT = (0, 1)


@dataclasses.dataclass
class Run:
    answers: list[dict[str, Any]]
    files: list[Path]  # per_token trace of rank 0, rank 1
    sglang_files: list[Path]  # SGLang's own stat recorder dumps, one per rank


def _record(checkpoint: Path, out: Path, **engine_args: Any) -> Run:
    env = {**TWO_RANKS, "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "per_token", "MOETRACE_OUTPUT_DIR": str(out),
           "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(out / "sglang")}
    args = dict(tp_size=RANKS, ep_size=RANKS, ep_num_redundant_experts=REDUNDANT, expert_distribution_recorder_mode="stat", **engine_args)
    with engine(str(checkpoint), env, **args) as llm:
        llm.start_expert_distribution_record()
        answers = generate_sequentially(llm)
        llm.stop_expert_distribution_record()
        llm.dump_expert_distribution_record()
    files = sorted(out.glob("moetrace-per_token-*.h5"), key=lambda p: p.stem.rsplit("-rank", 1)[1])
    assert len(files) == RANKS, f"a per_token dump writes one file per rank; found {files}"
    return Run(answers, files, sorted((out / "sglang").glob("*")))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3_moe_hot"), hot_experts=HOT)


@pytest.fixture(scope="module")
def trivial(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _record(checkpoint, tmp_path_factory.mktemp("trivial"))


@pytest.fixture(scope="module")
def plan(trivial: Run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``moetrace placement`` on rank 0's trace (under TP attention one rank's view is every token)."""
    out = tmp_path_factory.mktemp("plan")
    path = out / "plan.json"
    document = json.loads(moetrace_cli("placement", str(trivial.files[0]), "--gpus", str(RANKS), "--slots", str(SLOTS),
                                       "--format", "sglang", "-o", str(path), "--json"))
    return {"path": path, "document": document}


@pytest.fixture(scope="module")
def planned(checkpoint: Path, plan: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _record(checkpoint, tmp_path_factory.mktemp("planned"), init_expert_location=str(plan["path"]))


def _rows(answers: list[dict[str, Any]]) -> np.ndarray:
    """Batch row of each computed position, one request at a time: a prefill pass (rows 0..P-1), then 1-row decode passes."""
    return np.concatenate([np.r_[np.arange(len(p)), np.zeros(GENERATION["max_new_tokens"] - 1, np.int64)] for p in PROMPTS])


def _independent(checkpoint: Path, run: Run, phy2log: np.ndarray | None) -> np.ndarray:
    """Physical counts ``[L, SLOTS]`` from the Hugging Face routes and SGLang's slot rules."""
    routes = hf_computed_routes(checkpoint, run.answers)
    if phy2log is None:  # trivial location: no dispatch map, logical id = slot id; redundant slots idle
        count = np.zeros((NUM_LAYERS, SLOTS), np.int64)
        count[:, :NUM_EXPERTS] = expert_count(routes)
        return count
    return sglang_physical_count(np.concatenate(routes), _rows(run.answers), phy2log)


def _views(run: Run) -> np.ndarray:
    """Each rank's physical counts ``[R, L, SLOTS]``."""
    counts = []
    for path in run.files:
        with open_trace(path) as trace:
            counts.append(trace.physical_count())
            assert trace.num_physical_experts == SLOTS and trace.ep_size == RANKS
    return np.stack(counts)


def _realised_rank_load(run: Run) -> np.ndarray:
    """``[L, R]``: each rank's own slots in its own view (rank r computes slots [5r, 5r + 5))."""
    views = _views(run)
    return np.stack([balance.rank_load(views[r], RANKS)[:, r] for r in range(RANKS)], axis=1)


def test_each_rank_records_its_ep_coordinates(trivial: Run) -> None:
    layouts = []
    for path in trivial.files:
        with open_trace(path) as trace:
            layouts.extend(trace.layouts)
    assert [(x.rank, x.tp_rank, x.ep_rank, x.ep_size, x.tp_size, x.attention) for x in layouts] == [(0, 0, 0, 2, 2, "tp"), (1, 1, 1, 2, 2, "tp")]


def test_physical_counts_per_rank_equal_an_independent_count(checkpoint: Path, trivial: Run) -> None:
    """Trivial placement with 2 redundant slots: every rank routes every token (TP attention), rank r computes its 5 slots."""
    expected = _independent(checkpoint, trivial, None)
    views = _views(trivial)
    for view in views:
        np.testing.assert_array_equal(view, expected)
    np.testing.assert_array_equal(_realised_rank_load(trivial), balance.rank_load(expected, RANKS))
    assert (expected[:, NUM_EXPERTS:] == 0).all(), "the trivial location's redundant slots get no tokens (no dispatch map)"
    hot_share = expected[:, list(HOT)].sum() / expected.sum()
    assert hot_share > 0.4, f"the biased router makes experts {HOT} hot ({hot_share:.2f} of the assignments)"


def test_the_plan_is_what_sglang_loads(plan: dict[str, Any], planned: Run) -> None:
    """plan.json holds SGLang's one key, a full [layers, slots] map; the restarted engine runs on exactly that map."""
    document = json.loads(plan["path"].read_text())
    assert list(document) == [SGLANG_MAP_KEY]
    mapping = read_sglang_plan(plan["path"], NUM_EXPERTS)
    assert mapping.shape == (NUM_LAYERS, SLOTS)
    np.testing.assert_array_equal(mapping, np.asarray(plan["document"]["phy2log"]))
    for path in planned.files:  # the engine's ExpertLocationMetadata, as the adapter read it
        with open_trace(path) as trace:
            np.testing.assert_array_equal(trace.physical_to_logical, mapping)


def test_outputs_are_unchanged_by_the_placement(trivial: Run, planned: Run) -> None:
    """Experts moved between ranks still compute the same model (SGLang loaded each slot's weights by the plan)."""
    assert [a["output_ids"] for a in planned.answers] == [a["output_ids"] for a in trivial.answers]


def test_realised_balance_equals_the_prediction_and_beats_trivial(checkpoint: Path, trivial: Run, plan: dict[str, Any], planned: Run) -> None:
    mapping = read_sglang_plan(plan["path"], NUM_EXPERTS)
    expected = _independent(checkpoint, planned, mapping)
    views = _views(planned)
    for view in views:  # counts under the plan equal the independent count, slot by slot
        np.testing.assert_array_equal(view, expected)
    realised = _realised_rank_load(planned)
    predicted = balance.rank_load(sglang_physical_count(_tokens(trivial.files[0]), _trace_rows(trivial.files[0]), mapping), RANKS)
    np.testing.assert_array_equal(realised, predicted)  # predicted from the recorded passes, before the restart
    trivial_balance = balance.balancedness(_realised_rank_load(trivial))
    assert balance.balancedness(realised) > trivial_balance
    assert plan["document"]["in_sample"]["balancedness"]["current"] == pytest.approx(trivial_balance)
    trivial_map = np.tile(np.arange(SLOTS) % NUM_EXPERTS, (NUM_LAYERS, 1))
    moved = replicas_moved(trivial_map, mapping, RANKS)
    assert moved > 0
    even_split = plan["document"]["in_sample"]["balancedness"]["moetrace"]
    print(f"\nrank balancedness on the same requests: trivial (measured) {trivial_balance:.3f} | planner's prediction (even split "
          f"over replicas) {even_split:.3f} | prediction with SGLang's replica pick {balance.balancedness(predicted):.3f} | "
          f"realised with the plan {balance.balancedness(realised):.3f} | replicas moved {moved}")
    for layer in range(NUM_LAYERS):
        print(f"layer {layer}: slots of rank 0 {mapping[layer, :5].tolist()} rank 1 {mapping[layer, 5:].tolist()}; "
              f"load trivial {_realised_rank_load(trivial)[layer].tolist()} predicted {predicted[layer].tolist()} realised {realised[layer].tolist()}")


def test_traffic_equals_sglangs_own_count_and_the_hf_count(checkpoint: Path, trivial: Run, plan: dict[str, Any], planned: Run) -> None:
    """``moetrace traffic`` of both ranks' traces, one rank a node: under TP attention rank 1 routes rank 0's tokens and is
    not counted (one source row); the copies to each rank equal SGLang's own recorder (trivial location: slot = expert)
    and the Hugging Face router's count put into slots; the what-if of the trivial run on the plan equals the planned run."""
    result = trace_traffic(trivial.files, 1)
    assert result.sources == (0,) and result.complete and not result.rank_tokens[:, 1].any()
    sglang = np.pad(_sglang_own_count(trivial), ((0, 0), (0, REDUNDANT)))  # trivial location: slot = expert, redundant slots idle
    np.testing.assert_array_equal(result.rank_tokens[:, 0], balance.rank_load(sglang, RANKS))
    np.testing.assert_array_equal(result.rank_tokens[:, 0], balance.rank_load(_independent(checkpoint, trivial, None), RANKS))
    assert 0 < result.to_dict()["inter_node_share"] < 1  # negative control: copies go to both ranks
    mapping = read_sglang_plan(plan["path"], NUM_EXPERTS)
    live = trace_traffic(planned.files, 1).rank_tokens
    np.testing.assert_array_equal(live[:, 0], balance.rank_load(_independent(checkpoint, planned, mapping), RANKS))
    predicted = trace_traffic(trivial.files, 1, plan=mapping).rank_tokens  # token rows pick replicas as SGLang does
    np.testing.assert_array_equal(predicted, live)
    assert not np.array_equal(predicted, result.rank_tokens)  # the plan moved copies between the ranks


def _sglang_own_count(run: Run) -> np.ndarray:
    """``[L, E]`` from SGLang's own ``stat`` recorder: with EP one rank dumps the TP group's all-reduced count (each of the
    ``RANKS`` ranks routed every token under TP attention, so it holds ``RANKS`` x the count)."""
    import torch

    (dump,) = run.sglang_files
    total = torch.load(dump, weights_only=True)["logical_count"].numpy().sum(axis=0)
    assert (total % RANKS == 0).all()
    return total // RANKS


def _tokens(path: Path) -> np.ndarray:
    """Logical ids ``[T, L, k]`` of a per_token trace (its ids are physical: mapped through its own map)."""
    with open_trace(path) as trace:
        ids = np.concatenate([c.topk_ids for c in trace.iter_tokens()]).astype(np.int64)
        mapping = trace.physical_to_logical
    return np.where(ids >= 0, mapping[np.arange(NUM_LAYERS)[None, :, None], np.maximum(ids, 0)], -1)


def _trace_rows(path: Path) -> np.ndarray:
    with open_trace(path) as trace:
        return rows_in_pass(np.concatenate([c.pass_id for c in trace.iter_tokens()]))
