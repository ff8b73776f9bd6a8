"""The virtualenv locks (``locks/``, ``.ci/locks.py``): every virtualenv is installed from one, and this one holds it exactly."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "locks"
VIRTUALENVS = {"core.txt": "$(VENV)", "vllm.txt": "$(VLLM_VENV)", "sglang.txt": "$(SGLANG_VENV)", "megatron.txt": "$(MEGATRON_VENV)"}


@pytest.fixture(scope="module")
def locks():
    spec = importlib.util.spec_from_file_location("locks", ROOT / ".ci" / "locks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_lock_per_virtualenv_every_line_an_exact_pin(locks) -> None:
    assert sorted(p.name for p in LOCKS.glob("*.txt")) == sorted(VIRTUALENVS)
    for name in VIRTUALENVS:
        pins = locks.parse_lock((LOCKS / name).read_text())
        assert pins["torch"].startswith("2.13.0"), f"{name}: torch must be the CPU wheel on disk"
        assert "moetrace" not in pins and "pip" not in pins


def test_every_virtualenv_is_installed_from_its_lock() -> None:
    """Each virtualenv's recipe calls `locked` with its own lock outside LATEST (read from the Makefile)."""
    makefile = (ROOT / "Makefile").read_text()
    calls = dict((lock, venv) for venv, lock in re.findall(r"\$\(call locked,(\$\(\w+\)),(\w+\.txt),", makefile))
    assert calls == VIRTUALENVS
    assert "--no-deps -r $(LOCKS)/$(2)" in makefile


def test_a_line_that_is_no_exact_pin_is_refused(locks) -> None:
    with pytest.raises(ValueError, match=r"line 2 'numpy>=2' is not name==version; regenerate the lock with `make lock`"):
        locks.parse_lock("# header\nnumpy>=2\n")


def test_differences_name_each_package_both_ways(locks) -> None:
    locked = locks.parse_lock("Foo_Bar==1.0\nsame==2\nold==3\n")
    newest = locks.parse_lock("foo-bar==1.1\nsame==2\nnew==4\n")
    assert locks.differences(locked, newest) == ["foo-bar: 1.0 -> 1.1", "new: - -> 4", "old: 3 -> -"]
    assert locks.differences(locked, locked) == []


@pytest.mark.skipif(os.environ.get("LATEST") == "1", reason="make test-latest runs on the newest releases, not the lock")
def test_this_virtualenv_holds_exactly_its_lock(locks) -> None:
    """The core suite's interpreter (.venv, built by `make` from locks/core.txt) holds every package at its locked version."""
    installed = {}
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if name not in ("pip", "moetrace"):
            installed[name] = dist.version
    assert locks.differences(locks.parse_lock((LOCKS / "core.txt").read_text()), installed) == []
