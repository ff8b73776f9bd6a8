"""Option parsing shared by the commands."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)

from .errors import EXIT_FAILED, CommandError

__all__ = ["PHASE_HELP", "existing_file", "output_path", "parse_layers", "pass_phase_option", "progress_meter", "stage_meter", "stdout_console",
           "writing"]

#: ``--phase``: the pass phase (what the engine's batch was), not a timing phase (route, dispatch, ...).
PHASE_HELP = ("Only the passes of one pass phase: prefill (prefill/extend), decode, mixed, idle or unknown "
              "(what the engine's batch was; a prefill- or decode-only view is what a PD-disaggregated deployment runs).")


def pass_phase_option(text: str | None) -> str | None:
    """``--phase`` checked against :data:`moetrace.pass_phase.PASS_PHASES` (``None``: every pass)."""
    if text is None:
        return None
    from moetrace.pass_phase import PASS_PHASES

    if text not in PASS_PHASES:
        raise CommandError(f"--phase {text!r}: expected one of {', '.join(PASS_PHASES)}")
    return text


def parse_layers(text: str | None) -> list[int] | None:
    """``"0,7,12-15"`` -> ``[0, 7, 12, 13, 14, 15]``; ``None`` -> all layers."""
    if text is None:
        return None
    layers: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else (part, "")
                first, last = int(lo), int(hi)
                if last < first:
                    raise ValueError(part)
                layers.extend(range(first, last + 1))
            else:
                layers.append(int(part))
    except ValueError:
        raise CommandError(f"--layers {text!r}: expected model layer ids like '0,7,12-15'") from None
    return layers


def existing_file(path: Path, what: str = "trace") -> Path:
    """``path`` if it is an existing file, else a CommandError naming it."""
    if not path.exists():
        raise CommandError(f"{path}: no such {what} file")
    if not path.is_file():
        if path.is_dir() and any(p.name.startswith(".moetrace-") and p.name.endswith((".h5", ".journal")) for p in path.iterdir()):
            raise CommandError(f"{path}: is a directory holding the segments of a recording that was not dumped; run `moetrace recover {path}` to gather them into a trace")
        raise CommandError(f"{path}: is not a file")
    return path


def output_path(path: Path) -> Path:
    """``path`` if its directory exists (the file itself is created or replaced)."""
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CommandError(f"{path}: directory {parent} does not exist; create it or pick another output path")
    if path.is_dir():
        raise CommandError(f"{path}: is a directory; give a file name")
    return path


@contextlib.contextmanager
def writing(path: Path) -> Iterator[Path]:
    """Run the block that writes ``path``; a failure to create or write a file in ``path``'s folder
    (the file, or the temporary an atomic write puts beside it) becomes one line saying what could not
    be written and why, exit 1 (docs/cli.md), never the temporary's name. Other errors pass through."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        yield path
    except OSError as exc:
        name = getattr(exc, "filename", None)
        if name is None or Path(name).parent.resolve() != folder.resolve():
            raise
        reason = (exc.strerror or str(exc)).lower()
        raise CommandError(f"could not write {path}: {reason} (creating a file in {folder}/); write it to a folder you can create files in",
                           EXIT_FAILED) from None


def stdout_console() -> Console:
    """A rich console on stdout; wide when not a terminal so piped tables keep whole names,
    unless ``COLUMNS`` sets the width (e.g. ``COLUMNS=80 moetrace analyze run.h5 | less``)."""
    console = Console()
    return console if console.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(width=160)


@contextlib.contextmanager
def progress_meter(enabled: bool | None, description: str, unit_bytes: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr for a task that reports ``update(done, total)`` (total known only once it starts).

    ``enabled=None`` shows it only when stderr is a terminal; ``unit_bytes`` shows sizes instead of counts.
    """
    console = Console(file=sys.stderr)
    if not (console.is_terminal if enabled is None else enabled):
        yield lambda done, total: None
        return
    amount = DownloadColumn() if unit_bytes else TextColumn("{task.completed:,.0f}/{task.total:,.0f}")
    with Progress(TextColumn("{task.description}"), BarColumn(), amount, TimeRemainingColumn(), console=console,
                  transient=console.is_terminal) as progress:
        task = progress.add_task(description, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


@contextlib.contextmanager
def stage_meter(enabled: bool | None) -> Iterator[Callable[[str, int, int], None]]:
    """A rich progress bar on stderr for work in stages: ``update(stage, done, total)`` names the stage it counts.

    ``enabled=None`` shows it only when stderr is a terminal.
    """
    console = Console(file=sys.stderr)
    if not (console.is_terminal if enabled is None else enabled):
        yield lambda stage, done, total: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,.0f}/{task.total:,.0f}"), TimeRemainingColumn(),
                  console=console, transient=console.is_terminal) as progress:
        tasks: dict[str, TaskID] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        yield update
