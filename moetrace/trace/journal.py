"""The journal of one rank's recording: append-only JSON lines beside its segments.

``.moetrace-<run_id>-rank<r>.journal`` (no fsync: a killed process's writes survive
in the page cache) says which process wrote the run, what each segment holds,
which segments a ``dump_record`` consumed and which passes were in the open
segment, so ``moetrace recover`` can tell what a crash lost.

The journal stays small however long the recording runs: after every
``dumped`` and ``checkpoint`` event it is rewritten (a temporary beside it,
then a rename) to what recovery can still use — the ``start`` event, the
last :data:`KEEP_DUMPS` ``dumped`` events, the last checkpoint, and the
``rows``/``segment`` events of segments no dump consumed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

__all__ = ["KEEP_DUMPS", "Journal"]

#: ``dumped`` events a compacted journal keeps (recover lists them as the dumps the run made).
KEEP_DUMPS = 8
_COMPACT_AFTER = ("dumped", "checkpoint")


def _still_useful(events: list[dict[str, object]]) -> list[dict[str, object]]:
    """The events recovery can still use (see the module docstring), in order."""
    dumps = [e for e in events if e.get("event") == "dumped"]
    consumed = {int(i) for e in dumps for i in e.get("segments", [])}  # type: ignore[union-attr]
    kept_dumps = {id(e) for e in dumps[-KEEP_DUMPS:]}
    checkpoints = [e for e in events if e.get("event") == "checkpoint"]
    last_checkpoint = id(checkpoints[-1]) if checkpoints else None
    out = []
    for e in events:
        kind = e.get("event")
        if kind == "dumped" and id(e) not in kept_dumps:
            continue
        if kind == "checkpoint" and id(e) != last_checkpoint:
            continue
        if kind in ("rows", "segment") and e.get("segment") in consumed:
            continue
        out.append(e)
    return out


class Journal:
    """Append-only JSON-lines notes of one rank's recording (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._events = self.read(self.path) if self.path.exists() else []
        self._fh = open(self.path, "a", encoding="utf-8")

    def note(self, event: str, **fields: object) -> None:
        record = {"event": event, "unix": time.time(), **fields}
        with self._lock:
            if self._fh.closed:
                return
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
            self._events.append(record)
            if event in _COMPACT_AFTER:
                self._compact()

    def _compact(self) -> None:
        """Rewrite the file with :func:`_still_useful` events (atomically; a failure keeps the old file)."""
        kept = _still_useful(self._events)
        if len(kept) == len(self._events):
            return
        tmp = self.path.with_name(self.path.name + ".compact")
        try:
            with open(tmp, "w", encoding="utf-8") as out:
                out.writelines(json.dumps(e) + "\n" for e in kept)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return  # the appended journal is still whole
        self._fh.close()
        self._fh = open(self.path, "a", encoding="utf-8")
        self._events = kept

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
