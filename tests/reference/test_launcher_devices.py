"""NCCL ranks need a GPU each: launch() says so before spawning (checked on CPU)."""

from __future__ import annotations

import pytest

from moetrace.reference.launcher import _check_nccl_devices, launch


def _never(rank: int, world_size: int) -> None:
    raise AssertionError("no rank may start")


def test_two_nccl_ranks_on_one_gpu_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"world_size=2 needs 2 GPUs .* 1 is visible; use world_size<=1, or backend='gloo'"):
        _check_nccl_devices(2, 1)
    _check_nccl_devices(2, 2)
    _check_nccl_devices(1, 8)


def test_nccl_without_cuda_is_refused_before_spawning():
    with pytest.raises(ValueError, match="needs CUDA devices; use backend='gloo'"):
        launch(_never, 2, backend="nccl")
