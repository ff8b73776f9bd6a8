"""What the live-engine test packages (tests/vllm, tests/sglang) share.

Each engine runs in its own virtualenv; its tests are collected only where the engine
imports, and a run that says it is the engine's (``MOETRACE_REQUIRE_<ENGINE>=1``) fails
loudly when it does not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping

__all__ = ["environment", "uncollected_without"]


def uncollected_without(package: str, flag: str, venv: str) -> list[str]:
    """``collect_ignore_glob`` for a conftest: every test file when ``package`` is missing.

    Raises ``RuntimeError`` when ``package`` is missing but ``flag=1`` is set.
    """
    if importlib.util.find_spec(package) is not None:
        return []
    if os.environ.get(flag) == "1":
        raise RuntimeError(
            f"{flag}=1 but {package} is not importable in this interpreter; bootstrap its environment "
            f"with `make {venv}/.installed` and run `{venv}/bin/python -m pytest tests/{package}`"
        )
    return ["test_*.py"]


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` (processes started inside inherit it), restored afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
