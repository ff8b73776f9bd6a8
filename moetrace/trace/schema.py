"""HDF5 trace schema (version 2; version 1 traces stay readable): names, attributes and the errors readers raise.

``docs/trace-format.md`` documents every field; this module is the single
place where the names live.
"""

from __future__ import annotations

__all__ = [
    "COMPLETE_ATTR",
    "LAYOUT_ATTRS",
    "RANKS_GROUP",
    "RANK_COORDINATES",
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

#: Root attributes of the parallel layout that produced the rank rows (with ``ep_size``), keyed
#: by the :class:`moetrace.layout.RankLayout` field each holds. Absent in traces written before
#: layouts were recorded: every rank row then reads as holding its own tokens.
LAYOUT_ATTRS = {
    "world_size": "layout_world_size",
    "tp_size": "tp_size",
    "dp_size": "dp_size",
    "pp_size": "pp_size",
    "attn_tp_size": "attn_tp_size",
    "router_tp_size": "router_tp_size",
    "source": "layout_source",
}
#: Group of per-rank-row layout datasets ``[R]`` (one row per ``/stat`` rank row).
RANKS_GROUP = "ranks"
#: Datasets of :data:`RANKS_GROUP` (:class:`moetrace.layout.RankLayout` attributes of the same
#: name): global rank, coordinates, and the token group (rows of one group route the same
#: tokens; totals count one of them).
RANK_COORDINATES = ("rank", "tp_rank", "dp_rank", "ep_rank", "pp_rank", "attn_tp_rank", "router_rank", "token_group")


class TraceError(ValueError):
    """A file is not a readable moetrace trace; the message names file and problem."""


class TraceWriteError(OSError):
    """A trace could not be written; nothing that looks complete was left behind."""
