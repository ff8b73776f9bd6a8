"""The journal of one rank's recording: append-only JSON lines beside its segments.

``.moetrace-<run_id>-rank<r>.journal`` (no fsync: a killed process's writes survive
in the page cache) says which process wrote the run, what each segment holds,
which segments a ``dump_record`` consumed and which passes were in the open
segment, so ``moetrace recover`` can tell what a crash lost.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

__all__ = ["Journal"]


class Journal:
    """Append-only JSON-lines notes of one rank's recording (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fh = open(self.path, "a", encoding="utf-8")

    def note(self, event: str, **fields: object) -> None:
        line = json.dumps({"event": event, "unix": time.time(), **fields})
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line + "\n")
                self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, object]]:
        """The journal's events; a torn last line (killed mid-write) is ignored."""
        events = []
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events
