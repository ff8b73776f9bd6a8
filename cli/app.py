"""The ``moetrace`` command: a typer app."""

from __future__ import annotations

import typer

import moetrace

__all__ = ["app", "main"]

app = typer.Typer(name="moetrace", help="Observability and tracing for Mixture-of-Experts runtimes.", no_args_is_help=True)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"moetrace {moetrace.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
) -> None:
    """moetrace: where did the tokens go?"""


def main() -> None:
    """Console-script entry point."""
    app()
