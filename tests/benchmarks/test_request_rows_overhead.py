"""benchmarks/request_rows_overhead.py in --quick mode, so the before/after comparison of issue 35 cannot rot.

It extracts the commit before request rows from this checkout's history (``git archive``), runs it
and this checkout side by side, and must find: request rows in this tree and none in the old one,
every moetrace module of each process from its own tree, the same recorded totals in both trees
(every token and expert selection, none while off), and every request row of a dumped trace equal
to the batch given. No timing is asserted.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from . import BENCH, benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("request_rows_overhead") as m:
        yield m


def test_arguments(bench):
    args = bench.parse_args([])
    assert (args.repeats, args.rounds, args.before, args.workload) == (4, 8, "734a1f5", list(bench.WORKLOADS))
    quick = bench.parse_args(["--quick"])
    assert (quick.repeats, quick.rounds, quick.workload) == (1, 3, ["decode, skewed"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_requests_feed_the_batch_an_adapter_gives(bench):
    """Decode: one row per request, positions moving on, 4 new requests a pass; prefill: 256-row chunks."""
    decode = bench.Requests(256, prefill=False)
    first, second = decode.batch(), decode.batch()
    assert first.phase == second.phase == "decode" and first.num_tokens == 256 and first.num_requests == 256
    kept = [i for i, (a, b) in enumerate(zip(first.request_ids, second.request_ids, strict=True)) if a == b]
    assert len(kept) == 252 and (second.start[kept] == first.start[kept] + 1).all()
    prefill = bench.Requests(4096, prefill=True)
    batches = [prefill.batch() for _ in range(5)]
    assert all(b.phase == "prefill" and b.num_tokens == 4096 and b.num_requests == 16 for b in batches)
    assert sorted(set(batches[0].start.tolist())) == [0, 256, 512, 768]
    assert sum(rid not in batches[0].request_ids for rid in batches[1].request_ids) == 4  # 4 requests start each pass


def test_quick_run_compares_the_same_recording_in_both_trees(bench, tmp_path):
    if subprocess.run(["git", "-C", str(BENCH.parent), "cat-file", "-e", f"{bench.BEFORE}^{{commit}}"], capture_output=True).returncode != 0:
        pytest.skip(f"commit {bench.BEFORE} is not in this checkout's history (a shallow clone or an export)")
    result = bench.main(["--quick", "--output", str(tmp_path / "rr.json")])
    assert (tmp_path / "rr.json").exists()
    trees = result["trees"]
    assert trees["now"]["request_rows"] and not trees["before"]["request_rows"]
    assert Path(trees["before"]["moetrace"]).parent != Path(trees["now"]["moetrace"]).parent
    run = result["samples"][0]["decode, skewed"]
    counted = {tree: run["finish"][tree]["counted"] for tree in bench.TREES}
    assert counted["before"]["per_token"] == counted["now"]["per_token"] == counted["now"]["per_token+requests"]
    passes = counted["now"]["per_token"]["passes"]
    assert passes > 0 and counted["now"]["per_token"]["selections"] == passes * 256 * bench.TOP_K * bench.LAYERS
    assert all(c["passes"] == 0 for tree in counted.values() for v, c in tree.items() if v.startswith("off"))
    assert result["rows_checked"]["decode, skewed"] == [3 * 256]
    for clock in bench.CLOCKS:  # every ratio summarised (its value is a measured figure: an overhead difference can be < 0)
        ratios = result["results"][clock]["decode, skewed"]["ratios"]
        assert len(ratios) == 7 and all(r["repeat_medians"] == [r["median"]] for r in ratios.values())  # one repeat


def test_counts_that_differ_between_the_trees_fail(bench):
    """Negative control for the totals check: one selection fewer in one tree is caught."""
    counted = {"passes": 2, "tokens": 512, "selections": 2 * 256 * bench.TOP_K * bench.LAYERS}
    off = {"passes": 0, "tokens": 0, "selections": 0}

    def repeat(now_selections):
        now = {**counted, "selections": now_selections}
        return {"workloads": {"decode, skewed": {"finish": {
            "before": {"tokens": 256, "counted": {"off": off, "per_token": counted}},
            "now": {"tokens": 256, "counted": {"off": off, "per_token": now, "off+requests": off, "per_token+requests": counted}},
        }}}}

    assert bench.check_counts([repeat(counted["selections"])], ["decode, skewed"])["decode, skewed"] == counted
    with pytest.raises(AssertionError, match="now per_token counted"):
        bench.check_counts([repeat(counted["selections"] - 1)], ["decode, skewed"])
