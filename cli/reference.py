"""The CLI reference in ``docs/cli.md``, generated from the typer app.

``python -m moetrace.cli.reference`` rewrites the generated part of
``docs/cli.md`` (between the two markers); ``tests/cli`` checks it is current.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from typer.cli import get_docs_for_click

from .app import command as app_command

__all__ = ["BEGIN", "END", "render", "splice"]

BEGIN = "<!-- BEGIN GENERATED: python -m moetrace.cli.reference -->"
END = "<!-- END GENERATED -->"


def render() -> str:
    """Markdown reference of every command and option."""
    command = app_command()
    text = get_docs_for_click(obj=command, ctx=click.Context(command), name="moetrace", title="Command reference")
    return text.replace("# Command reference", "## Command reference", 1).replace("\n## `", "\n### `")


def splice(document: str, reference: str) -> str:
    """``document`` with the text between the markers replaced by ``reference``."""
    head, _, rest = document.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{reference.strip()}\n\n{END}{tail}"


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "docs" / "cli.md"
    document = path.read_text()
    if BEGIN not in document or END not in document:
        raise SystemExit(f"{path}: the markers {BEGIN!r} and {END!r} are missing")
    path.write_text(splice(document, render()))


if __name__ == "__main__":
    main()
