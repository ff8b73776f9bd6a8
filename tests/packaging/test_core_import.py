"""`import moetrace` loads the version only; its first recorder name loads the core, what runs inside an engine's forward.

The package root exports its names lazily (PEP 562), so the offline commands, which import
``moetrace.cli`` and with it the root, load no torch (tests/cli/test_no_torch.py). Each check
runs in a fresh interpreter, so modules other tests imported do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: What ``import moetrace`` loads: the version and the lazy attributes, nothing that imports torch.
ROOT = {"moetrace", "moetrace._version", "moetrace.lazy"}
#: The core: configuration, recording (hooks, session, dump), capture, dispatch, snapshot, balance
#: metric definitions, id spaces, rank layouts and trace I/O. Nothing else of moetrace may load with it.
CORE = {
    "moetrace",
    "moetrace._version",
    "moetrace.recording",
    "moetrace.recording.pass_counter",
    "moetrace.recording.sink",
    "moetrace.recording.window",
    "moetrace.recording.streams",
    "moetrace.recording.modes",
    "moetrace.capturer",
    "moetrace.config",
    "moetrace.cuda_clock",
    "moetrace.devices",
    "moetrace.dispatch",
    "moetrace.recording.dump_files",
    "moetrace.graphs",
    "moetrace.ids",
    "moetrace.layout",
    "moetrace.lazy",
    "moetrace.pass_phase",
    "moetrace.balance",
    "moetrace.batch",
    "moetrace.process_recorder",
    "moetrace.recorder",
    "moetrace.recording.hook_args",
    "moetrace.recording.dump_cuts",
    "moetrace.recording.timing_state",
    "moetrace.recording.session",
    "moetrace.snapshot",
    "moetrace.timing",
}
#: Third-party packages that only analysis, exporters, adapters or the CLI may load.
HEAVY = ("matplotlib", "transformers", "typer", "rich", "prometheus_client", "opentelemetry", "dask", "distributed", "scipy", "pandas", "click")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def after_import_moetrace() -> list[str]:
    return _loaded_after("import moetrace")


@pytest.fixture(scope="module")
def after_configure() -> list[str]:
    return _loaded_after("import moetrace\nmoetrace.configure")


def _ours(loaded: list[str]) -> set[str]:
    return {m for m in loaded if m == "moetrace" or m.startswith("moetrace.")}


def test_import_moetrace_loads_only_the_version(after_import_moetrace: list[str]) -> None:
    assert _ours(after_import_moetrace) == ROOT, "import moetrace loads more than its version: export the name lazily (_LAZY)"
    assert "torch" not in after_import_moetrace


def test_the_first_recorder_name_loads_only_the_core(after_configure: list[str]) -> None:
    ours = _ours(after_configure)
    extra = {m for m in ours - CORE if not m.startswith("moetrace.trace")}
    assert not extra, f"moetrace.configure loads non-core modules: {sorted(extra)}"
    assert {"moetrace.recorder", "moetrace.config", "moetrace.trace.writer"} <= ours


@pytest.mark.parametrize("fixture", ["after_import_moetrace", "after_configure"])
def test_import_moetrace_loads_no_heavy_library(fixture: str, request: pytest.FixtureRequest) -> None:
    loaded = request.getfixturevalue(fixture)
    heavy = sorted({m.split(".")[0] for m in loaded} & set(HEAVY))
    assert not heavy, f"{fixture}: loads {heavy}; import them where they are used"


def test_recorder_never_imports_analysis() -> None:
    loaded = _loaded_after("import moetrace.recorder")
    analysis = [m for m in loaded if m.startswith("moetrace.analysis")]
    assert not analysis, f"import moetrace.recorder loads {analysis}"


def test_every_public_name_resolves_from_its_module() -> None:
    code = (
        "import importlib, moetrace, sys\n"
        "assert 'moetrace.control' not in sys.modules\n"
        "for name in moetrace.__all__:\n"
        "    value = getattr(moetrace, name)\n"
        "    home = getattr(value, '__module__', None)\n"
        "    assert home is None or home.startswith('moetrace.'), (name, home)\n"
        "from moetrace import RecorderConfig, serve_control\n"
        "assert serve_control is importlib.import_module('moetrace.control').serve_control\n"
        "try:\n"
        "    moetrace.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
