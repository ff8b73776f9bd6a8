"""The house's figures for docs/architecture.md's history table, from a source tree.

::

    python -m tests.packaging.house_figures                 # this checkout
    python -m tests.packaging.house_figures --rev 99a8f8b   # a commit (read through `git archive`)

Prints the modules directly in ``moetrace/`` (every ``*.py`` file there, ``__init__`` included), the
longest module of the package and its lines, the functions over 60 and over 80 lines (def to last line,
docstring included: :func:`tests.packaging.test_function_size.long_functions`), and the pairs the
``duplicates`` tool lists over the whole tree (tests, benchmarks and docs' code included). A commit is
read from an exported copy, so untracked files of the checkout never count.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from .import_graph import ROOTS
from .test_function_size import long_functions

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["duplicate_pairs", "figures"]


def duplicate_pairs(tree: Path) -> int | None:
    """Pairs the ``duplicates`` tool lists in ``tree`` (``None`` when the tool is not on PATH)."""
    if shutil.which("duplicates") is None:
        return None
    out = subprocess.run(["duplicates", "--repo", str(tree), "--most", "1", "--seconds", "300"],
                         capture_output=True, text=True, check=True).stdout
    first = out.strip().splitlines()[0] if out.strip() else ""
    if first.startswith("no duplicates"):
        return 0
    match = re.search(r"(\d+) pairs?", first)
    if match is None:
        raise ValueError(f"duplicates printed {first!r}; expected a count of pairs on its first line")
    return int(match.group(1))


def figures(tree: Path) -> dict[str, object]:
    """The figures of the source tree ``tree`` (a checkout or an exported commit)."""
    modules = sorted(p for folder in ROOTS for p in (tree / folder).rglob("*.py"))
    sizes = {p.relative_to(tree).as_posix(): len(p.read_text(encoding="utf-8").splitlines()) for p in modules}
    longest = max(sizes, key=sizes.__getitem__)
    long = long_functions(tree)
    return {
        "modules directly in moetrace/": len(list((tree / "moetrace").glob("*.py"))),
        "longest module": f"{longest} ({sizes[longest]} lines)",
        "functions over 60 lines": len(long),
        "functions over 80 lines": sum(1 for lines in long.values() if lines > 80),
        "duplicates pairs": duplicate_pairs(tree),
    }


def _exported(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="a commit to read (default: the working tree as it is)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moetrace-figures-") as tmp:
        tree = _exported(args.rev, Path(tmp)) if args.rev else ROOT
        for name, value in figures(tree).items():
            print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
