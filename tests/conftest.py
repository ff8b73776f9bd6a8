"""Shared fixtures.

- Every test leaves the global recorder as it found it.
- Tests run with one torch intra-op thread: their tensors are tiny, and two OpenMP
  threads spin-wait on each other on a busy 2-core machine.
"""

from __future__ import annotations

import pytest
import torch

import moetrace


@pytest.fixture(autouse=True)
def _restore_global_recorder():
    previous = moetrace.get_recorder()
    yield
    moetrace.set_recorder(previous)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
