"""Help that reads well at any width and piped: a word for what each value is, whole sentences.

typer labels a value with its Python type (``<list[Path]>``, ``<int range>``, ``<str>``) and lists
commands with their first sentence cut to the line (``Replay a request trace by its...``).
:func:`readable_help` gives every option the name of what it takes (``PATH``, ``INTEGER``, ``TEXT``),
every argument its own name in capitals, and every group's command list the whole first sentence,
which click wraps at the width it is given (``COLUMNS``, 80 when piped) like every other line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

__all__ = ["readable_help", "value_label"]

#: a value's Python type -> the word help shows for it.
_LABELS: dict[object, str] = {Path: "PATH", int: "INTEGER", float: "NUMBER"}


def value_label(param: Any) -> str:
    """The word help shows for the value of ``param`` (a typer option): ``PATH``, ``INTEGER``, ``NUMBER``,
    ``TEXT``, ``[a|b]`` for a choice; ``...`` after it when the option repeats."""
    described = param.type_descriptor
    if described.is_choice:
        return "[" + "|".join(str(getattr(choice, "value", choice)) for choice in described.choices or ()) + "]"
    one = get_args(described.annotation)[0] if described.is_list else described.annotation
    return _LABELS.get(one, "TEXT") + ("..." if described.is_list else "")


def _no_label(ctx: Any) -> None:
    """An argument's help row shows its name only (its name says what it is)."""
    return None


def readable_help(command: Any) -> Any:
    """``command`` (typer's click command, typer's own copy of click) and every subcommand with plain
    value labels and whole first sentences; returns ``command``."""
    for param in command.params:
        if param.param_type_name == "argument":
            param.metavar = (param.name or "value").upper()
            # typer appends the Python type to an argument's row whatever its metavar; its name is enough.
            param.display_type_rich = _no_label
        elif param.param_type_name == "option" and param.metavar is None and not (param.is_flag or param.count):
            param.metavar = value_label(param)
    for sub in getattr(command, "commands", {}).values():
        if sub.short_help is None and sub.help:
            sub.short_help = _first_sentence(sub.help)
        readable_help(sub)
    return command


def _first_sentence(text: str) -> str:
    """The first sentence of the first paragraph of ``text``, whole."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]
