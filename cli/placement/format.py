"""``moetrace placement --format``: write the plan in moetrace's JSON or in an engine's own format.

- ``moetrace`` (default): the whole document (``phy2log``, ``log2phy``, ``logcnt``, figures).
- ``sglang``: what SGLang's ``--init-expert-location`` loads
  (:mod:`moetrace.placement.sglang_plan`): ``{"physical_to_logical_map": [L, N]}``
  with one row per model layer (``L`` = the trace's highest layer id + 1, whichever
  ``--layers`` were planned: SGLang indexes the map by model layer; layers not
  planned, dense ones included, keep SGLang's trivial row) and ``N = --slots`` slots, which must equal
  SGLang's experts + ``--ep-num-redundant-experts``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetrace.placement.checks import PlacementError
from moetrace.placement.sglang_plan import write_sglang_plan
from moetrace.trace.writer import write_json_atomic

from ..errors import CommandError

__all__ = ["FORMATS", "write_plan"]

FORMATS = ("moetrace", "sglang")


def write_plan(path: Path, fmt: str, document: dict[str, Any], num_experts: int) -> None:
    """Write ``document`` (the placement command's JSON) to ``path`` in format ``fmt`` (atomically)."""
    if fmt == "moetrace":
        write_json_atomic(path, document)
        return
    if fmt != "sglang":
        raise CommandError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    layers = document["layers"]
    try:
        write_sglang_plan(path, document["phy2log"], layers, document["num_model_layers"], num_experts)
    except PlacementError as exc:
        raise CommandError(f"--format sglang: {exc}") from None
