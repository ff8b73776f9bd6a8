"""The hot path never synchronises host and device, and the checker catches what would."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.batch import PassBatch
from moetrace.testing import HostSyncError, assert_no_host_sync


@pytest.mark.parametrize("requests", [False, True], ids=["no-batch", "request-rows"])
@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_every_mode_hot_path_has_no_host_sync(tmp_path, mode, requests):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=3, num_physical_experts=16, top_k=4, ep_size=2, mode=mode, output_dir=tmp_path, window=4, stream_chunk_passes=3, stream_chunk_tokens=64, max_tokens_per_pass=32))
    rec.start_record()
    ids = torch.randint(-1, 20, (32, 4))
    send = torch.tensor([3, 5])
    with assert_no_host_sync():
        for step in range(10):  # wraps the window and hands chunks to the writer
            # the engine's batch, from host arrays: two requests' rows and 2 padding rows
            batch = PassBatch.of(["a", f"b{step}"], [step, 0], [1, 29], prefill=[False, True], num_rows=32) if requests else None
            with rec.with_forward_pass(batch=batch):
                for layer in range(3):
                    with rec.with_current_layer(layer):
                        rec.on_select_experts(ids)
                        rec.on_dispatch(send, send, dropped=torch.tensor(0))
    assert rec.snapshot().num_passes == 10


def sync_cases():
    t = torch.tensor([1, 0, 3])
    return {
        "item": lambda: t.sum().item(),
        "bool": lambda: bool(t.sum()),
        "if": lambda: 1 if t[0] else 0,
        "tolist": lambda: t.tolist(),
        "numpy": lambda: t.numpy(),
        "mask index": lambda: t[t > 0],
        "mask assign": lambda: t.clone().__setitem__(t > 0, 0),
        "nonzero": lambda: t.nonzero(),
        "where1": lambda: torch.where(t > 0),
        "unique": lambda: torch.unique(t),
        "masked_select": lambda: t.masked_select(t > 0),
        "bincount": lambda: torch.bincount(t, minlength=4),
        "repeat_interleave": lambda: torch.repeat_interleave(t),
        "equal": lambda: torch.equal(t, t),
    }


def test_checker_catches_a_batch_read_from_device_tensors():
    """Negative control for the request rows: a batch taken from tensors (not the engine's host arrays) is a read the checker names."""
    seq_lens = torch.tensor([3, 1])
    with pytest.raises(HostSyncError), assert_no_host_sync():
        PassBatch.of(["a", "b"], [0, 7], seq_lens, prefill=[True, False])


@pytest.mark.parametrize("name", sorted(sync_cases()))
def test_checker_catches_sync(name):
    fn = sync_cases()[name]
    with pytest.raises(HostSyncError), assert_no_host_sync():
        fn()


def test_checker_allows_fixed_shape_ops():
    t = torch.tensor([1, 0, 3])
    buf = torch.zeros(5, dtype=torch.long)
    with assert_no_host_sync():
        buf.scatter_add_(0, torch.where(t > 0, t, 4), torch.ones_like(t))
        torch.repeat_interleave(t, t, output_size=4)
        t[torch.tensor([0, 2])]  # integer indexing is fine
    assert np.array_equal(buf.numpy(), [0, 1, 0, 1, 1])
