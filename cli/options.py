"""Option parsing shared by the commands."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from .errors import CommandError

__all__ = ["existing_file", "output_path", "parse_layers", "stdout_console"]


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


def stdout_console() -> Console:
    """A rich console on stdout; wide when not a terminal so piped tables keep whole names,
    unless ``COLUMNS`` sets the width (e.g. ``COLUMNS=80 moetrace analyze run.h5 | less``)."""
    console = Console()
    return console if console.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(width=160)
