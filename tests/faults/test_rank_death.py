"""Two gloo ranks record; rank 1 is SIGKILLed mid-run. Rank 0's trace is complete and
`merge` of rank 0's dump with rank 1's recovered trace says where rank 1 stopped."""

from __future__ import annotations

import json
import signal

import numpy as np
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.reference.launcher import RankDeath, launch
from moetrace.trace import open_trace
from moetrace.trace.recover import recover
from tests.faults.recording import TOKENS, pass_ids, two_rank_worker

PASSES, KILL_AT = 160, 90


def test_rank_killed_mid_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    rank0, rank1 = launch(two_rank_worker, 2, str(out), PASSES, KILL_AT, backend="gloo", threads_per_rank=1, timeout=300, tolerate_deaths=True)
    # The launcher says which rank died and how.
    assert isinstance(rank1, RankDeath) and rank1.rank == 1 and rank1.exitcode == -signal.SIGKILL
    assert str(rank1) == "rank 1 died: killed by signal SIGKILL (9)"
    # Rank 0 kept recording and dumped every pass.
    with open_trace(rank0) as trace:
        assert trace.attrs["rank"] == 0 and trace.num_passes().tolist() == [PASSES]
        ids = np.concatenate([c.topk_ids for c in trace.iter_tokens()])
    np.testing.assert_array_equal(ids, np.concatenate([pass_ids(i, 0) for i in range(PASSES)]))
    # Rank 1's complete segments are recovered: contiguous, exact, ending before the kill.
    [dead] = recover(out, tmp_path / "rank1.h5")
    assert dead.rank == 1 and 0 <= dead.last_pass < KILL_AT
    with open_trace(dead.path) as trace:
        pid = np.concatenate([c.pass_id for c in trace.iter_tokens()])
        ids = np.concatenate([c.topk_ids for c in trace.iter_tokens()])
    np.testing.assert_array_equal(pid, np.repeat(np.arange(dead.last_pass + 1), TOKENS))
    np.testing.assert_array_equal(ids, np.concatenate([pass_ids(i, 1) for i in range(dead.last_pass + 1)]))
    # merge joins what exists and says where rank 1 stopped.
    result = CliRunner().invoke(app, ["merge", rank0, str(dead.path), "-o", str(tmp_path / "merged.h5")])
    assert result.exit_code == 0, result.output
    assert f"rank 1 stopped: recovered up to pass {dead.last_pass}" in result.output
    with open_trace(tmp_path / "merged.h5") as merged:
        assert merged.num_passes().tolist() == [PASSES, dead.last_pass + 1]
        assert "rank 1 stopped" in json.loads(merged.attrs["recovered_ranks"])[0]
