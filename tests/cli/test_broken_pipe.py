"""A reader that stops reading is no failure: ``moetrace analyze T | head -2``, ``moetrace verify T | head -1``
and ``moetrace --help | head -1`` exit 0.

The command's stdout is a pipe whose reading end is closed before it starts, so its first
write meets a broken pipe, as it does once ``head`` has its lines and exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ..analysis.helpers import random_passes, record


def into_closed_pipe(*args: object) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with its stdout a pipe nobody reads any more."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, *map(str, args)], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    passes = random_passes(np.random.default_rng(4), num_passes=8, num_layers=2, num_experts=8, top_k=2)
    return record(tmp_path_factory.mktemp("trace"), "per_pass", passes, num_experts=8)


@pytest.mark.parametrize("args", [["analyze"], ["analyze", "--json"], ["verify"]], ids=" ".join)
def test_a_reader_that_stops_reading_is_no_error(trace: Path, args: list[str]) -> None:
    done = into_closed_pipe("-m", "moetrace.cli", args[0], trace, *args[1:])
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("args", [["--help"], ["routes", "--help"], ["replicas", "--help"], ["replicas", "why", "--help"]], ids=" ".join)
def test_help_into_a_closed_pipe_is_no_error(args: list[str]) -> None:
    """``moetrace --help | head -1``: click's help, written after the reader left."""
    done = into_closed_pipe("-m", "moetrace.cli", *args)
    assert (done.returncode, done.stderr) == (0, "")


def test_negative_control_the_pipe_is_broken_for_a_plain_console() -> None:
    """rich's own console exits 1 on the same pipe: the harness does break it."""
    done = into_closed_pipe("-c", "from rich.console import Console\nConsole().print('a line')")
    assert done.returncode == 1
