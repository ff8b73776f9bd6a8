"""HDF5 trace schema (version 2; version 1 traces stay readable): names, attributes and the errors readers raise.

``docs/trace-format.md`` documents every field; this module is the single
place where the names live.
"""

from __future__ import annotations

__all__ = [
    "CHECKSUM_ATTR",
    "COMPLETE_ATTR",
    "INTEGRITY_ATTR",
    "INTEGRITY_VERSION",
    "LAYOUT_ATTRS",
    "MERGED_DAMAGED_ATTR",
    "MERGED_RANKS_ATTR",
    "PADDING_IDS",
    "RANKS_GROUP",
    "RANK_COORDINATES",
    "RECOVERED_DAMAGED_ATTR",
    "REQUIRED_ATTRS",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "TraceDamageError",
    "TraceError",
    "TraceWriteError",
]

SCHEMA_NAME = "moetrace"
#: Version 2 added phase timing (root ``timing_*`` attributes, ``/stat`` timing aggregates,
#: the ``/timing`` group); version 1 traces have none of it and read as before.
SCHEMA_VERSION = 2
#: Root attribute set to True as the very last write before the atomic rename.
COMPLETE_ATTR = "complete"
#: Root attribute: the integrity scheme a trace was sealed with (absent: written before
#: checksums, read as unverified). See :mod:`moetrace.trace.integrity`.
INTEGRITY_ATTR = "integrity"
INTEGRITY_VERSION = 1
#: Attribute of every dataset and of the root: its BLAKE2b-128 digest (32 hex digits).
CHECKSUM_ATTR = "checksum"
#: ``[R, L]`` padding ids (-1) the hooks saw per rank and layer (traces since integrity v1):
#: with ``/stat/invalid_ids`` it closes the count ``tokens x top_k`` of every layer.
PADDING_IDS = "stat/padding_ids"
#: Root attribute of a recovered trace: JSON list of the damaged segments left out.
RECOVERED_DAMAGED_ATTR = "recovered_damaged"
#: Root attribute of a merged trace: JSON list of the damaged per-rank inputs left out.
MERGED_DAMAGED_ATTR = "merged_damaged"
#: Root attribute of a merged trace that left damaged inputs out: JSON list of the ranks
#: its ``/stat`` and ``/window`` rows hold, in row order (absent: all of 0..world_size-1).
MERGED_RANKS_ATTR = "merged_ranks"
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


class TraceDamageError(TraceError):
    """A trace's contents are damaged: a checksum, an HDF5 structure or an invariant fails.

    Attributes:
        path: the damaged file.
    """

    def __init__(self, path: object, message: str) -> None:
        super().__init__(message)
        self.path = path


class TraceWriteError(OSError):
    """A trace could not be written; nothing that looks complete was left behind."""
