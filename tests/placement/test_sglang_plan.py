"""SGLang's ``--init-expert-location`` document from a moetrace plan, and SGLang's replica pick.

The live loop (plan written, SGLang restarted with it, balance measured) is in
tests/sglang/test_ep2_placement.py; SGLang's own dispatch function is compared with
:func:`sglang_physical_count` in tests/sglang/test_plan_dispatch.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.placement.checks import PlacementError
from moetrace.placement.sglang_plan import (
    SGLANG_MAP_KEY,
    read_sglang_plan,
    rows_in_pass,
    sglang_expert_location,
    sglang_physical_count,
    write_sglang_plan,
)

from ..analysis.helpers import record

PLAN = np.array([[3, 0, 1, 2, 0, 3], [1, 2, 3, 0, 1, 1]])  # 2 planned layers, 4 experts, 6 slots


def test_document_fills_unplanned_layers_with_sglangs_trivial_row():
    document = sglang_expert_location(PLAN, layer_ids=[1, 3], num_model_layers=4, num_experts=4)
    assert list(document) == [SGLANG_MAP_KEY]
    full = np.asarray(document[SGLANG_MAP_KEY])
    np.testing.assert_array_equal(full[[1, 3]], PLAN)
    np.testing.assert_array_equal(full[[0, 2]], np.tile(np.arange(6) % 4, (2, 1)))  # what SGLang builds for "trivial"


@pytest.mark.parametrize(("plan", "layers", "model_layers", "fragment"), [
    (np.array([[0, 1, 2, 2, 1, 2]]), [0], 1, "missing [3]"),
    (np.array([[0, 1, 2, 3, 4, 1]]), [0], 1, "no other id"),
    (PLAN, [0], 2, "names 1 layers"),
    (PLAN, [0, 5], 4, "outside the model's 4 layers"),
])
def test_bad_plans_are_refused_with_the_reason(plan, layers, model_layers, fragment):
    with pytest.raises(PlacementError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        sglang_expert_location(plan, layers, model_layers, 4)


def test_written_plan_reads_back_and_needs_a_json_name(tmp_path):
    path = write_sglang_plan(tmp_path / "plan.json", PLAN, [0, 1], 2, 4)
    np.testing.assert_array_equal(read_sglang_plan(path, 4), PLAN)
    with pytest.raises(PlacementError, match="name the plan file"):
        write_sglang_plan(tmp_path / "plan.pt", PLAN, [0, 1], 2, 4)
    (tmp_path / "other.json").write_text(json.dumps({"phy2log": PLAN.tolist()}))
    with pytest.raises(PlacementError, match="not an SGLang --init-expert-location document"):
        read_sglang_plan(tmp_path / "other.json")


def test_replicas_are_picked_by_batch_row():
    """Expert 0 has slots 1 and 4 in layer 0: rows 0, 2 go to slot 1, rows 1, 3 to slot 4 (their ranks: 0 and 1 of 2)."""
    ids = np.array([[[0], [1]], [[0], [1]], [[0], [1]], [[0], [-1]]])  # [T=4, L=2, k=1]
    count = sglang_physical_count(ids, np.arange(4), PLAN)
    np.testing.assert_array_equal(count[0], [0, 2, 0, 0, 2, 0])
    np.testing.assert_array_equal(count[1], [1, 0, 0, 0, 1, 1])  # expert 1 in layer 1: slots 0, 4, 5 for rows 0, 1, 2
    count = sglang_physical_count(ids, np.zeros(4, np.int64), PLAN)  # one-row passes: always the first replica
    np.testing.assert_array_equal(count[0], [0, 4, 0, 0, 0, 0])


def test_rows_in_pass():
    np.testing.assert_array_equal(rows_in_pass(np.array([4, 4, 4, 7, 9, 9])), [0, 1, 2, 0, 0, 1])
    with pytest.raises(PlacementError, match="grouped by pass"):
        rows_in_pass(np.array([1, 2, 1]))


def test_cli_writes_the_sglang_format(tmp_path):
    rng = np.random.default_rng(3)
    passes = [rng.integers(0, 8, size=(16, 2, 2)) for _ in range(4)]
    trace = record(tmp_path, "per_pass", passes, num_experts=8, ep_size=2)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["placement", str(trace), "--gpus", "2", "--slots", "10", "--format", "sglang", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    mapping = read_sglang_plan(out, 8)
    np.testing.assert_array_equal(mapping, json.loads(result.output)["phy2log"])
    assert mapping.shape == (2, 10)
    bad = CliRunner().invoke(app, ["placement", str(trace), "--gpus", "2", "--format", "vllm", "-o", str(out)])
    assert bad.exit_code != 0 and "--format 'vllm' is not one of ['moetrace', 'sglang']" in bad.output


def test_cli_writes_one_sglang_row_per_model_layer_for_a_layer_subset(tmp_path):
    """A 4-layer trace (model layers 0-3, layer 0 dense: not recorded) planned on --layers 1,2: SGLang gets 4 rows."""
    rng = np.random.default_rng(5)
    passes = [rng.integers(0, 8, size=(16, 3, 2)) for _ in range(4)]
    trace = record(tmp_path, "per_pass", passes, num_experts=8, ep_size=2, layer_ids=(1, 2, 3))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["placement", str(trace), "--gpus", "2", "--slots", "10", "--layers", "1,2", "--format", "sglang", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    mapping = read_sglang_plan(out, 8)
    assert mapping.shape == (4, 10)
    np.testing.assert_array_equal(mapping[1:3], json.loads(result.output)["phy2log"])
    trivial = np.arange(10) % 8
    np.testing.assert_array_equal(mapping[0], trivial)  # the dense layer and the unplanned MoE layer: SGLang's trivial row
    np.testing.assert_array_equal(mapping[3], trivial)
