"""Each pass's request count against its pass phase: the recorder keeps the rule, every reader checks it.

HDF5's Fletcher-32 sums 16-bit words mod 65535, so a run of ``-1`` (``0xFFFF`` words) turned into
``0`` keeps the chunk's checksum and the file's digest: the command fuzz found ``merge`` of a stat
trace answering exit 0 with ``/window/num_requests`` zeroed (stat case 75). The rule
(:data:`moetrace.pass_phase.REQUESTS_RULE`: 0 only in an idle pass, -1 or at least 1 elsewhere, an
empty window slot unknown with -1) never allows both ``-1`` and ``0`` in one place, so the zeroed
run breaks it.
"""

from __future__ import annotations

import itertools

import h5py
import numpy as np
import pytest
import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.batch import BatchError, PassBatch
from moetrace.process_recorder import NoOpRecorder
from moetrace.trace import invariants, open_trace, pass_requests
from moetrace.trace.integrity import reseal
from moetrace.trace.join import concat_segments
from moetrace.trace.merge import merge_traces
from moetrace.trace.schema import Data, TraceDamageError

runner = CliRunner()
_outputs = itertools.count()  # merge never overwrites: a fresh output name per run
#: (phase, num_requests given) of each recorded pass: -1 where the count is unknown, idle given none.
PASSES = (("prefill", -1), ("decode", 2), ("unknown", -1), ("idle", -1), ("mixed", 3))


def _recorded(tmp_path, mode: str):
    """A trace of :data:`PASSES` (window of 8 slots: 3 empty)."""
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=8, top_k=2, mode=mode, output_dir=tmp_path,
                                                    window=8, max_tokens_per_pass=4, stream_chunk_passes=2))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    rec.start_record()
    for pass_id, (phase, requests) in enumerate(PASSES):
        rec.set_pass_phase(phase, requests)
        with rec.with_forward_pass(pass_id):
            for layer in range(2):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(ids)
    rec.stop_record()
    return rec.dump_record(tmp_path / f"{mode}.h5")


def _zero_unknown_counts(path, name: str) -> None:
    """Every ``-1`` of ``/name`` turned into ``0`` (what a zeroed chunk does), checksums redone."""
    with h5py.File(path, "r+") as f:
        column = np.asarray(f[name][()])
        assert (column == -1).sum() >= 2, column  # a run of them
        f[name][...] = np.where(column == -1, 0, column)
    reseal(path)  # only the rule can catch it now


def _answers(path, tmp_path) -> list[int]:
    """Exit codes of ``verify``, ``analyze`` and ``merge`` on ``path``."""
    return [runner.invoke(app, args).exit_code for args in (["verify", str(path)], ["analyze", str(path)],
                                                           ["merge", str(path), "-o", str(tmp_path / f"merged-{next(_outputs)}.h5")])]


@pytest.mark.parametrize(("mode", "name"), [("stat", Data.WINDOW_NUM_REQUESTS), ("per_pass", Data.PASSES_NUM_REQUESTS)])
def test_zeroed_unknown_request_counts_are_damage(tmp_path, monkeypatch, mode, name):
    path = _recorded(tmp_path, mode)
    with open_trace(path) as trace:  # the recorder stored the rule's counts: idle 0, unknown -1
        stored = trace.window().num_requests[0, :5] if mode == "stat" else next(trace.iter_passes()).num_requests
        assert stored.tolist() == [-1, 2, -1, 0, 3]
    assert _answers(path, tmp_path) == [0, 0, 0]  # the honest trace answers
    _zero_unknown_counts(path, name)
    with pytest.raises(TraceDamageError, match="num_requests"), open_trace(path) as trace:
        trace.window() if mode == "stat" else list(trace.iter_passes())
    for move in (lambda: merge_traces([path], tmp_path / "merged.h5"), lambda: concat_segments([path, path], tmp_path / "joined.h5")):
        with pytest.raises(TraceDamageError, match="num_requests"):  # the paths that move the rows without the reader
            move()
    assert _answers(path, tmp_path) == [2, 2, 2]
    result = runner.invoke(app, ["verify", str(path)])
    assert "prefill" in result.output and "-1 (unknown) or at least 1" in result.output, result.output
    # negative control: without the rule the zeroed counts answer exit 0 (a different answer)
    monkeypatch.setattr(invariants, "check_pass_requests", lambda *a, **k: None)
    monkeypatch.setattr(pass_requests, "check_pass_requests", lambda *a, **k: None)
    assert _answers(path, tmp_path) == [0, 0, 0]


def test_empty_window_slots_hold_unknown_and_minus_one():
    """A dumped window holds its filled slots only; ``merge`` pads narrower ranks' rows (pass id -1,
    phase unknown, -1 requests): a zeroed padding count breaks the rule too."""
    pass_id, phase = np.array([[3, 4, -1]]), np.array([[1, 4, 0]])
    invariants.check_pass_requests("t.h5", Data.WINDOW_NUM_REQUESTS, phase, np.array([[2, 0, -1]]), pass_id)  # as merge pads
    with pytest.raises(TraceDamageError, match=r"rank row 0, slot 2 \(pass id -1\): 0 requests"):
        invariants.check_pass_requests("t.h5", Data.WINDOW_NUM_REQUESTS, phase, np.array([[2, 0, 0]]), pass_id)


@pytest.mark.parametrize("recorder", ["recording", "null"])
def test_set_pass_phase_refuses_counts_the_rule_forbids(tmp_path, recorder):
    rec = NoOpRecorder() if recorder == "null" else ExpertDistributionRecorder(
        RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, mode="stat", output_dir=tmp_path))
    for phase, count, why in (("prefill", 0, "'prefill' pass"), ("unknown", 0, "'unknown' pass"), ("idle", 2, "'idle' pass"), ("decode", -2, "num_requests=-2")):
        with pytest.raises(ValueError, match=why) as error:
            rec.set_pass_phase(phase, count)
        assert "Give -1 when the count is unknown" in str(error.value)
    for phase, count in (("idle", -1), ("idle", 0), ("decode", -1), ("unknown", -1), ("unknown", 4), ("mixed", 1)):
        rec.set_pass_phase(phase, count)  # allowed (idle of unknown count: stored as 0, as the trace test shows)


def test_pass_batch_keeps_the_rule():
    assert PassBatch.idle(4).num_requests == 0 and PassBatch.of(["a"], [0], [3], phase="prefill").num_requests == 1
    empty = np.zeros(0, np.int64)
    with pytest.raises(BatchError, match="'prefill' with 0 requests"):
        PassBatch((), empty, empty, empty, np.zeros(0, bool), "prefill", 4)  # built directly, past `of`
    one = np.ones(1, np.int64)
    with pytest.raises(BatchError, match="'idle' with 1 requests"):
        PassBatch(("a",), one, one, one, np.ones(1, bool), "idle", 4)
