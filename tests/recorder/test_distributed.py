"""Two ranks on gloo: stat dumps gather into one file with a rank axis; streaming dumps per rank."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.reference import free_port
from moetrace.trace import open_trace

pytestmark = pytest.mark.slow


def routing(rank: int, passes: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.integers(0, 8, size=(3 + rank, 2)) for _ in range(passes)]


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mode in ("stat", "per_token"):
            rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=8, top_k=2, ep_size=world, ep_rank=rank, mode=mode, output_dir=out, window=4, max_tokens_per_pass=16, stream_chunk_tokens=32))
            rec.start_record()
            for i, ids in enumerate(routing(rank, 6)):
                with rec.with_forward_pass(), rec.with_current_layer(0):
                    rec.on_select_experts(torch.as_tensor(ids))
                    rec.on_dispatch(torch.tensor([i, rank]), torch.tensor([rank, i]))
            rec.stop_record()
            rec.dump_record(os.path.join(out, f"{mode}.h5"))
    finally:
        dist.destroy_process_group()


def test_two_rank_gather_and_per_rank_files(tmp_path):
    mp.start_processes(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    expected = [np.bincount(np.concatenate(routing(r, 6)).ravel(), minlength=8) for r in range(2)]
    with open_trace(tmp_path / "stat.h5") as trace:
        per_rank = trace.physical_count(per_rank=True)
        assert per_rank.shape == (2, 1, 8)
        for r in range(2):
            np.testing.assert_array_equal(per_rank[r, 0], expected[r])
        assert trace.attrs["rank"] == -1 and trace.attrs["world_size"] == 2
        window = trace.window()
        assert window.pass_id.shape == (2, 4)
        np.testing.assert_array_equal(window.pass_id[0], [2, 3, 4, 5])
        np.testing.assert_array_equal(window.num_tokens[1], [4, 4, 4, 4])
        send = trace.send_count()
        np.testing.assert_array_equal(send[:, 0], [[15, 0], [15, 6]])
        run_id = trace.run_id
    for r in range(2):
        with open_trace(tmp_path / f"per_token-rank{r}.h5") as trace:
            assert trace.attrs["rank"] == r and trace.run_id != ""
            ids = np.concatenate([c.topk_ids for c in trace.iter_tokens()])
            np.testing.assert_array_equal(ids[:, 0], np.concatenate(routing(r, 6)))
            np.testing.assert_array_equal(trace.physical_count(), [expected[r]])
    with open_trace(tmp_path / "per_token-rank0.h5") as a, open_trace(tmp_path / "per_token-rank1.h5") as b:
        assert a.run_id == b.run_id != run_id
