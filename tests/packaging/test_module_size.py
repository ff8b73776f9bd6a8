"""No module of the distribution runs past about 500 lines unless its docstring says why."""

from __future__ import annotations

import ast
from pathlib import Path

from .import_graph import ROOTS

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500
#: The phrase a longer module's docstring starts its reason with.
REASON = "Over 500 lines:"


def long_modules_without_reason(root: Path) -> list[str]:
    """``path (lines)`` of every module over :data:`LIMIT` lines whose docstring lacks :data:`REASON`."""
    found = []
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = len(text.splitlines())
            if lines > LIMIT and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
                found.append(f"{path.relative_to(root)} ({lines} lines)")
    return found


def test_long_modules_say_why() -> None:
    assert long_modules_without_reason(ROOT) == [], f"split these modules, or state the reason in their docstring ('{REASON} ...')"


def test_negative_control_a_long_module_is_named(tmp_path: Path) -> None:
    (tmp_path / "moetrace").mkdir()
    (tmp_path / "moetrace" / "big.py").write_text('"""Big."""\n' + "x = 1\n" * LIMIT)
    (tmp_path / "moetrace" / "said.py").write_text(f'"""Said.\n\n{REASON} one table.\n"""\n' + "x = 1\n" * LIMIT)
    (tmp_path / "moetrace" / "small.py").write_text('"""Small."""\n')
    assert long_modules_without_reason(tmp_path) == [f"moetrace/big.py ({LIMIT + 1} lines)"]
