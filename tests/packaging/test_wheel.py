"""The built wheel carries its data: `olmoe_bias` works from a plain install outside the source tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(REPO)],
        check=True, cwd=out,
    )
    (built,) = out.glob("moetrace-*.whl")
    return built


@pytest.mark.slow
def test_wheel_lists_the_vendored_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "moetrace/data/olmoe-routing/olmoe_expert_counts.json" in names
    assert "moetrace/data/README.md" in names
    # adapters, exporters and cli are packaged under the moetrace namespace, not top level.
    assert {"moetrace/adapters/__init__.py", "moetrace/exporters/__init__.py", "moetrace/cli/__init__.py"} <= names
    assert not any(n.split("/")[0] in {"adapters", "exporters", "cli", "tests"} for n in names)


@pytest.mark.slow
def test_olmoe_bias_from_a_non_editable_install(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)], check=True)
    code = (
        "import moetrace, moetrace.reference.gate as r\n"
        "print(moetrace.__file__)\n"
        "b = r.olmoe_bias(8, layer=2, domain='github')\n"
        "assert b.shape == (8,) and abs(float(b.mean())) < 1e-6 and float(b.std()) > 0.05\n"
    )
    # Run from an empty directory with only the installed copy ahead of site-packages, so
    # neither the source tree nor the editable install can serve the import.
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         check=True, capture_output=True, text=True)
    assert Path(run.stdout.strip().splitlines()[0]).is_relative_to(target)
