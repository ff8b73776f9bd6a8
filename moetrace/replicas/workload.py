"""Request traces in the Mooncake format: load, validate, and the unlimited-cache bound.

One JSON object per line: ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (chained hashes of the prompt's prefix blocks,
``ceil(input_length / block_size)`` of them), and optionally ``request_id``
(default: ``"<line number>"``) and ``session_id``. Plain or gzip (``.gz``).
The real Mooncake FAST'25 conversation trace ships as package data
(:func:`load_trace` with no path).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MOONCAKE_BLOCK_SIZE", "MOONCAKE_TRACE", "TraceFormatError", "TraceRequest", "load_trace", "reusable_blocks"]

#: Tokens per ``hash_ids`` block in Mooncake's traces.
MOONCAKE_BLOCK_SIZE = 512
#: Package-data path of the vendored trace (see moetrace/data/mooncake/README.md).
MOONCAKE_TRACE = "mooncake/conversation_trace.jsonl.gz"


class TraceFormatError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (``arrival`` in seconds)."""

    rid: str
    arrival: float
    input_tokens: int
    output_tokens: int
    hashes: tuple[int, ...]
    session: str | None = None


def _lines(path: Path | None) -> tuple[str, Iterator[str]]:
    if path is None:
        from moetrace.data import data_file

        raw = data_file(MOONCAKE_TRACE).read_bytes()
        return "the packaged Mooncake trace", iter(io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(raw)), encoding="utf-8"))
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist; pass a JSONL trace in the Mooncake format")
    opener = gzip.open if path.suffix == ".gz" else open
    return str(path), iter(opener(path, "rt", encoding="utf-8"))  # type: ignore[operator]


def _int_field(obj: dict, key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceFormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(f"{where}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def load_trace(path: str | Path | None = None, *, block_size: int = MOONCAKE_BLOCK_SIZE, limit: int | None = None) -> list[TraceRequest]:
    """Read and validate a trace; requests sorted by arrival (stable).

    Args:
        path: JSONL (or ``.jsonl.gz``) file; ``None``: the packaged Mooncake trace.
        block_size: tokens per ``hash_ids`` block (checks ``len(hash_ids)``).
        limit: read only the first ``limit`` requests.

    Raises:
        TraceFormatError: a malformed line (named by number), a field out of
            range, or a duplicate ``request_id`` (both lines named).
    """
    name, lines = _lines(None if path is None else Path(path))
    out: list[TraceRequest] = []
    seen: dict[str, int] = {}
    try:
        for lineno, line in enumerate(lines, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{name} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            ts = obj.get("timestamp")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
                raise TraceFormatError(f"{where}: 'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
            n_in = _int_field(obj, "input_length", where, 1)
            n_out = _int_field(obj, "output_length", where, 0)
            hashes = obj.get("hash_ids")
            if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hashes):
                raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers")
            expected = -(-n_in // block_size)
            if len(hashes) != expected:
                raise TraceFormatError(f"{where}: {len(hashes)} hash_ids for input_length {n_in}; expected ceil({n_in}/{block_size}) = {expected} (wrong --block-size?)")
            rid = str(obj.get("request_id", lineno))
            if rid in seen:
                raise TraceFormatError(f"{where}: duplicate request_id {rid!r} (first on line {seen[rid]}); request ids must be unique")
            seen[rid] = lineno
            session = obj.get("session_id")
            out.append(TraceRequest(rid, ts / 1000.0, n_in, n_out, tuple(hashes), None if session is None else str(session)))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{name}: cannot be read ({exc})") from exc
    if not out:
        raise TraceFormatError(f"{name} holds no requests")
    out.sort(key=lambda r: r.arrival)
    return out


def reusable_blocks(requests: list[TraceRequest]) -> tuple[int, int]:
    """``(reusable, total)`` prefix blocks with an unlimited cache shared by everyone.

    A block is reusable when the same leading run of hashes appeared in an
    earlier request (prefix semantics: reuse stops at the first new block).
    No router policy and no finite cache can reuse more.
    """
    seen: set[int] = set()
    reusable = total = 0
    for req in requests:
        total += len(req.hashes)
        prefix = True
        for h in req.hashes:
            if prefix and h in seen:
                reusable += 1
            else:
                prefix = False
            seen.add(h)
    return reusable, total
