"""Faults injected into an engine's own processes (vLLM's engine core, SGLang's scheduler), for the plugin fault tests.

:func:`fault_environment` gives the environment an engine is started with: the
folder of ``startup/sitecustomize.py`` on ``PYTHONPATH`` and the fault's
description, so that every Python process the engine spawns replaces one moetrace
callable with one that raises, and writes moetrace's warnings (one line each, with
the process id) to a file that :func:`warning_records` reads back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["RECORD", "fault_environment", "warning_records"]

RECORD = "moetrace-record"
"""How each warning line begins (a traceback's lines do not)."""

_STARTUP = Path(__file__).resolve().parent / "startup"


def fault_environment(target: str, log: Path, error: str = "RuntimeError", while_recording: bool = False) -> dict[str, str]:
    """Environment for an engine whose processes make ``target`` (``"module:attribute.path"``) raise ``error``
    (a builtin exception's name); ``while_recording``: only when its first argument (a recorder) records."""
    spec = {
        "target": target, "error": error, "while_recording": while_recording, "log": str(log),
        "format": f"{RECORD} %(process)d %(levelname)s %(name)s: %(message)s",
    }
    path = os.pathsep.join(p for p in (str(_STARTUP), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "MOETRACE_TEST_FAULT": json.dumps(spec)}


def warning_records(log: Path) -> list[str]:
    """The warning lines the engine's processes wrote (``"<RECORD> <pid> <LEVEL> <logger>: <message>"``)."""
    if not log.exists():
        return []
    return [line for line in log.read_text().splitlines() if line.startswith(RECORD)]
