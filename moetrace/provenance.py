"""Provenance of routes: which run, engine rank, weight version and attempt a request's routes come from.

Routes that leave an engine (a capturer's wire payload, a routes file, the
input of a replay) carry, per request, a small ``"provenance"`` object::

    {"run_id": "9f2c...", "rank": 3, "weight_version": "step-1200", "attempt": 0}

- ``run_id``: the recording (or serving) run the routes were computed in; the
  recorder's ``run_id`` when one was recording, so that the audit can tie the
  routes to a trace of the same run;
- ``rank``: the engine rank that computed them (``-1``: unknown);
- ``weight_version``: the model weights that routed them (an RL step, a
  checkpoint name; ``""``: unknown). Replay (``hf.replay``, ``megatron.replay``,
  the reference replay) and ``moetrace audit`` refuse routes of another weight
  version than the one they are told, unless told to accept them;
- ``attempt``: how many times the request was computed before this answer
  (``0`` for the first; a retried or re-computed request has a larger one).

Provenance is per request (a handful of fields, not per token), so the wire
format stays as compact as before: the ids keep the smallest dtype that fits.

Routes written before provenance existed (no ``"provenance"`` key) still load:
their provenance is ``None``, and a check against an expected weight version
*assumes* they are of that version and says so (a log warning, and
``"assumed"`` in the audit's report), since nothing can be checked.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

__all__ = [
    "PROVENANCE_KEY",
    "ProvenanceError",
    "RouteProvenance",
    "check_weight_version",
    "read_provenance",
]

log = logging.getLogger(__name__)

PROVENANCE_KEY = "provenance"
"""Key of the provenance object in a wire payload, a routes file's request entry or its top level."""


class ProvenanceError(ValueError):
    """Routes of another weight version or run than expected, or a provenance object that cannot be read."""


@dataclasses.dataclass(frozen=True)
class RouteProvenance:
    """Where one request's routes come from (see the module docstring for each field)."""

    run_id: str = ""
    rank: int = -1
    weight_version: str = ""
    attempt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not isinstance(self.weight_version, str):
            raise ProvenanceError(f"run_id and weight_version must be strings, got {self.run_id!r} and {self.weight_version!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < -1:
            raise ProvenanceError(f"rank must be an integer >= -1 (-1: unknown), got {self.rank!r}")
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or self.attempt < 0:
            raise ProvenanceError(f"attempt must be an integer >= 0, got {self.attempt!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written next to the routes."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> RouteProvenance:
        """A copy with ``changes`` (e.g. ``attempt=1``)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, value: Any, what: str = "provenance") -> RouteProvenance:
        """Read a provenance object; unknown keys are refused (they would be silently lost)."""
        if not isinstance(value, Mapping):
            raise ProvenanceError(f"{what} must be an object {{run_id, rank, weight_version, attempt}}, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ProvenanceError(f"{what} has unknown fields {unknown}; known: {sorted(names)}")
        try:
            return cls(**{k: value[k] for k in names if k in value})
        except ProvenanceError as exc:
            raise ProvenanceError(f"{what}: {exc}") from None


def read_provenance(entry: Any, what: str = "routes", default: RouteProvenance | None = None) -> RouteProvenance | None:
    """The provenance an entry (payload, request entry, file body) carries, else ``default`` (``None``: none recorded)."""
    if isinstance(entry, Mapping) and entry.get(PROVENANCE_KEY) is not None:
        return RouteProvenance.from_dict(entry[PROVENANCE_KEY], f"{what}: provenance")
    return default


def check_weight_version(
    provenance: RouteProvenance | None,
    expected: str | None,
    *,
    allow_other: bool = False,
    what: str = "routes",
) -> str:
    """Check that routes are of weight version ``expected``; return how it was decided.

    Returns:
        ``"unchecked"`` (no version expected), ``"match"``, ``"assumed"`` (the
        routes record no weight version: old files; assumed to be ``expected``,
        logged), or ``"other"`` (another version, accepted because ``allow_other``).

    Raises:
        ProvenanceError: the routes record another weight version and ``allow_other`` is false.
    """
    if expected is None:
        return "unchecked"
    got = provenance.weight_version if provenance is not None else ""
    if not got:
        log.warning("%s record no weight version (written without provenance); assumed to be of weight version %r", what, expected)
        return "assumed"
    if got == expected:
        return "match"
    if allow_other:
        log.warning("%s are of weight version %r, not %r; used anyway as asked", what, got, expected)
        return "other"
    raise ProvenanceError(
        f"{what} were routed by weight version {got!r} but {expected!r} was expected: routes of other weights "
        "train the router on choices it did not make. Use routes of this weight version, or pass "
        "allow_other_weight_version=True (CLI: --allow-other-weight-version) to use them anyway"
    )
