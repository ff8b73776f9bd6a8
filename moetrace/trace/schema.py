"""HDF5 trace schema (version 2; version 1 traces stay readable): names, attributes and the errors readers raise.

``docs/trace-format.md`` documents every field; this module is the single
place where the names live.
"""

from __future__ import annotations

__all__ = [
    "COMPACTED_FROM_ATTR",
    "COMPLETE_ATTR",
    "REQUIRED_ATTRS",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "TraceError",
    "TraceWriteError",
]

SCHEMA_NAME = "moetrace"
#: Version 2 added phase timing (root ``timing_*`` attributes, ``/stat`` timing aggregates,
#: the ``/timing`` group); version 1 traces have none of it and read as before.
SCHEMA_VERSION = 2
#: Root attribute set to True as the very last write before the atomic rename.
COMPLETE_ATTR = "complete"
#: Root attribute of a trace that retention compacted to its ``/stat`` totals: the mode it was written in.
COMPACTED_FROM_ATTR = "compacted_from"
#: Root attributes every trace (v1 and v2) carries.
REQUIRED_ATTRS = (
    "schema",
    "schema_version",
    "moetrace_version",
    "mode",
    "id_space",
    "num_layers",
    "num_logical_experts",
    "num_physical_experts",
    "top_k",
    "ep_size",
    "model",
    "engine",
    "created_unix",
    "run_id",
    "rank",
    "world_size",
)


class TraceError(ValueError):
    """A file is not a readable moetrace trace; the message names file and problem."""


class TraceWriteError(OSError):
    """A trace could not be written; nothing that looks complete was left behind."""
