"""Tests of the scripts in ``benchmarks/``, which is not a package: :func:`benchmark_module` imports one."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """Import ``benchmarks/<name>.py`` with ``benchmarks/`` on ``sys.path`` for the block's length."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
