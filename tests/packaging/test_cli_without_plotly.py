"""The `moetrace` command works without the `report` extra (plotly); report and demo say what to install.

plotly is hidden from a fresh interpreter (``sys.modules['plotly'] = None`` makes every import of it fail),
as in an environment installed with plain ``pip install moetrace``.
"""

from __future__ import annotations

import subprocess
import sys

from tests.servers import SUBPROCESS_BOUND_S

HIDE = "import sys; sys.modules['plotly'] = None; sys.argv = ['moetrace', *sys.argv[1:]]; from moetrace.cli.app import main; main()"


def _moetrace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE, *args], capture_output=True, text=True, timeout=SUBPROCESS_BOUND_S)


def test_commands_load_without_plotly(tmp_path):
    result = _moetrace("--help")
    assert result.returncode == 0, result.stderr
    assert "analyze" in result.stdout and "report" in result.stdout


def test_report_and_demo_name_the_extra(tmp_path):
    trace = tmp_path / "t.h5"
    trace.write_bytes(b"not a trace")
    for args in (("report", str(trace), "-o", str(tmp_path / "r.html")), ("demo", "--out", str(tmp_path / "demo"))):
        result = _moetrace(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "pip install 'moetrace[report]'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "demo").exists()


def test_control_passes_with_plotly_present():
    """Negative control: the same interpreter without the hiding line imports plotly through the report."""
    code = "import moetrace.report.figures, sys; print('plotly' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_BOUND_S).stdout.strip() == "True"
