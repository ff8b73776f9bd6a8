"""The contract check of the hooked vLLM internals against the installed release, and its negative control.

Each check runs ``python -m tests.vllm_contract.contract`` in a fresh interpreter (vLLM's process
groups and config are process-wide), prints its ``ok`` lines and exits 0. The negative control
runs the same check on a copy of the installed vLLM with one hooked name renamed in vLLM's
``base_router.py`` (``capture_fn``, the attribute ``_select_experts`` calls with the top-k ids
and moetrace's tap occupies); it must exit 1 with a message naming what broke. (Renaming
``set_capture_fn`` there is no control: ``FusedMoERouter`` declares it abstract, so vLLM's own
loader cannot build the routers and fails before any check.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROUTER = Path("model_executor/layers/fused_moe/router/base_router.py")
CHECKS = ("names", "loaded", "layers", "chained", "counts", "removed")


def _run_check(model: str, workdir: Path, python_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(python_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "tests.vllm_contract.contract", model, str(workdir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )


def _ok_lines(stdout: str) -> list[str]:
    return [line.split()[1].rstrip(":") for line in stdout.splitlines() if line.startswith("ok ")]


@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_the_hooked_internals_hold(model: str, tmp_path: Path) -> None:
    result = _run_check(model, tmp_path)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert _ok_lines(result.stdout) == list(CHECKS)


def _renamed_copy(destination: Path, pattern: str, replacement: str) -> Path:
    """A copy of the installed ``vllm`` package under ``destination`` with ``pattern`` renamed in base_router.py.

    Only the directories on the way to base_router.py are real; every other file and directory
    is a symlink to the installed one, so the copy costs nothing and differs in that one file.
    """
    import vllm

    installed = Path(vllm.__file__).parent
    root = destination / "vllm"
    here, target = installed, root
    for part in (*ROUTER.parent.parts, None):
        target.mkdir(parents=True)
        for entry in here.iterdir():
            if entry.name != part and entry.name != "__pycache__" and entry.name != ROUTER.name:
                (target / entry.name).symlink_to(entry)
        if part is None:
            break
        here, target = here / part, target / part
    source = (installed / ROUTER).read_text()
    renamed, count = re.subn(pattern, replacement, source)
    assert count, f"{pattern} does not occur in {installed / ROUTER}"
    (root / ROUTER).write_text(renamed)
    return destination


@pytest.mark.parametrize(
    ("pattern", "replacement", "message"),
    [(r"\bcapture_fn\b", "routed_ids_fn", r"CPURouter \(router of model\.layers\.0\..*\) has no `capture_fn`; moetrace\.adapters\.vllm\.layers reads it")],
    ids=["capture_fn"],
)
def test_a_wheel_with_a_hooked_name_renamed_fails_the_check(tmp_path: Path, pattern: str, replacement: str, message: str) -> None:
    copy = _renamed_copy(tmp_path / "renamed", pattern, replacement)
    result = _run_check("mixtral", tmp_path / "work", python_path=copy)
    print(result.stdout)
    assert str(copy / "vllm") in result.stdout  # the check ran on the renamed copy
    assert result.returncode == 1, result.stdout + result.stderr[-4000:]
    failure = [line for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    assert len(failure) == 1 and re.search(message, failure[0]), result.stdout
