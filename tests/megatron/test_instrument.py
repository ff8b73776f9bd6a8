"""moetrace.adapters.megatron on real Megatron-Core MoE layers, expert-parallel over gloo ranks.

Each test is one launch of fresh rank processes on a free port, running several checks
(tests/megatron/ranks.py) so that Megatron is imported once per rank. Counts are checked
against what Megatron's experts actually received (a test-side hook on each experts
module), never against the adapter's own bookkeeping.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from moetrace.reference.launcher import launch

from ..phase_ticks import TICK_S
from ..servers import SUBPROCESS_BOUND_S
from . import ranks

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_counts_equal_megatrons_and_change_nothing(dispatcher, tmp_path):
    checks = [("instrument_checks", (dispatcher,))]
    if dispatcher == "alltoall":
        checks += [("recompute_checks", ()), ("capacity_checks", ()), ("timing_and_trace", (str(tmp_path / "step.h5"),))]
    results = launch(ranks.run, 2, checks)
    for rank, result in enumerate(results):
        r = result["instrument_checks"]
        # every rank's routers, summed over the EP group, give each local expert what Megatron's experts received
        assert r["routed_local_experts"] == r["megatron_tokens_per_expert"]
        assert r["expert_tokens"] == r["megatron_tokens_per_expert"]
        assert np.asarray(r["megatron_tokens_per_expert"]).sum() > 0
        assert r["rank_routed"] == [r["steps"] * r["tokens"] * 2] * 2  # tokens x top-k per layer per pass
        assert r["passes"] == r["steps"]  # one pass per micro-batch forward; backward adds none
        assert r["send_matches_recv"]  # what rank a sends to b is what b receives from a
        assert r["recv_total"] == np.asarray(r["megatron_tokens_per_expert"]).sum(1).tolist()
        assert r["identical"] and r["identical_after"]  # outputs and every gradient bit-identical
        assert r["sync_caught"]  # the no-host-sync guard fails on a syncing hook (negative control)
        assert r["same_handle"] and r["hooks_left"] == 0 and r["slot_restored"] and r["problems"] == []
        assert all(np.isfinite(r["aux_loss"])) and all(np.isfinite(r["z_loss"])) and len(r["balancedness"]) == 2, rank
    if dispatcher != "alltoall":
        return
    for result in results:
        rc = result["recompute_checks"]
        assert rc["router_calls"]["backward"] == rc["router_calls"]["forward"] == 1  # recomputed in backward ...
        assert rc["routed"] == [rc["tokens_x_k"]] * 2  # ... and counted once
        assert rc["expert_tokens"] == rc["megatron_tokens_per_expert"]
        cap = result["capacity_checks"]
        assert all(d > 0 for d in cap["dropped_global"])  # capacity 0.5 drops copies in every layer
        assert cap["dropped_global"] == (np.asarray(cap["routed_global"]) - np.asarray(cap["received_global"])).tolist()
        assert cap["expert_tokens"] == cap["megatron_tokens_per_expert"]
        timing = result["timing_and_trace"]
        assert np.asarray(timing["phase_count"]).min() == 2  # route, dispatch, expert, combine in every layer, both passes
        # Each bracket lasts one tick of the counting clock (tests/phase_ticks.py): route and expert are one method
        # each, dispatch (preprocess + dispatch) and combine (combine + postprocess) two; every pass's reach the sums.
        np.testing.assert_allclose(timing["phase_seconds"], np.asarray(timing["phase_count"]) * [1, 2, 1, 2] * TICK_S)
    trace_checks(results)


def trace_checks(results):
    """The dump is a moetrace trace with a rank axis: the CLI reads it like any engine's."""
    from moetrace.trace.reader import open_trace

    path = results[0]["timing_and_trace"]["path"]
    with open_trace(path) as trace:
        assert trace.attrs["engine"] == "megatron" and trace.ep_size == 2
        per_rank = trace.logical_count(per_rank=True)
        assert per_rank.tolist() == [r["timing_and_trace"]["counts"] for r in results]
        assert trace.has_timing
    out = subprocess.run([sys.executable, "-m", "moetrace.cli", "analyze", path], capture_output=True, text=True, timeout=SUBPROCESS_BOUND_S)
    assert out.returncode == 0, out.stderr
    assert "balancedness" in out.stdout.lower()
