"""A recording's host buffers are in memory from its start (issue 50): made and zeroed by
``start_record``, not faulted in page by page by the pass ends that first fill or copy into them.

On a CPU device the forward thread itself writes into them (a stream's staged rows, a checkpoint's
window copy). At DeepSeek-V3 size a checkpoint's window buffer is 67 MB; faulting it in held pass
ends up to 20 ms on this machine (``benchmarks/pass_breakdown.py``, docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from moetrace.trace.shared_memory import SharedBuffer, sharing_available
from moetrace.trace.stream import HostBufferPool
from tests.faults.recording import feed, make_recorder

BIG = 64 << 20  # over glibc's largest mmap threshold (32 MiB): always fresh pages from the kernel, never reused heap

_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(address: int, length: int) -> float:
    """The fraction of the pages of ``[address, address + length)`` in memory (Linux ``mincore``)."""
    page = mmap.PAGESIZE
    start = address - address % page
    pages = (address + length - start + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return float(np.mean(np.frombuffer(vec, np.uint8) & 1))


def tensor_resident(tensor: torch.Tensor) -> float:
    return resident_fraction(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def test_the_check_sees_pages_not_yet_touched() -> None:
    """Negative control: fresh anonymous memory, and a pool's shared buffer before it is zeroed, are
    not in memory until written; the check says so (a pool that skipped the zeroing would fail below).

    Not a ``torch.empty``: malloc may serve it from heap memory that an earlier test freed, already
    in memory and holding that test's data (seen in a fresh-clone CI run), so it proves nothing."""
    fresh = mmap.mmap(-1, BIG)
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    assert resident_fraction(address, BIG) == 0.0
    fresh[::mmap.PAGESIZE] = b"\1" * (BIG // mmap.PAGESIZE)
    assert resident_fraction(address, BIG) == 1.0
    fresh.close()
    if not sharing_available():
        pytest.skip("no memfd here: the pool's buffers are private zeros, made by torch.zeros")
    unzeroed = torch.frombuffer(SharedBuffer(BIG).map, dtype=torch.int32)
    assert tensor_resident(unzeroed) == 0.0
    unzeroed.zero_()  # what HostBufferPool does to each buffer it makes
    assert tensor_resident(unzeroed) == 1.0


def test_a_pools_buffers_are_in_memory_when_made() -> None:
    pool = HostBufferPool((BIG // 4,), torch.int32, count=2, pin=False)
    buffers = [pool.acquire(block=False), pool.acquire(block=False)]
    for buffer in buffers:
        assert buffer is not None
        assert tensor_resident(buffer) == 1.0


@pytest.mark.parametrize("mode", ["stat", "per_token"])
def test_passes_make_no_host_buffer(tmp_path, monkeypatch, mode: str) -> None:
    """Every host buffer of the recording is made by ``start_record`` (or before it); none by the
    passes after it, through checkpoints or hand-offs and segment rotations. The spy sees those made
    before the passes, so it can see one made by them (before issue 50's fix, ``stat``'s first checkpoint did)."""
    made: list[str] = []
    real = HostBufferPool.__init__
    serving = False

    def spy(pool, shape, dtype, count, pin):
        made.append("passes" if serving else "start")
        real(pool, shape, dtype, count, pin)

    monkeypatch.setattr(HostBufferPool, "__init__", spy)
    rec = make_recorder(mode, tmp_path, segment_seconds=0, segment_passes=8)
    rec.start_record()
    assert made and set(made) == {"start"}
    serving = True
    for pass_id in range(40):  # four checkpoints or rotations (every 8 passes), hand-offs every 8
        feed(rec, pass_id)
    session = rec._files.session
    assert session is not None
    session.writer.drain()
    assert session.writer.error is None
    assert made.count("passes") == 0
    serving = False
    rec.reset()
