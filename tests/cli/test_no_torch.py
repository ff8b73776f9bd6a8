"""Offline commands never import torch: they read traces with numpy and h5py.

Each command runs in a fresh interpreter through a small wrapper that, when the interpreter
exits, writes the names of the torch modules it loaded; an offline command must leave that list
empty. Torch is for what runs an engine or a recorder (``moetrace demo``, the reference runtime,
the adapters), and for reading a torch file (``moetrace convert`` of an SGLang ``.pt`` dump),
which is this check's negative control.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import moetrace.cli
import numpy as np
import pytest
import torch

from ..analysis.helpers import random_passes, record

#: Runs ``moetrace ARGS...`` (argv[2:]) and writes the torch modules loaded by then to argv[1] at exit.
WRAPPER = """
import atexit, json, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))))
sys.argv = ["moetrace", *sys.argv[2:]]
from moetrace.cli.app import main
main()
"""


def torch_loaded_by(tmp_path: Path, *args: object) -> list[str]:
    """The torch modules ``moetrace ARGS`` loaded (it must exit 0)."""
    report = tmp_path / "torch-modules.json"
    report.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", WRAPPER, str(report), *map(str, args)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per_token trace of 16 experts on 4 EP ranks: its EP projection plans with equal loads among more than 16 slots."""
    passes = random_passes(np.random.default_rng(3), num_passes=12, num_layers=2, num_experts=16, top_k=2)
    return record(tmp_path_factory.mktemp("trace"), "per_token", passes, num_experts=16, ep_size=4)


def imports_torch(modules: list[str]) -> bool:
    """Whether importing ``modules`` in a fresh interpreter loads torch."""
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules) + "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip() == "True"


def test_no_command_module_imports_torch() -> None:
    """The import path of every command (``moetrace`` imports them all to build its help)."""
    names = [f"moetrace.cli.{m.name}" for m in pkgutil.iter_modules(moetrace.cli.__path__) if m.name != "__main__"]  # __main__ runs the command
    assert "moetrace.cli.demo" in names and "moetrace.cli.analysis" in names
    assert not imports_torch(names), "a command module imports torch at import time: import it inside the command that runs an engine"
    assert imports_torch([*names, "moetrace.reference"]), "negative control: the reference runtime imports torch"


@pytest.mark.parametrize("args", [
    ["--version"],
    ["--help"],
    ["analyze", "{trace}"],
    ["verify", "{trace}"],
    ["report", "{trace}", "-o", "report.html"],
    ["placement", "{trace}", "--gpus", "4"],
    ["traffic", "{trace}", "--gpus-per-node", "2", "-o", "traffic.png"],
    ["plot", "{trace}", "-o", "plot.png"],
    ["routes", "{trace}", "-o", "routes.json"],
    ["inspect", "{trace}"],
], ids=lambda args: args[0].lstrip("-"))
def test_offline_command_imports_no_torch(tmp_path: Path, trace: Path, args: list[str]) -> None:
    loaded = torch_loaded_by(tmp_path, *(a.format(trace=trace) for a in args))
    assert loaded == [], f"moetrace {args[0]} imported torch ({loaded[:3]} ...)"


def test_negative_control_converting_a_torch_file_is_caught(tmp_path: Path) -> None:
    """The wrapper sees torch when a command imports it: ``convert`` of an SGLang dump loads it with torch."""
    dump = tmp_path / "dump.pt"
    torch.save({"rank": 0, "logical_count": torch.ones(2, 8, dtype=torch.int64)}, dump)
    assert "torch" in torch_loaded_by(tmp_path, "convert", dump, "--top-k", "2", "-o", tmp_path / "dump.h5")
