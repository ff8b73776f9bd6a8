#!/usr/bin/env python3
"""Write and compare the virtualenv locks in ``locks/``: how ``make lock`` and ``make test-latest`` see them.

Usage::

    python3 .ci/locks.py freeze UV PYTHON LOCK    # write LOCK from what PYTHON's virtualenv holds
    python3 .ci/locks.py compare UV PYTHON LOCK   # print every package whose version differs from LOCK

A lock is one line ``name==version`` per installed distribution, transitive ones included, sorted,
after a header saying where it came from; ``make`` installs a virtualenv from its lock with
``uv pip install --no-deps -r LOCK``, so what a fresh machine gets is exactly what the lock says,
whatever PyPI has released since. moetrace itself (installed editable) and pip (which the
virtualenv brings) are left out. ``compare`` exits 0 whatever differs: the differences are what
``make test-latest`` reports beside its test results.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

__all__ = ["compare", "differences", "freeze", "parse_lock", "read_installed"]

HEADER = (
    "# {name}: every package of this virtualenv at its exact version, transitive ones included.\n"
    "# Written by `make lock` from the newest releases the declared ranges allow (pyproject.toml, the Makefile's\n"
    "# recipes, constraints.txt); `make` installs it with `uv pip install --no-deps -r`. Do not edit by hand.\n"
)
_LEFT_OUT = {"pip", "moetrace"}
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)$")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_installed(uv: str, python: str) -> dict[str, str]:
    """``{normalised name: version}`` of every distribution installed for ``python`` (editables left out)."""
    listing = subprocess.run([uv, "pip", "freeze", "--python", python, "--exclude-editable"],
                             capture_output=True, text=True, check=True).stdout
    return parse_lock(listing)


def parse_lock(text: str) -> dict[str, str]:
    """``{normalised name: version}`` from lock or freeze text; comments, blank lines and ``pip``/``moetrace`` skipped.

    Raises:
        ValueError: a line that is neither a comment nor ``name==version`` (naming it).
    """
    pins: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _PIN.match(line)
        if match is None:
            raise ValueError(f"line {number} {line!r} is not name==version; regenerate the lock with `make lock`")
        name = _normal(match["name"])
        if name not in _LEFT_OUT:
            pins[name] = match["version"]
    return pins


def freeze(uv: str, python: str, lock: Path) -> None:
    """Write ``lock`` from ``python``'s virtualenv."""
    pins = read_installed(uv, python)
    lock.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))
    lock.write_text(HEADER.format(name=lock.name) + body)
    print(f"{lock}: {len(pins)} packages")


def differences(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    """One line per package whose version differs: ``name: lock -> newest`` (``-`` where absent)."""
    names = sorted(set(locked) | set(installed))
    return [f"{name}: {locked.get(name, '-')} -> {installed.get(name, '-')}" for name in names if locked.get(name) != installed.get(name)]


def compare(uv: str, python: str, lock: Path) -> None:
    """Print how ``python``'s virtualenv differs from ``lock``."""
    lines = differences(parse_lock(lock.read_text()), read_installed(uv, python))
    print(f"{lock} against the newest releases ({python}): " + (f"{len(lines)} differ" if lines else "all equal"))
    for line in lines:
        print(f"  {line}")


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] not in ("freeze", "compare"):
        print("usage: python3 .ci/locks.py freeze|compare UV PYTHON LOCK", file=sys.stderr)
        return 2
    command, uv, python, lock = argv
    (freeze if command == "freeze" else compare)(uv, python, Path(lock))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
