"""Help reads well piped and at any width: whole option names, words for values (no Python types),
whole sentences, every line within the width."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
from moetrace.cli.app import app, command

#: What typer writes for a value's Python type: ``<list[Path]>``, ``<int range>``, ``<str>``, ``<bool>``.
PYTHON_LABEL = re.compile(r"<(?:list\[\w+\]|int range|float range|str|int|float|bool|path)>")


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    rows = [(path, cmd)]
    for name, sub in getattr(cmd, "commands", {}).items():
        rows += _commands(sub, (*path, name))
    return rows


def _help(cmd: Any, path: tuple[str, ...], width: int) -> str:
    ctx = cmd.make_context(" ".join(("moetrace", *path)), [], resilient_parsing=True, terminal_width=width, max_content_width=width)
    return cmd.get_help(ctx)


def _squeezed(text: str) -> str:
    return "".join(text.split())


ALL = _commands(command())


@pytest.mark.parametrize("width", [60, 80, 200])
@pytest.mark.parametrize(("path", "cmd"), ALL, ids=[" ".join(p) or "moetrace" for p, _ in ALL])
def test_help_reads_well_at_any_width(path: tuple[str, ...], cmd: Any, width: int) -> None:
    text = _help(cmd, path, width)
    assert not PYTHON_LABEL.search(text), text
    assert "…" not in text
    for option in (o for p in cmd.params if p.param_type_name == "option" for o in p.opts + p.secondary_opts):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), f"{option} is not whole in:\n{text}"
    long_words = {w for w in text.split() if len(w) > width - 30}
    assert all(len(line) <= width or any(w in line for w in long_words) for line in text.splitlines()), text
    # Whole sentences: the docstring's first paragraph and every subcommand's first sentence, every word in order.
    if cmd.help:
        assert _squeezed(cmd.help.split("\n\n")[0]) in _squeezed(text)
    for sub in getattr(cmd, "commands", {}).values():
        assert _squeezed(sub.short_help) in _squeezed(text) and not sub.short_help.endswith("...")


@pytest.mark.parametrize("columns", ["60", "80", "200"])
def test_routes_help_piped(columns: str) -> None:
    """The issue's case: ``routes --help`` into a pipe; its second paragraph was broken mid-sentence."""
    done = subprocess.run([sys.executable, "-m", "moetrace.cli", "routes", "--help"], capture_output=True, text=True,
                          env={"COLUMNS": columns, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Rows of positions no pass computed (prefix-cache hits) are all -1. Holds the rows of the requests written in memory" in " ".join(done.stdout.split())
    assert "-o, --out PATH" in done.stdout and "TRACES" in done.stdout
    assert not PYTHON_LABEL.search(done.stdout)


def test_negative_control_typers_own_help_has_python_labels_and_cut_sentences() -> None:
    """The same app without :func:`~moetrace.cli.help.readable_help`: the checks above would fail on it."""
    import typer

    plain = typer.main.get_command(app)
    routes = plain.commands["routes"]
    assert PYTHON_LABEL.search(_help(routes, ("routes",), 80))
    listing = _help(plain, (), 80)
    assert any(line.rstrip().endswith("...") for line in listing.splitlines() if line.startswith("  ") and "COMMAND" not in line)
