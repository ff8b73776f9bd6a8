"""Shared fixtures.

- Every test leaves the global recorder as it found it, and renders CLI output 160 columns wide.
- Tests run with one torch intra-op thread: their tensors are tiny, and two OpenMP
  threads spin-wait on each other on a busy 2-core machine.
- The session runs in a temporary working directory: recorders default to
  ``output_dir="."``, and what they leave there (dumps, crash-safe journals and
  checkpoints) must never land in the checkout.
"""

from __future__ import annotations

import os

import pytest
import torch

import moetrace


@pytest.fixture(autouse=True, scope="session")
def _work_outside_the_checkout(tmp_path_factory):
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(previous)


@pytest.fixture(autouse=True)
def _fixed_terminal_width(monkeypatch):
    """Every test reads CLI output rendered 160 columns wide, whatever the caller's ``COLUMNS``
    (pytest-xdist workers get 80; a long temporary path then wraps a table cell or a message)."""
    monkeypatch.setenv("COLUMNS", "160")


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
