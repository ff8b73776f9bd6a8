"""The ``/requests`` group of an HDF5 trace: request→replica decisions and outcomes.

:class:`~moetrace.replicas.ReplicaRecorder` writes it; :func:`read_requests`
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
from .safe_open import open_hdf5
from .schema import (
    CANDIDATE_FIELDS,
    MIGRATION_FIELDS,
    REQUEST_FIELDS,
    STRING_DTYPE,
    Attr,
    Data,
    TraceError,
    TraceHeader,
)

__all__ = [
    "ROUTING_MODE",
    "ReplicaHeader",
    "RequestTable",
    "is_replica_trace",
    "read_requests",
    "replica_attrs",
]

ROUTING_MODE = "routing"

@dataclasses.dataclass(frozen=True)
class ReplicaHeader(TraceHeader):
    """Root attributes of a replica trace (no expert layers: ``num_logical_experts`` is 0)."""

    @property
    def num_logical_experts(self) -> int:
        return 0

    @classmethod
    def make(cls, engine: str = "", model: str = "") -> ReplicaHeader:
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


def replica_attrs(policies: list[str], reasons: list[str], num_replicas: int, block_size: int, clock: str) -> dict[str, object]:
    """Root attributes a replica trace carries (prefix ``routing_``; see :class:`RequestTable`)."""
    return {Attr.ROUTING_POLICIES: policies, Attr.ROUTING_REASONS: reasons, Attr.ROUTING_NUM_REPLICAS: num_replicas,
            Attr.ROUTING_BLOCK_SIZE: block_size, Attr.ROUTING_CLOCK: clock}


def is_replica_trace(path: str | Path) -> bool:
    """Whether ``path`` is a moetrace trace holding a ``/requests`` group."""
    try:
        with open_hdf5(path) as f:
            return Data.REQUESTS in f
    except OSError:
        return False


def _columns(group: h5py.Group, fields: dict[str, np.dtype], where: str) -> dict[str, np.ndarray]:
    out = {}
    for name, dtype in fields.items():
        if name not in group:
            raise TraceError(f"{where}/{name} is missing; the trace is not a complete replica trace")
        dset = group[name]
        out[name] = dset.asstr()[...] if dtype == STRING_DTYPE else dset[...]
        if dtype == STRING_DTYPE:
            out[name] = np.asarray(out[name], dtype=object)
    return out


def read_requests(path: str | Path) -> RequestTable:
    """Read the ``/requests`` group of ``path``.

    Raises:
        TraceError: the file is not readable HDF5 or has no complete ``/requests`` group.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a replica trace written by `moetrace replicas replay --out` or ReplicaRecorder.dump_record()")
    try:
        f = open_hdf5(path)
    except OSError as exc:
        raise TraceError(f"{path} is not a readable HDF5 file: {exc}") from exc
    with f, reading(path, "/requests"):
        if integrity.is_sealed(f):
            problems = integrity.check_seal(f, path)
            if problems:
                name, problem = next(iter(problems.items()))
                raise TraceError(integrity.damage_message(path, "the root" if name == "/" else name, problem))
        if Data.REQUESTS not in f:
            raise TraceError(f"{path} has no /requests group; it is not a replica trace (record one with ReplicaRecorder or `moetrace replicas replay --out`)")
        g = f[Data.REQUESTS]
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        missing = [k for k in (Attr.ROUTING_POLICIES, Attr.ROUTING_REASONS, Attr.ROUTING_NUM_REPLICAS, Attr.ROUTING_BLOCK_SIZE, Attr.ROUTING_CLOCK) if k not in attrs]
        if missing:
            raise TraceError(f"{path} lacks the root attributes {missing}; it is not a complete replica trace")
        return RequestTable(
            requests=_columns(g, REQUEST_FIELDS, f"/{Data.REQUESTS}"),
            candidates=_columns(f[Data.REQUESTS_CANDIDATES], CANDIDATE_FIELDS, Data.REQUESTS_CANDIDATES),
            migrations=_columns(f[Data.REQUESTS_MIGRATIONS], MIGRATION_FIELDS, Data.REQUESTS_MIGRATIONS),
            policies=tuple(str(p) for p in attrs.pop(Attr.ROUTING_POLICIES)),
            reasons=tuple(str(r) for r in attrs.pop(Attr.ROUTING_REASONS)),
            num_replicas=int(attrs.pop(Attr.ROUTING_NUM_REPLICAS)),
            block_size=int(attrs.pop(Attr.ROUTING_BLOCK_SIZE)),
            clock=str(attrs.pop(Attr.ROUTING_CLOCK)),
            attrs=attrs,
        )
