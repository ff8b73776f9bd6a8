"""The ``moetrace`` command: a typer app."""

from __future__ import annotations

import typer

import moetrace

from . import (
    analysis,
    audit,
    control,
    demo,
    diff,
    replicas,
    report,
    timeline,
    top,
    traces,
    traffic,
    verify,
)
from .errors import exit_when_reader_leaves
from .help import readable_help
from .placement import command as placement_command

__all__ = ["app", "command", "main"]

app = typer.Typer(
    name="moetrace",
    help="Observability and tracing for Mixture-of-Experts runtimes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help (click's): it rewraps every paragraph to the width it is given (COLUMNS, or 80 piped)
    # and never cuts an option name, where rich's panels squeeze it into boxes.
    rich_markup_mode=None,
)

# Offline analysis of traces.
app.command("analyze")(analysis.analyze)
app.command("plot")(analysis.plot)
app.command("placement")(placement_command.placement)
app.command("diff")(diff.diff)
app.command("audit")(audit.audit)
app.command("timeline")(timeline.timeline)
app.command("report")(report.report)
app.command("traffic")(traffic.traffic)
# Producing and examining trace files.
app.command("convert")(traces.convert_to_trace)
app.command("merge")(traces.merge)
app.command("inspect")(traces.inspect)
app.command("recover")(traces.recover_run)
app.command("verify")(verify.verify)
app.command("routes")(traces.routes)
# The whole job end to end on the reference runtime.
app.command("demo")(demo.demo)
# Request→replica routing: replay, compare, why.
app.add_typer(replicas.replicas_app, name="replicas")
# Driving a running process.
app.command("start")(control.start)
app.command("stop")(control.stop)
app.command("dump")(control.dump)
app.command("status")(control.status)
app.command("top")(top.top)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"moetrace {moetrace.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
) -> None:
    """moetrace: where did the tokens go?"""


def command() -> typer.core.TyperGroup:
    """The click command the ``moetrace`` program runs: :data:`app` with readable help (:func:`readable_help`)."""
    return readable_help(typer.main.get_command(app))


def main() -> None:
    """Console-script entry point."""
    exit_when_reader_leaves()
    command()(prog_name="moetrace")
