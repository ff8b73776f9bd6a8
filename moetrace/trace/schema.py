"""HDF5 trace schema (version 2; version 1 traces stay readable): names, attributes, the header and the errors readers raise.

``docs/trace-format.md`` documents every field; this module is the single
place where the names live: :class:`Attr` (root attributes), :class:`Data`
(groups and datasets; :func:`dataset` for a field of a group) and
:class:`TraceHeader`, the root attributes and static datasets every trace
starts with, built from a recorder's configuration (:meth:`TraceHeader.of_config`)
or from an existing trace's attributes (:meth:`TraceHeader.of_attrs`).
tests/packaging/test_schema_names.py fails when a name is spelled elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import h5py
import numpy as np

from .._version import __version__
from ..layout import RankLayout
from ..pass_phase import PASS_PHASES

__all__ = [
    "CANDIDATE_FIELDS",
    "CHECKSUM_ATTR",
    "COMPACTED_FROM_ATTR",
    "COMPLETE_ATTR",
    "INTEGRITY_ATTR",
    "INTEGRITY_VERSION",
    "LAYOUT_ATTRS",
    "MERGED_DAMAGED_ATTR",
    "MERGED_RANKS_ATTR",
    "MIGRATION_FIELDS",
    "PADDING_IDS",
    "PASS_FIELDS",
    "PHASE_COUNTS",
    "RANKS_GROUP",
    "RANK_COORDINATES",
    "RECOVERED_DAMAGED_ATTR",
    "REQUEST_FIELDS",
    "REQUIRED_ATTRS",
    "SAME_RUN_ATTRS",
    "SAME_SEGMENT_ATTRS",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "STREAM_GROUP",
    "STRING_DTYPE",
    "TIMING_STAT_FIELDS",
    "TOKEN_FIELDS",
    "TOKEN_REQUEST_FIELDS",
    "Attr",
    "Data",
    "TraceDamageError",
    "TraceError",
    "TraceHeader",
    "TraceWriteError",
    "dataset",
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




class Attr:
    """Root attribute names."""

    SCHEMA = "schema"
    SCHEMA_VERSION = "schema_version"
    MOETRACE_VERSION = "moetrace_version"
    MODE = "mode"
    ID_SPACE = "id_space"
    NUM_LAYERS = "num_layers"
    NUM_LOGICAL_EXPERTS = "num_logical_experts"
    NUM_PHYSICAL_EXPERTS = "num_physical_experts"
    TOP_K = "top_k"
    EP_SIZE = "ep_size"
    MODEL = "model"
    ENGINE = "engine"
    CREATED_UNIX = "created_unix"
    RUN_ID = "run_id"
    RANK = "rank"
    WORLD_SIZE = "world_size"
    HIDDEN_SIZE = "hidden_size"
    DTYPE_BYTES = "dtype_bytes"
    COMPLETE = COMPLETE_ATTR
    # segments and checkpoints of a running recording
    SEGMENT_INDEX = "segment_index"
    FIRST_PASS = "first_pass"
    LAST_PASS = "last_pass"
    SEGMENT_UNIX = "segment_unix"
    CHECKPOINT_UNIX = "checkpoint_unix"
    # merge and recover
    MERGED_FROM = "merged_from"
    RECOVERED = "recovered"
    RECOVERED_LAST_PASS = "recovered_last_pass"
    RECOVERED_LAST_SEGMENT_UNIX = "recovered_last_segment_unix"
    RECOVERED_SEGMENTS = "recovered_segments"
    RECOVERED_LOST = "recovered_lost"
    RECOVERED_RANKS = "recovered_ranks"
    # phase timing (schema version 2)
    TIMING_PREFIX = "timing_"
    TIMING_PHASES = "timing_phases"
    TIMING_CLOCK = "timing_clock"
    TIMING_HISTOGRAM_EDGES = "timing_histogram_edges"
    # request→replica routing (/requests)
    ROUTING_POLICIES = "routing_policies"
    ROUTING_REASONS = "routing_reasons"
    ROUTING_NUM_REPLICAS = "routing_num_replicas"
    ROUTING_BLOCK_SIZE = "routing_block_size"
    ROUTING_CLOCK = "routing_clock"
    # pass phases (prefill/decode/...; moetrace.pass_phase): JSON list of the names, in code order
    PASS_PHASES = "pass_phases"


def dataset(group: str, field: str) -> str:
    """The path of ``field`` in ``group``: ``dataset(Data.STAT, "physical_count") == Data.STAT_PHYSICAL_COUNT``."""
    return f"{group}/{field}"


class Data:
    """Group and dataset paths."""

    LAYERS = "layers"
    PHYSICAL_TO_LOGICAL = "physical_to_logical"
    STAT = "stat"
    STAT_PHYSICAL_COUNT = "stat/physical_count"
    STAT_LOGICAL_COUNT = "stat/logical_count"
    STAT_INVALID_IDS = "stat/invalid_ids"
    STAT_SEND_COUNT = "stat/send_count"
    STAT_RECV_COUNT = "stat/recv_count"
    STAT_DROPPED = "stat/dropped"
    STAT_NUM_PASSES = "stat/num_passes"
    STAT_NUM_TOKENS = "stat/num_tokens"
    STAT_DROPPED_PASSES = "stat/dropped_passes"
    STAT_PASS_PHASE_PHYSICAL_COUNT = "stat/pass_phase_physical_count"
    STAT_PASS_PHASE_NUM_PASSES = "stat/pass_phase_num_passes"
    STAT_PASS_PHASE_NUM_TOKENS = "stat/pass_phase_num_tokens"
    STAT_PASS_PHASE_NUM_REQUESTS = "stat/pass_phase_num_requests"
    WINDOW = "window"
    WINDOW_PASS_ID = "window/pass_id"
    WINDOW_TIMESTAMP = "window/timestamp"
    WINDOW_NUM_TOKENS = "window/num_tokens"
    WINDOW_PHYSICAL_COUNT = "window/physical_count"
    WINDOW_PASS_PHASE = "window/pass_phase"
    WINDOW_NUM_REQUESTS = "window/num_requests"
    PASSES = "passes"
    PASSES_PASS_ID = "passes/pass_id"
    PASSES_TIMESTAMP = "passes/timestamp"
    PASSES_NUM_TOKENS = "passes/num_tokens"
    PASSES_PHYSICAL_COUNT = "passes/physical_count"
    PASSES_INVALID_IDS = "passes/invalid_ids"
    PASSES_SEND_COUNT = "passes/send_count"
    PASSES_RECV_COUNT = "passes/recv_count"
    PASSES_PASS_PHASE = "passes/pass_phase"
    PASSES_NUM_REQUESTS = "passes/num_requests"
    TOKENS = "tokens"
    TOKENS_TOPK_IDS = "tokens/topk_ids"
    TOKENS_PASS_ID = "tokens/pass_id"
    TOKENS_POSITION = "tokens/position"
    TOKENS_RANK = "tokens/rank"
    TOKENS_PASS_PHASE = "tokens/pass_phase"
    TOKENS_REQUEST = "tokens/request"
    TOKENS_REQUEST_POSITION = "tokens/request_position"
    REQUEST_TABLE = "request_table"
    REQUEST_TABLE_ID = "request_table/id"
    TIMING = "timing"
    RANKS = RANKS_GROUP
    REQUESTS = "requests"
    REQUESTS_CANDIDATES = "requests/candidates"
    REQUESTS_MIGRATIONS = "requests/migrations"


#: Root attributes every rank of one recording shares (``merge`` and distributed analysis check them).
SAME_RUN_ATTRS = (Attr.MODE, Attr.ID_SPACE, Attr.NUM_LAYERS, Attr.NUM_LOGICAL_EXPERTS, Attr.NUM_PHYSICAL_EXPERTS, Attr.TOP_K,
                  Attr.EP_SIZE, Attr.WORLD_SIZE, Attr.HIDDEN_SIZE, Attr.DTYPE_BYTES, *LAYOUT_ATTRS.values())
#: Root attributes the segments of one rank's recording share (``concat_segments`` checks them).
SAME_SEGMENT_ATTRS = (Attr.RUN_ID, Attr.RANK, Attr.MODE, Attr.NUM_LAYERS, Attr.NUM_PHYSICAL_EXPERTS, Attr.TOP_K, Attr.EP_SIZE)
#: ``/stat`` rows of the per-pass-phase counts ``[R, 3, Q]`` that travel with the counter rows split by
#: pass phase: passes, tokens and requests (the sum of each pass's request count) of each pass phase.
PHASE_COUNTS = (Data.STAT_PASS_PHASE_NUM_PASSES, Data.STAT_PASS_PHASE_NUM_TOKENS, Data.STAT_PASS_PHASE_NUM_REQUESTS)
#: Fields of ``/passes`` (``per_pass``) and ``/tokens`` (``per_token``), in reading order.
PASS_FIELDS = ("pass_id", "timestamp", "num_tokens", "physical_count", "invalid_ids", "send_count", "recv_count")
TOKEN_FIELDS = ("topk_ids", "pass_id", "position")
#: Fields of ``/tokens`` that tie a row to its request (``per_token`` traces since issue 35; absent before):
#: ``request`` indexes ``/request_table/id`` (-1: no known request), ``request_position`` is the row's
#: position in that request (-1 with it).
TOKEN_REQUEST_FIELDS = ("request", "request_position")
#: The streamed group of each streaming mode.
STREAM_GROUP = {"per_pass": Data.PASSES, "per_token": Data.TOKENS}
#: Phase-timing aggregates under ``/stat`` (schema version 2).
TIMING_STAT_FIELDS = ("phase_seconds_sum", "phase_seconds_max", "phase_count", "phase_histogram", "step_seconds_sum",
                      "step_seconds_max", "step_count", "step_histogram", "peak_memory_bytes", "timing_dropped_passes")


#: HDF5 variable-length UTF-8 strings (request ids, sessions).
STRING_DTYPE = h5py.string_dtype("utf-8")
_STR = STRING_DTYPE

#: ``/requests/<name>``: dtype of each per-request column.
REQUEST_FIELDS: dict[str, np.dtype] = {
    "id": _STR,
    "seq": np.dtype(np.int64),
    "session": _STR,
    "arrival": np.dtype(np.float64),
    "decision": np.dtype(np.float64),
    "start": np.dtype(np.float64),
    "first_token": np.dtype(np.float64),
    "finish": np.dtype(np.float64),
    "replica": np.dtype(np.int32),
    "policy": np.dtype(np.int8),
    "reason": np.dtype(np.int8),
    "input_tokens": np.dtype(np.int64),
    "cached_tokens": np.dtype(np.int64),
    "output_tokens": np.dtype(np.int64),
    "predicted_tokens": np.dtype(np.int64),
    "best_tokens": np.dtype(np.int64),
    "queue_wait": np.dtype(np.float64),
    "ttft": np.dtype(np.float64),
    "e2e": np.dtype(np.float64),
    "finished": np.dtype(np.int8),
    "cand_start": np.dtype(np.int64),
    "cand_count": np.dtype(np.int32),
}
#: ``/requests/candidates/<name>``: one row per candidate replica of a decision.
CANDIDATE_FIELDS: dict[str, np.dtype] = {
    "request_seq": np.dtype(np.int64),
    "replica": np.dtype(np.int32),
    "queue": np.dtype(np.int32),
    "running": np.dtype(np.int32),
    "inflight_tokens": np.dtype(np.int64),
    "match_blocks": np.dtype(np.int32),
    "match_tokens": np.dtype(np.int64),
    "session_owner": np.dtype(np.int8),
    "est_wait": np.dtype(np.float64),
    "est_ttft": np.dtype(np.float64),
    "score": np.dtype(np.float64),
}
#: ``/requests/migrations/<name>``: one row per session moved between replicas.
MIGRATION_FIELDS: dict[str, np.dtype] = {
    "time": np.dtype(np.float64),
    "session": _STR,
    "source": np.dtype(np.int32),
    "target": np.dtype(np.int32),
}


class HeaderSource(Protocol):
    """What :meth:`TraceHeader.of_config` reads (a :class:`~moetrace.config.RecorderConfig`)."""

    mode: str
    num_layers: int
    num_physical_experts: int
    top_k: int
    ep_size: int
    model: str
    engine: str
    dtype_bytes: int

    @property
    def has_logical_map(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class TraceHeader:
    """Root attributes and static datasets of a trace."""

    mode: str
    id_space: str
    num_layers: int
    num_physical_experts: int
    top_k: int
    ep_size: int
    layer_ids: np.ndarray  # [L] int
    physical_to_logical: np.ndarray  # [L, P] int
    model: str = ""
    engine: str = ""
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    rank: int = 0
    world_size: int = 1
    hidden_size: int = 0
    dtype_bytes: int = 0
    #: Parallel layout of each rank row, in row order (``()``: not known; see :mod:`moetrace.trace.ranks`).
    layouts: tuple[RankLayout, ...] = ()

    @property
    def num_logical_experts(self) -> int:
        return int(np.max(self.physical_to_logical)) + 1

    @classmethod
    def of_config(cls, config: HeaderSource, run_id: str, rank: int, world_size: int, layouts: tuple[RankLayout, ...] = ()) -> TraceHeader:
        """The header of a recording with ``config`` (a :class:`~moetrace.config.RecorderConfig`); ``layouts``: each rank row's."""
        cfg: Any = config
        return cls(
            mode=cfg.mode,
            id_space="physical" if cfg.has_logical_map else "logical",
            num_layers=cfg.num_layers,
            num_physical_experts=cfg.num_physical_experts,
            top_k=cfg.top_k,
            ep_size=cfg.ep_size,
            layer_ids=np.asarray(cfg.layer_ids),
            physical_to_logical=cfg.physical_to_logical,
            model=cfg.model,
            engine=cfg.engine,
            run_id=run_id,
            rank=rank,
            world_size=world_size,
            hidden_size=cfg.hidden_size or 0,
            dtype_bytes=cfg.dtype_bytes,
            layouts=layouts,
        )

    @classmethod
    def of_attrs(cls, attrs: Mapping[str, Any], layers: np.ndarray, mapping: np.ndarray, **changes: Any) -> TraceHeader:
        """A header that reproduces a trace's root attributes (``changes`` replace fields, e.g. ``rank=-1``, ``layouts=...``)."""
        header = cls(
            mode=str(attrs[Attr.MODE]),
            id_space=str(attrs[Attr.ID_SPACE]),
            num_layers=int(attrs[Attr.NUM_LAYERS]),
            num_physical_experts=int(attrs[Attr.NUM_PHYSICAL_EXPERTS]),
            top_k=int(attrs[Attr.TOP_K]),
            ep_size=int(attrs[Attr.EP_SIZE]),
            layer_ids=layers,
            physical_to_logical=mapping,
            model=str(attrs[Attr.MODEL]),
            engine=str(attrs[Attr.ENGINE]),
            run_id=str(attrs[Attr.RUN_ID]),
            rank=int(attrs[Attr.RANK]),
            world_size=int(attrs[Attr.WORLD_SIZE]),
            hidden_size=int(attrs.get(Attr.HIDDEN_SIZE, 0)),
            dtype_bytes=int(attrs.get(Attr.DTYPE_BYTES, 0)),
        )
        return dataclasses.replace(header, **changes) if changes else header

    def attrs(self) -> dict[str, object]:
        """The root attributes a new trace starts with (``complete`` False until the commit)."""
        return {
            Attr.SCHEMA: SCHEMA_NAME,
            Attr.SCHEMA_VERSION: SCHEMA_VERSION,
            Attr.MOETRACE_VERSION: __version__,
            Attr.MODE: self.mode,
            Attr.ID_SPACE: self.id_space,
            Attr.NUM_LAYERS: self.num_layers,
            Attr.NUM_LOGICAL_EXPERTS: self.num_logical_experts,
            Attr.NUM_PHYSICAL_EXPERTS: self.num_physical_experts,
            Attr.TOP_K: self.top_k,
            Attr.EP_SIZE: self.ep_size,
            Attr.MODEL: self.model,
            Attr.ENGINE: self.engine,
            Attr.CREATED_UNIX: time.time(),
            Attr.RUN_ID: self.run_id,
            Attr.RANK: self.rank,
            Attr.WORLD_SIZE: self.world_size,
            Attr.HIDDEN_SIZE: self.hidden_size,
            Attr.DTYPE_BYTES: self.dtype_bytes,
            Attr.PASS_PHASES: json.dumps(list(PASS_PHASES)),
            Attr.COMPLETE: False,
        }


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

    def __reduce__(self) -> tuple[type, tuple[object, str]]:
        """Pickled with both arguments (a dump's join in a child process hands it to the recorder)."""
        return type(self), (self.path, str(self))


class TraceWriteError(OSError):
    """A trace could not be written; nothing that looks complete was left behind."""
