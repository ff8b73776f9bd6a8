"""One forward pass's batch as the engine holds it on the host: which request each row belongs to.

An adapter describes the batch of the pass it is about to run with a :class:`PassBatch`
and hands it to the recorder (``recorder.with_forward_pass(batch=...)``, or
``recorder.set_batch(batch)`` inside the pass when the batch is only known there). The
recorder never reads a device value for it: every field is a host array the engine
already holds (SGLang's ``ForwardBatch`` ``rids``/``extend_prefix_lens``/``extend_seq_lens``,
vLLM's input batch, the reference serving loop's plan, Hugging Face's attention mask on
the host), and turning the batch into per-row request indices and positions
(:meth:`PassBatch.row_requests`) is a handful of vectorised numpy operations on
``[B]``-sized arrays, nothing per token in Python.

Rows. The hooks of a pass see ``num_rows`` rows (the ``T`` of ``topk_ids [T, k]``).
Request ``i`` owns the ``count[i]`` consecutive rows ``row[i] .. row[i] + count[i] - 1``,
which compute its positions ``start[i] .. start[i] + count[i] - 1`` (0 = the request's
first prompt token). Positions a pass does not compute (a prefix-cache hit, the part of a
chunked prefill another pass runs) are not rows of this pass; a recomputed request (after
preemption) simply has rows for the same positions again in a later pass. Rows no request
owns (padding of a CUDA graph's static batch, left padding of a Hugging Face batch) belong
to no request.

Phase. What kind of work the pass is (:data:`BATCH_PHASES`): ``prefill`` (every request
row is a prompt row: prefill or extend, chunked or not), ``decode`` (every row is a
generated-token row), ``mixed`` (both in one pass: chunked prefill beside decodes, vLLM's
unified batches), ``idle`` (no request rows: a DP-attention dummy pass, a warm-up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .pass_phase import PASS_PHASES, REQUESTS_RULE, UNKNOWN, requests_allowed

__all__ = ["BATCH_PHASES", "BatchError", "PassBatch"]

#: The phases a batch can name: :data:`moetrace.pass_phase.PASS_PHASES` but ``unknown`` (the phase of a
#: pass no one described); the recorder counts each pass into its phase (trace ``pass_phase``, metrics).
BATCH_PHASES = tuple(p for i, p in enumerate(PASS_PHASES) if i != UNKNOWN)


class BatchError(ValueError):
    """A :class:`PassBatch` whose fields do not describe a batch (the message names the field)."""


def _ints(name: str, values: object, size: int) -> np.ndarray:
    array = np.asarray(values)
    if array.shape != (size,):
        raise BatchError(f"`{name}` must have one entry per request ({size}), got shape {list(array.shape)}")
    if size and not np.issubdtype(array.dtype, np.integer):
        raise BatchError(f"`{name}` must hold integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if size and int(array.min()) < 0:
        raise BatchError(f"`{name}` must be >= 0, got {int(array.min())}")
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class PassBatch:
    """The requests of one forward pass and the rows each owns (host arrays only).

    Build it with :meth:`of` (which validates and derives what is not given).

    Attributes:
        request_ids: ``[B]`` the engine's own request ids, in batch order.
        start: ``[B]`` int64, position in its request of each request's first row in this pass.
        count: ``[B]`` int64, rows (positions computed) of each request in this pass.
        row: ``[B]`` int64, the pass row of each request's first row.
        prefill: ``[B]`` bool, whether the request's rows are prompt rows (prefill/extend)
            rather than generated-token (decode) rows.
        phase: one of :data:`BATCH_PHASES`.
        num_rows: rows the hooks see in this pass (request rows plus padding).
    """

    request_ids: tuple[str, ...]
    start: np.ndarray
    count: np.ndarray
    row: np.ndarray
    prefill: np.ndarray
    phase: str
    num_rows: int

    def __post_init__(self) -> None:
        """A batch built directly (not through :meth:`of`) still keeps the phase/request rule."""
        if self.phase not in BATCH_PHASES or not requests_allowed(PASS_PHASES.index(self.phase), self.num_requests):
            raise BatchError(f"`phase` {self.phase!r} with {self.num_requests} requests: {REQUESTS_RULE}; "
                             "build the batch with PassBatch.of (it derives the phase from the rows) or PassBatch.idle")

    @classmethod
    def of(
        cls,
        request_ids: Sequence[object],
        start: Sequence[int] | np.ndarray,
        count: Sequence[int] | np.ndarray,
        *,
        prefill: Sequence[bool] | np.ndarray | bool | None = None,
        row: Sequence[int] | np.ndarray | None = None,
        phase: str | None = None,
        num_rows: int | None = None,
    ) -> PassBatch:
        """Validate and complete a batch.

        Args:
            request_ids: ``[B]`` request ids (turned into ``str``).
            start: ``[B]`` first position of each request's rows.
            count: ``[B]`` rows of each request.
            prefill: ``[B]`` bools, or one bool for every request; ``None``: from ``phase``
                (``prefill`` all, ``decode`` none; a ``mixed`` pass must say which).
            row: ``[B]`` first row of each request; ``None``: requests packed in batch order
                (``row = cumsum(count) - count``, SGLang's and vLLM's layout).
            phase: one of :data:`BATCH_PHASES`; ``None``: derived from ``prefill``.
            num_rows: rows the hooks see; ``None``: ``max(row + count)``.

        Raises:
            BatchError: lengths differ, negative numbers, rows that overlap or exceed
                ``num_rows``, an unknown phase, or a phase the rows contradict.
        """
        ids = tuple(str(r) for r in request_ids)
        b = len(ids)
        starts, counts = _ints("start", start, b), _ints("count", count, b)
        rows = np.cumsum(counts) - counts if row is None else _ints("row", row, b)
        if phase is not None and phase not in BATCH_PHASES:
            raise BatchError(f"`phase` must be one of {BATCH_PHASES}, got {phase!r}")
        if prefill is None:
            if phase == "mixed":
                raise BatchError("a `mixed` pass must say which requests are prefill rows: give `prefill`")
            prefill = phase == "prefill"
        flags = np.broadcast_to(np.asarray(prefill, dtype=bool), (b,)).copy() if np.ndim(prefill) == 0 else np.asarray(prefill, dtype=bool)
        if flags.shape != (b,):
            raise BatchError(f"`prefill` must have one entry per request ({b}), got shape {list(flags.shape)}")
        ends = rows + counts
        extent = int(ends.max()) if b else 0
        total_rows = extent if num_rows is None else int(num_rows)
        if total_rows < extent:
            raise BatchError(f"request rows reach row {extent} but `num_rows` is {total_rows}")
        order = np.argsort(rows, kind="stable")
        if b > 1 and bool(np.any(ends[order][:-1] > rows[order][1:])):
            raise BatchError("two requests' rows overlap: each pass row belongs to one request at most")
        derived = _phase(flags, counts)
        if phase is None:
            phase = derived
        elif phase != derived:
            raise BatchError(f"`phase` is {phase!r} but the rows say {derived!r} (prefill flags {flags.tolist()})")
        return cls(ids, starts, counts, rows, flags, phase, total_rows)

    @classmethod
    def idle(cls, num_rows: int = 0) -> PassBatch:
        """A pass that computes no request's rows (a DP-attention dummy pass, a warm-up)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls((), empty, empty, empty, np.zeros(0, dtype=bool), "idle", int(num_rows))

    @property
    def num_requests(self) -> int:
        """Requests with at least one row in this pass."""
        return int(np.count_nonzero(self.count))

    @property
    def num_tokens(self) -> int:
        """Request rows of this pass (positions computed)."""
        return int(self.count.sum())

    @property
    def prefill_tokens(self) -> int:
        """Prompt (prefill/extend) rows."""
        return int(self.count[self.prefill].sum())

    @property
    def decode_tokens(self) -> int:
        """Generated-token (decode) rows."""
        return self.num_tokens - self.prefill_tokens

    def row_requests(self, index: np.ndarray | None = None, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-row request and position, vectorised.

        Args:
            index: ``[B]`` int value stored for each request (e.g. its index in a request
                table); ``None``: the request's place in this batch.
            rows: how many rows to describe (default ``num_rows``); rows past the batch's
                own are padding.

        Returns:
            ``(request [rows] int32, position [rows] int32)``: ``-1`` for rows no request owns.
        """
        n = self.num_rows if rows is None else int(rows)
        request = np.full(n, -1, dtype=np.int32)
        position = np.full(n, -1, dtype=np.int32)
        total = self.num_tokens
        if total == 0:
            return request, position
        owner = np.repeat(np.arange(len(self.count)), self.count)  # [total] batch index of each request row
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(self.count) - self.count, self.count)
        target = self.row[owner] + within
        keep = target < n
        values = owner if index is None else np.asarray(index, dtype=np.int64)[owner]
        request[target[keep]] = values[keep]
        position[target[keep]] = (self.start[owner] + within)[keep]
        return request, position


def _phase(prefill: np.ndarray, count: np.ndarray) -> str:
    live = count > 0
    if not live.any():
        return "idle"
    prompt = bool(prefill[live].any())
    generated = bool((~prefill[live]).any())
    return "mixed" if prompt and generated else ("prefill" if prompt else "decode")
