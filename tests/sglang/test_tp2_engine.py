"""moetrace on a live two-rank SGLang engine (``sglang.Engine``, ``tp_size=2``, EP 1, TP attention), through the plugin.

Two engines on the same checkpoint and requests (3 prompts of 5, 3 and 7 tokens, 4 new
tokens each, one request at a time): a plain one, and one with moetrace in ``stat`` mode
with phase timing and SGLang's own recorder in ``stat`` mode. The second runs the
test-only straggler of tests/sglang/shims (``MOETRACE_TEST_EXPERT_DELAY``: global rank 1
sleeps ``DELAY_S`` in every MoE layer's expert compute).

Under TP attention both ranks route the same 24 tokens; moetrace's gathered trace holds
both ranks' rows and its layout, and counts each token once: 24 tokens and
24 x 3 layers x top-2 = 144 assignments. SGLang's own ``stat`` dump all-reduces the ranks'
counts over the TP group, so each rank's ``.pt`` holds ``tp_size`` x that count: the
per-expert counts are compared with it (the engine's own record); the Hugging Face count is
printed as a figure. What the ranks leave when SGLang kills them at shutdown (their last
checkpoints) is recovered, analysed and merged as one run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moetrace.trace.reader import Trace, open_trace

from ..servers import moetrace_cli
from .checkpoint import NUM_LAYERS, TOP_K, build_checkpoint
from .engine import engine
from .multirank import (
    TWO_RANKS,
    WORKLOAD_TOKENS,
    expert_count,
    generate_sequentially,
    hf_computed_routes,
    sglang_recorder_count,
)

pytestmark = pytest.mark.slow

TP = 2
DELAY_S = 0.02
"""Injected sleep of rank 1 per MoE layer and pass (test-only, tests/sglang/shims)."""


@dataclasses.dataclass
class Run:
    checkpoint: Path
    answers: list[dict[str, Any]]
    moetrace_files: list[Path]
    sglang_files: list[Path]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> list[dict[str, Any]]:
    with engine(str(checkpoint), {**TWO_RANKS, "MOETRACE_ENABLED": "0"}, tp_size=TP) as llm:
        return generate_sequentially(llm)


@pytest.fixture(scope="module")
def run(checkpoint: Path, plain: Any, tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("dumps")
    env = {
        **TWO_RANKS, "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "stat", "MOETRACE_TIMING": "1",
        "MOETRACE_OUTPUT_DIR": str(out / "moetrace"), "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(out / "sglang"),
        "MOETRACE_TEST_EXPERT_DELAY": f"1:{DELAY_S}",
    }
    with engine(str(checkpoint), env, tp_size=TP, expert_distribution_recorder_mode="stat") as llm:
        llm.start_expert_distribution_record()
        answers = generate_sequentially(llm)
        llm.stop_expert_distribution_record()
        llm.dump_expert_distribution_record()
    return Run(checkpoint, answers, sorted((out / "moetrace").glob("moetrace-*.h5")), sorted((out / "sglang").glob("*.pt")))


@pytest.fixture(scope="module")
def trace(run: Run) -> Trace:
    assert len(run.moetrace_files) == 1, f"a stat dump gathers both ranks into one file; found {run.moetrace_files}"
    with open_trace(run.moetrace_files[0]) as t:
        yield t


@pytest.fixture(scope="module")
def hf_count(run: Run) -> np.ndarray:
    return expert_count(hf_computed_routes(run.checkpoint, run.answers))


def test_outputs_are_identical_with_and_without_moetrace(run: Run, plain: list[dict[str, Any]]) -> None:
    assert [a["output_ids"] for a in run.answers] == [a["output_ids"] for a in plain]


def test_trace_records_the_tp_layout(trace: Trace) -> None:
    layouts = trace.layouts
    assert [(x.rank, x.tp_rank, x.tp_size, x.ep_size, x.attention, x.source) for x in layouts] == [(0, 0, 2, 1, "tp", "sglang"), (1, 1, 2, 1, "tp", "sglang")]
    assert trace.attrs["world_size"] == TP and trace.attrs["rank"] == -1


@pytest.fixture(scope="module")
def engine_count(run: Run) -> np.ndarray:
    """``[L, E]`` what the engine routed: SGLang's own recorder (each rank's file holds TP x the count)."""
    return sglang_recorder_count(run.sglang_files, TP)


def test_tokens_and_assignments_equal_what_the_engine_computed(trace: Trace, engine_count: np.ndarray, hf_count: np.ndarray) -> None:
    """24 tokens, 144 assignments: each token once, not once per TP rank; per expert, what SGLang's own
    recorder counted. The fp32 Hugging Face forward of the same positions is compared as a figure
    (printed): two ranks all-reduce in an order that can flip a near-tied router score."""
    assert WORKLOAD_TOKENS == 24 and int(engine_count.sum()) == 24 * NUM_LAYERS * TOP_K == 144
    assert trace.tokens_served() == WORKLOAD_TOKENS
    assert list(trace.num_tokens()) == [WORKLOAD_TOKENS, WORKLOAD_TOKENS]  # each row's own view
    np.testing.assert_array_equal(trace.logical_count(), engine_count)
    assert int(trace.physical_count().sum()) == 144
    # each rank's own row is the full count (replicated routing), which is why rows are not added
    rows = trace.physical_count(per_rank=True)
    np.testing.assert_array_equal(rows[0], engine_count)
    np.testing.assert_array_equal(rows[1], engine_count)
    print(f"SGLang TP=2: [layer, expert] cells equal to the HF fp32 count: {int((engine_count == hf_count).sum())} of {engine_count.size}")


def test_what_the_killed_ranks_leave_is_read_as_one_run(run: Run, trace: Trace, tmp_path: Path) -> None:
    """SGLang ends its scheduler processes with SIGKILL (``kill_process_tree``), so no exit hook can dump;
    each rank leaves its last ``stat`` checkpoint (written at ``stop_record``). ``moetrace recover`` gives
    one trace per rank, rank r of 2 with the TP layout, and ``moetrace analyze`` of the two and
    ``moetrace merge`` count each token once, as the gathered dump does."""
    moetrace_cli("recover", str(run.moetrace_files[0].parent), "-o", str(tmp_path / "left.h5"))
    files = sorted(tmp_path.glob("left-rank*.h5"))
    assert [f.name for f in files] == ["left-rank0.h5", "left-rank1.h5"]
    for rank, path in enumerate(files):
        with open_trace(path) as left:
            assert (left.attrs["rank"], left.attrs["world_size"], left.mode) == (rank, TP, "stat")
            assert [(x.rank, x.tp_rank, x.attention) for x in left.layouts] == [(rank, rank, "tp")]
    report = json.loads(moetrace_cli("analyze", "--json", *map(str, files)))
    assert (report["totals"]["tokens"], report["totals"]["assignments"]) == (WORKLOAD_TOKENS, 144)
    moetrace_cli("merge", *map(str, files), "-o", str(tmp_path / "merged.h5"))
    with open_trace(tmp_path / "merged.h5") as merged:
        assert merged.tokens_served() == WORKLOAD_TOKENS
        np.testing.assert_array_equal(merged.physical_count(), trace.physical_count())


def test_analyze_reads_the_delayed_rank_from_the_rows(run: Run, trace: Trace) -> None:
    """Every phase is timed on both ranks; rank 1's expert compute carries the injected delay in every pass.

    Which rank is slowest in a pass is a measured time: under load the scheduler can hold rank 0
    longer than rank 1's injected sleep. So the rank and share ``analyze`` prints are compared with
    those counted here from the trace's own ``/timing`` rows (pass by pass, the rank with the larger
    expert time), whichever rank that is, and printed; that the injected slow rank is named is
    asserted exactly on the counting clock (tests/timing/test_stragglers.py). What no load can break
    is asserted here: in every pass, rank 1's expert time holds the sleep of each of its MoE layers.
    """
    text = moetrace_cli("analyze", str(run.moetrace_files[0]))
    rows = trace.timing_rows()
    expert_by_rank: dict[int, dict[int, float]] = {r: {} for r in range(TP)}  # rank -> pass id -> expert seconds over layers
    for pass_id, rank, phase in zip(rows["pass_id"], rows["rank"], rows["phase"], strict=True):
        expert_by_rank[int(rank)][int(pass_id)] = float(np.nansum(phase[:, 2]))
    short = {p: s for p, s in expert_by_rank[1].items() if s < DELAY_S * NUM_LAYERS}
    assert expert_by_rank[1] and not short, f"rank 1's expert time under its {NUM_LAYERS} sleeps in passes {short}"
    both = sorted(set(expert_by_rank[0]) & set(expert_by_rank[1]))
    rank1_slower = sum(expert_by_rank[1][p] > expert_by_rank[0][p] for p in both)
    shares = [1 - rank1_slower / len(both), rank1_slower / len(both)]
    named = max(range(TP), key=shares.__getitem__)  # as analyze picks it
    assert f"slowest rank (expert compute): rank {named} in {100 * shares[named]:.0f}% of passes" in text, text
    print(f"rank 1 slowest in {rank1_slower} of {len(both)} passes (machine's clock)")
    stat = trace.timing_stat()
    assert (stat["phase_count"] > 0).all(), "route, dispatch, expert and combine are timed in every layer of both ranks"
