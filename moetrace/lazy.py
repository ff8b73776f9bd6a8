"""Lazy package attributes: a package's public names imported from its modules on first use, and renamed
names that still answer, with a warning, for one release.

The package root, ``moetrace.analysis`` and ``moetrace.placement`` export names whose modules pull in heavy
dependencies (torch, rich, matplotlib, the planners); each sets ``__getattr__ = lazy_attributes(__name__,
{name: module})`` so that importing the package loads none of them (PEP 562). A module that renamed a public
name sets ``__getattr__ = renamed_attributes(__name__, {old: new}, globals().__getitem__)``: the old name
gives the new one's object and a ``DeprecationWarning`` naming the new name (never a silent re-export).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes", "renamed_attributes"]


def lazy_attributes(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` in ``modules`` is imported from the submodule
    ``modules[name]`` (relative to ``package``) when first asked for; any other name raises ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(importlib.import_module(f".{modules[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def renamed_attributes(module: str, renames: Mapping[str, str], find: Callable[[str], Any],
                       otherwise: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``: an old name in ``renames`` warns (``DeprecationWarning``
    naming ``renames[old]``) and returns ``find(renames[old])``; any other name goes to ``otherwise`` (say a
    :func:`lazy_attributes`), else raises ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name in renames:
            warnings.warn(f"{module}.{name} is renamed {module}.{renames[name]}; the old name goes in the next release",
                          DeprecationWarning, stacklevel=2)
            return find(renames[name])
        if otherwise is not None:
            return otherwise(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
