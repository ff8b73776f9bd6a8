"""Words for people: a count with its unit, in the right number (``1 group``, ``2 groups``, ``1 pass``, ``3 passes``)."""

from __future__ import annotations

__all__ = ["counted"]

#: Plurals that are not the noun + "s".
_PLURALS = {"pass": "passes", "process": "processes", "batch": "batches", "entry": "entries", "copy": "copies"}


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun`` in the number the count asks for: ``counted(1, "group") == "1 group"``,
    ``counted(3, "pass") == "3 passes"``, ``counted(1200, "token") == "1,200 tokens"``."""
    if count != 1:
        head, space, last = noun.rpartition(" ")  # "rank process" -> "rank processes"
        noun = plural or f"{head}{space}{_PLURALS.get(last, last + 's')}"
    return f"{count:,} {noun}"
