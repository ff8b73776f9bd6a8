"""Lazy package attributes: a package's public names imported from its modules on first use.

The package root, ``moetrace.analysis`` and ``moetrace.placement`` export names whose modules pull in heavy
dependencies (torch, rich, matplotlib, the planners); each sets ``__getattr__ = lazy_attributes(__name__,
{name: module})`` so that importing the package loads none of them (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` in ``modules`` is imported from the submodule
    ``modules[name]`` (relative to ``package``) when first asked for; any other name raises ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(importlib.import_module(f".{modules[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
