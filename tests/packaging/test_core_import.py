"""`import moetrace` loads the core only: what runs inside an engine's forward.

Each check runs in a fresh interpreter, so modules other tests imported do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: The core: configuration, recording (hooks, session, dump), capture, dispatch, snapshot, balance
#: metric definitions, id spaces, rank layouts and trace I/O. Nothing else of moetrace may load with it.
CORE = {
    "moetrace",
    "moetrace._version",
    "moetrace.accumulators",
    "moetrace.capturer",
    "moetrace.config",
    "moetrace.devices",
    "moetrace.dispatch",
    "moetrace.dump",
    "moetrace.graphs",
    "moetrace.ids",
    "moetrace.layout",
    "moetrace.pass_phase",
    "moetrace.balance",
    "moetrace.batch",
    "moetrace.process_recorder",
    "moetrace.recorder",
    "moetrace.hook_args",
    "moetrace.dumper",
    "moetrace.recording_timing",
    "moetrace.session",
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


def test_import_moetrace_loads_only_the_core(after_import_moetrace: list[str]) -> None:
    ours = {m for m in after_import_moetrace if m == "moetrace" or m.startswith("moetrace.")}
    extra = {m for m in ours - CORE if not m.startswith("moetrace.trace")}
    assert not extra, f"import moetrace loads non-core modules: {sorted(extra)}"
    assert {"moetrace.recorder", "moetrace.config", "moetrace.trace.writer"} <= ours


def test_import_moetrace_loads_no_heavy_library(after_import_moetrace: list[str]) -> None:
    heavy = sorted({m.split(".")[0] for m in after_import_moetrace} & set(HEAVY))
    assert not heavy, f"import moetrace loads {heavy}; import them where they are used"


def test_recorder_never_imports_analysis() -> None:
    loaded = _loaded_after("import moetrace.recorder")
    analysis = [m for m in loaded if m.startswith("moetrace.analysis")]
    assert not analysis, f"import moetrace.recorder loads {analysis}"


def test_lazy_attributes_still_resolve() -> None:
    code = "import moetrace, sys\nassert callable(moetrace.serve_control)\nassert 'moetrace.control' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
