"""A fleet's pauses coincide (issue 50): on real gloo ranks, every rank rotates its segments (streaming
modes) or writes its checkpoint (``stat``) at the same pass, however fast each rank runs and whatever
it holds, because the period is a pass count agreed at ``start_record`` (rank 0's)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.recording.session import RecordingSession
from moetrace.reference.launcher import launch
from tests.faults.recording import LAYERS, feed

PASSES, PERIOD = 70, 16


def worker(rank: int, world: int, mode: str, output_dir: str, periods: list[int], run_id: str | None) -> list[int]:
    """Record ``PASSES`` passes with ``segment_passes=periods[rank]``; rank 1 is slower (sleeps each pass)
    and routes other tokens. Returns the recording's pass counts at each rotation / checkpoint."""
    rotations: list[int] = []
    rotate = RecordingSession.rotate

    def spied(session: RecordingSession, pass_id: int, passes: int, wait: bool = False) -> None:
        rotations.append(passes)
        rotate(session, pass_id, passes, wait)

    RecordingSession.rotate = spied  # type: ignore[method-assign]
    config = RecorderConfig(num_layers=LAYERS, num_physical_experts=16, top_k=2, mode=mode, output_dir=Path(output_dir) / f"rank{rank}",
                            max_tokens_per_pass=8, stream_chunk_tokens=64, stream_chunk_passes=8, window=16, segment_passes=periods[rank],
                            run_id=run_id)
    Path(config.output_dir).mkdir()
    rec = ExpertDistributionRecorder(config)
    rec.start_record()  # collective without a given run id: the run id and the period come from rank 0
    for pass_id in range(PASSES):
        feed(rec, pass_id, rank)
        if rank == 1:
            time.sleep(0.002)
    rec.reset()
    return rotations


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_ranks_rotate_at_the_same_pass(tmp_path, mode):
    rank0, rank1 = launch(worker, 2, mode, str(tmp_path), [PERIOD, 5], None, backend="gloo", threads_per_rank=1, timeout=300)
    assert rank0 == rank1 == [16, 32, 48, 64], (rank0, rank1)  # rank 1 asked for 5: rank 0's period holds


def test_negative_control_without_agreement_ranks_differ(tmp_path):
    """The check can fail: with a run id given (no collective at start), each rank keeps its own period."""
    rank0, rank1 = launch(worker, 2, "per_token", str(tmp_path), [PERIOD, 5], "fixedrun", backend="gloo", threads_per_rank=1, timeout=300)
    assert rank0 == [16, 32, 48, 64] and rank1 == list(range(5, PASSES + 1, 5)) and rank0 != rank1


def test_the_period_comes_from_segment_passes_or_segment_seconds():
    config = dict(num_layers=LAYERS, num_physical_experts=16, top_k=2)
    assert RecorderConfig(**config).rotation_passes == 1000  # the default 10 s at 100 passes a second
    assert RecorderConfig(**config, segment_seconds=2).rotation_passes == 200
    assert RecorderConfig(**config, segment_seconds=0).rotation_passes == 0
    assert RecorderConfig(**config, segment_seconds=2, segment_passes=7).rotation_passes == 7
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=r"segment_passes must be a number of passes >= 0 .* got"):
            RecorderConfig(**config, segment_passes=bad)
