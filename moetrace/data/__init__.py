"""Real data shipped with moetrace as package data (see ``README.md`` beside this file).

Files are found with :mod:`importlib.resources`, so they work from a source checkout, an
editable install and an installed wheel alike; nothing is read from outside the package.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

__all__ = ["data_file", "olmoe_counts"]


def data_file(relpath: str) -> Traversable:
    """The packaged data file ``relpath`` (e.g. ``"olmoe-routing/olmoe_expert_counts.json"``).

    Raises:
        FileNotFoundError: no such file in the package (a broken install: reinstall moetrace).
    """
    item = resources.files(__name__)
    for part in relpath.split("/"):
        item = item / part
    if not item.is_file():
        raise FileNotFoundError(f"moetrace package data {relpath!r} is missing; reinstall moetrace")
    return item


@cache
def olmoe_counts() -> dict[str, Any]:
    """The real OLMoE-1B-7B routing counts (allenai/OLMoE, Apache-2.0); keys in ``README.md``.

    ``expert_counts[domain]`` is 3 lists (OLMoE layers 0, 7, 15) of 64 assignment counts.
    The result is cached and shared: copy before mutating.
    """
    return json.loads(data_file("olmoe-routing/olmoe_expert_counts.json").read_text())
