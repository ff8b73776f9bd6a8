"""The ``/requests`` group of an HDF5 trace: request→replica routing decisions and outcomes.

:class:`~moetrace.replicas.RoutingRecorder` writes it; :func:`read_requests`
reads it back. One row per request in ``/requests/*`` (finish order), one row
per candidate replica considered at its decision in ``/requests/candidates/*``
(``cand_start .. cand_start+cand_count-1`` of its request), one row per session
migration in ``/requests/migrations/*``. ``docs/trace-format.md`` documents
every field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import h5py
import numpy as np

from . import integrity
from .integrity import reading
from .schema import TraceError
from .writer import TraceHeader

__all__ = [
    "CANDIDATE_FIELDS",
    "MIGRATION_FIELDS",
    "REQUEST_FIELDS",
    "ROUTING_MODE",
    "RequestTable",
    "RoutingHeader",
    "is_routing_trace",
    "read_requests",
    "routing_attrs",
]

ROUTING_MODE = "routing"
_STR = h5py.string_dtype("utf-8")

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


@dataclasses.dataclass(frozen=True)
class RoutingHeader(TraceHeader):
    """Root attributes of a routing trace (no expert layers: ``num_logical_experts`` is 0)."""

    @property
    def num_logical_experts(self) -> int:
        return 0

    @classmethod
    def make(cls, engine: str = "", model: str = "") -> RoutingHeader:
        return cls(mode=ROUTING_MODE, id_space="replica", num_layers=0, num_physical_experts=0, top_k=0, ep_size=1,
                   layer_ids=np.zeros(0, np.int32), physical_to_logical=np.zeros((0, 0), np.int32), model=model, engine=engine)


@dataclasses.dataclass
class RequestTable:
    """The ``/requests`` group in memory: column arrays and the group's attributes.

    Attributes:
        requests: ``{field: [N]}`` per request (:data:`REQUEST_FIELDS`); ``id`` and ``session`` as ``str``.
        candidates: ``{field: [C]}`` (:data:`CANDIDATE_FIELDS`).
        migrations: ``{field: [M]}`` (:data:`MIGRATION_FIELDS`).
        policies, reasons: names of the ``policy`` / ``reason`` codes.
        num_replicas: replicas behind the router.
        block_size: prefix-cache block size in tokens (0: unknown).
        clock: ``"monotonic"`` (seconds of ``time.monotonic``) or ``"simulated"``.
        attrs: every other root attribute of the file.
    """

    requests: dict[str, np.ndarray]
    candidates: dict[str, np.ndarray]
    migrations: dict[str, np.ndarray]
    policies: tuple[str, ...]
    reasons: tuple[str, ...]
    num_replicas: int
    block_size: int
    clock: str
    attrs: dict[str, object]

    def __len__(self) -> int:
        return len(self.requests["seq"])

    def index_of(self, request_id: str) -> int:
        """Row of ``request_id``; raises :class:`KeyError` naming it."""
        hits = np.flatnonzero(self.requests["id"] == request_id)
        if not len(hits):
            raise KeyError(f"request {request_id!r} is not in this trace ({len(self)} requests)")
        return int(hits[0])


def routing_attrs(policies: list[str], reasons: list[str], num_replicas: int, block_size: int, clock: str) -> dict[str, object]:
    """Root attributes a routing trace carries (prefix ``routing_``; see :class:`RequestTable`)."""
    return {"routing_policies": policies, "routing_reasons": reasons, "routing_num_replicas": num_replicas,
            "routing_block_size": block_size, "routing_clock": clock}


def is_routing_trace(path: str | Path) -> bool:
    """Whether ``path`` is a moetrace trace holding a ``/requests`` group."""
    try:
        with h5py.File(path, "r") as f:
            return "requests" in f
    except OSError:
        return False


def _columns(group: h5py.Group, fields: dict[str, np.dtype], where: str) -> dict[str, np.ndarray]:
    out = {}
    for name, dtype in fields.items():
        if name not in group:
            raise TraceError(f"{where}/{name} is missing; the trace is not a complete routing trace")
        dset = group[name]
        out[name] = dset.asstr()[...] if dtype == _STR else dset[...]
        if dtype == _STR:
            out[name] = np.asarray(out[name], dtype=object)
    return out


def read_requests(path: str | Path) -> RequestTable:
    """Read the ``/requests`` group of ``path``.

    Raises:
        TraceError: the file is not readable HDF5 or has no complete ``/requests`` group.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a routing trace written by `moetrace replicas replay --out` or RoutingRecorder.dump_record()")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise TraceError(f"{path} is not a readable HDF5 file: {exc}") from exc
    with f, reading(path, "/requests"):
        if integrity.is_sealed(f):
            problems = integrity.check_seal(f, path)
            if problems:
                name, problem = next(iter(problems.items()))
                raise TraceError(integrity.damage_message(path, "the root" if name == "/" else name, problem))
        if "requests" not in f:
            raise TraceError(f"{path} has no /requests group; it is not a routing trace (record one with RoutingRecorder or `moetrace replicas replay --out`)")
        g = f["requests"]
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        missing = [k for k in ("routing_policies", "routing_reasons", "routing_num_replicas", "routing_block_size", "routing_clock") if k not in attrs]
        if missing:
            raise TraceError(f"{path} lacks the root attributes {missing}; it is not a complete routing trace")
        return RequestTable(
            requests=_columns(g, REQUEST_FIELDS, "/requests"),
            candidates=_columns(g["candidates"], CANDIDATE_FIELDS, "/requests/candidates"),
            migrations=_columns(g["migrations"], MIGRATION_FIELDS, "/requests/migrations"),
            policies=tuple(str(p) for p in attrs.pop("routing_policies")),
            reasons=tuple(str(r) for r in attrs.pop("routing_reasons")),
            num_replicas=int(attrs.pop("routing_num_replicas")),
            block_size=int(attrs.pop("routing_block_size")),
            clock=str(attrs.pop("routing_clock")),
            attrs=attrs,
        )
