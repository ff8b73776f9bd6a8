"""One spelling for every option: a walk over every command's parameters (the click command the
``moetrace`` program runs) against a table of concepts and their one spelling.

A concept spelled another way (``--output`` for ``--out/-o``, ``--num-experts`` for ``--experts``), an
option name whose short flags differ between commands (``--out`` with and without ``-o``), or a
``--layers`` that is not a list of layer ids fails, naming the command and the option.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from moetrace.cli.app import command
from moetrace.cli.help import readable_help


@dataclasses.dataclass(frozen=True)
class Spelling:
    """A concept's one spelling (every flag it carries) and the other spellings it must never get."""

    flags: tuple[str, ...]
    never: tuple[str, ...]


CONCEPTS = {
    "the file or folder a command writes": Spelling(("--out", "-o"), ("--output", "--output-file", "--out-file", "--dest", "-O")),
    "model layer ids, a list like 0,7,12-15": Spelling(("--layers",), ("--layer-ids", "--layer-list")),
    "a count of MoE layers (the demo's model)": Spelling(("--moe-layers",), ("--num-layers", "--n-layers", "--num-moe-layers")),
    "experts per MoE layer": Spelling(("--experts",), ("--num-experts", "--n-experts", "--expert-count")),
    "physical expert slots of a placement": Spelling(("--slots",), ("--num-slots", "--physical-experts", "--num-replicas")),
    "one JSON document on stdout": Spelling(("--json",), ("--as-json", "--json-output")),
    "a progress bar on stderr": Spelling(("--progress", "--no-progress"), ("--show-progress", "--no-progress-bar")),
    "the pass phase of the passes read": Spelling(("--phase",), ("--pass-phase",)),
}


def _options(cmd: Any, path: str = "moetrace") -> list[tuple[str, Any]]:
    """``(command path, option)`` for every option of ``cmd`` and its subcommands."""
    rows = [(path, p) for p in cmd.params if p.param_type_name == "option"]
    for name, sub in getattr(cmd, "commands", {}).items():
        rows += _options(sub, f"{path} {name}")
    return rows


def spelling_problems(cmd: Any) -> list[str]:
    """What breaks the one-spelling rule in ``cmd``'s tree (empty: nothing)."""
    problems = []
    seen: dict[str, tuple[str, frozenset[str]]] = {}
    for where, option in _options(cmd):
        flags = frozenset(option.opts + option.secondary_opts)
        for concept, spelling in CONCEPTS.items():
            wrong = flags & set(spelling.never)
            if wrong:
                problems.append(f"{where}: {', '.join(sorted(wrong))} spells {concept!r}; its one spelling is {'/'.join(spelling.flags)}")
            if flags & set(spelling.flags[:1]) and flags != set(spelling.flags):
                problems.append(f"{where}: {'/'.join(sorted(flags))} is {concept!r} spelled {'/'.join(spelling.flags)} everywhere else")
        if "--layers" in flags and option.type_descriptor.annotation is not str:
            problems.append(f"{where}: --layers takes {option.type_descriptor.annotation!r}, not a list of layer ids like 0,7,12-15")
        long = max(option.opts, key=len)
        if long in seen and seen[long][1] != flags:
            problems.append(f"{where}: {'/'.join(sorted(flags))}, but {seen[long][0]} spells it {'/'.join(sorted(seen[long][1]))}")
        seen.setdefault(long, (where, flags))
    return problems


def test_every_option_has_one_spelling() -> None:
    assert spelling_problems(command()) == []


def test_the_walk_reaches_every_command() -> None:
    """The walk sees the options of subcommands' subcommands (``replicas replay --out``), so it can fail there."""
    places = {where for where, _ in _options(command())}
    assert {"moetrace analyze", "moetrace audit", "moetrace demo", "moetrace replicas replay", "moetrace placement"} <= places


def _second_spellings() -> typer.Typer:
    """The spellings issue 52 found, in a little app of their own."""
    app = typer.Typer()

    @app.command("audit")
    def audit(output: Annotated[Path, typer.Option("--output", "-o")]) -> None:
        """Writes with --output."""

    @app.command("demo")
    def demo(out: Annotated[Path, typer.Option("--out")], layers: Annotated[int, typer.Option("--layers")] = 4) -> None:
        """--out without -o, and a --layers that is a number."""

    @app.command("convert")
    def convert(num_experts: Annotated[int, typer.Option("--num-experts")] = 8) -> None:
        """--num-experts for --experts."""

    return app


@pytest.mark.parametrize("fragment", [
    "audit: --output spells 'the file or folder a command writes'",
    "demo: --out is 'the file or folder a command writes' spelled --out/-o everywhere else",
    "demo: --layers takes <class 'int'>",
    "convert: --num-experts spells 'experts per MoE layer'",
])
def test_negative_control_second_spellings_are_found(fragment: str) -> None:
    problems = spelling_problems(readable_help(typer.main.get_command(_second_spellings())))
    assert any(fragment in p for p in problems), problems
