"""RecorderConfig.run_id: a launcher gives every rank the same run id without a process group."""

from __future__ import annotations

import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import open_trace


def test_configured_run_id_is_written(tmp_path):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, mode="per_pass",
                                                    output_dir=tmp_path, run_id="job-42_a", segment_seconds=0))
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(0):
        rec.on_select_experts(torch.tensor([[1], [2]]))
    rec.stop_record()
    with open_trace(rec.dump_record(tmp_path / "t.h5")) as trace:
        assert trace.run_id == "job-42_a"
    rec.start_record()  # a new recording of the same recorder keeps the configured id
    rec.stop_record()
    with open_trace(rec.dump_record(tmp_path / "u.h5")) as trace:
        assert trace.run_id == "job-42_a"


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 65, "../up", 7])
def test_unsafe_run_id_is_refused(bad):
    with pytest.raises(ValueError, match="run_id must be"):
        RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, run_id=bad)  # type: ignore[arg-type]
