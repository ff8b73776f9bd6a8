"""Shared fixtures: every test leaves the global recorder as it found it."""

from __future__ import annotations

import pytest

import moetrace


@pytest.fixture(autouse=True)
def _restore_global_recorder():
    previous = moetrace.get_recorder()
    yield
    moetrace.set_recorder(previous)
