#!/usr/bin/env python3
"""Run `uv pip ...` with this machine's pip settings: how `make` installs every virtualenv.

Usage: ``python3 .ci/uv_pip.py UV install|uninstall ARGS...`` (UV: the uv executable).

uv installs the same pins as pip in a fraction of the time (``docs/development.md``: the four
virtualenvs of ``make test``), but reads no pip configuration. A machine whose pip is told where
its wheels lie (pip.conf or ``PIP_*`` variables: find-links, index URLs, a constraints file, a CA
bundle) would resolve differently under uv: torch's CUDA build from PyPI instead of the CPU wheel
on disk. This hands pip's effective settings (``pip config list``: environment over files) to
``uv pip install``, and resolves as pip does, the best version over every index
(``--index-strategy unsafe-best-match``).

Every install also compiles the installed files to bytecode (``--compile-bytecode``, which pip
does and uv does not by default). Where ``PYTHONDONTWRITEBYTECODE=1`` is set (this machine's
shell sets it) nothing ever writes ``.pyc`` files otherwise, so every Python process of the suite
compiled torch, vLLM or SGLang again at import: the engine suites took 2-2.7x longer (vLLM 740
s against 348, SGLang 775 s against 289, the 2026-12-02 17:08 ``.ci/run``, 41.5 minutes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

__all__ = ["parse_pip_config", "pip_settings", "uv_install_options"]

# `pip config list` lines: `global.find-links='/opt/wheels'`, `:env:.find-links='/opt/wheels'`.
_LINE = re.compile(r"^(?P<origin>[\w:-]*)\.(?P<key>[\w-]+)='(?P<value>.*)'$")
# pip option -> uv option; pip's values are whitespace-separated lists.
_OPTIONS = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """pip's effective settings for ``python``'s pip: ``{key: value}``, environment over files."""
    try:
        listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f".ci/uv_pip.py: cannot read pip's configuration with `{python} -m pip config list` ({exc}); install pip for {python}") from exc
    return parse_pip_config(listing)


def parse_pip_config(listing: str) -> dict[str, str]:
    """``{key: value}`` from ``pip config list`` text; an ``:env:`` (PIP_*) entry wins over a file's."""
    files: dict[str, str] = {}
    environment: dict[str, str] = {}
    for line in listing.splitlines():
        match = _LINE.match(line.strip())
        if match:
            target = environment if match["origin"] == ":env:" else files
            target[match["key"]] = match["value"]
    return {**files, **environment}


def uv_install_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``(options, environment)`` that give ``uv pip install`` what ``settings`` give pip."""
    options = ["--index-strategy", "unsafe-best-match"]
    for key, flag in _OPTIONS.items():
        for value in settings.get(key, "").split():
            options += [flag, value]
    environment = {}
    if settings.get("cert"):
        environment["SSL_CERT_FILE"] = settings["cert"]
    if settings.get("default-timeout"):
        environment["UV_HTTP_TIMEOUT"] = settings["default-timeout"]
    return options, environment


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("install", "uninstall"):
        print("usage: python3 .ci/uv_pip.py UV install|uninstall ARGS...", file=sys.stderr)
        return 2
    uv, command, *rest = argv
    environment = dict(os.environ)
    if command == "install":
        options, extra = uv_install_options(pip_settings())
        environment.update(extra)
        rest = ["--compile-bytecode", *options, *rest]
    return subprocess.call([uv, "pip", command, *rest], env=environment)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
