"""Device-side buffers behind each recorder mode: the pass counter, and one sink per mode.

:class:`PassCounter` counts every pass into per-layer counter rows. What a mode keeps of each
pass besides is its :class:`ModeSink` (:func:`mode_sink`): ``stat``'s :class:`StatWindow`, a
ring of the last passes; ``per_pass``'s :class:`PassStream` and ``per_token``'s
:class:`TokenStream`, which stage rows and hand them to the segment writer through their shared
base's ``flush``. The recorder calls the sink's one interface and never asks for its mode.

All buffers are allocated once, at construction, and sized from the
:class:`~moetrace.config.RecorderConfig`. Hook methods (``add_select``,
``add_dispatch``, ``add_layer``) use only fixed-shape device ops: comparisons,
``torch.where``, ``scatter_add_`` and slice copies. Pass-end methods run on the
host thread between passes, still without reading device values.

Counter rows ``[L, C]`` have the columns of
:class:`~moetrace.trace.stat.CounterLayout`: counting id
``i`` is three ops, column ``clamp(i + 2, 0, P + 2)`` and one ``scatter_add_``.

Token counts live on the device too: under CUDA-graph replay no hook's Python
runs, so a count taken from a hook call would stop at its value at capture. A
pass's tokens are the largest per-layer token column (``amax``), added into a
device total at pass end; host views (snapshot, window, trace rows) are copies
of these device values, never counts of hook calls.

Pass phases (:mod:`moetrace.pass_phase`) are host state the adapter sets per pass; at pass
end (host code that runs for every pass, a CUDA-graph replay included) the pass's rows are
added into that phase's row of ``[Q, L, C]`` device totals. No hook reads the phase.

Over 500 lines: the counter and the three sinks share the hand-off machinery (chunk totals by
pass phase, the overflow policy, the host buffer pool, the copy's CUDA event) and each pass end
touches the counter and one sink together; split apart they would import each other's private
helpers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..batch import PassBatch
from ..config import RecorderConfig
from ..pass_phase import PASS_PHASES, phase_counts
from ..trace.schema import Data
from ..trace.segments import StreamRows
from ..trace.stat import CounterLayout
from ..trace.stream import HostBufferPool, StreamJob
from ..trace.writer import chunk_rows, token_id_dtype

__all__ = ["ModeSink", "PassCounter", "PassStream", "StatWindow", "TokenStream", "WindowCut", "mode_sink"]

Submit = Callable[[StreamJob], None]


def _event_after_copy(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _submit_empty(submit: Submit, overflow: _Overflow | None, rotate: bool) -> None:
    """Nothing staged: still pass on a rotation request and the passes dropped since the last hand-off."""
    dropped = overflow.take_pending() if overflow is not None else 0
    if not (rotate or dropped):
        return
    part = StreamRows(rows={}, totals=None, passes=0, tokens=0, first_pass=-1, last_pass=-1, dropped_passes=dropped) if dropped else None
    submit(StreamJob(event=None, build=lambda: part, rotate=rotate))


class _ChunkTotals:
    """Counter rows ``[Q, L, C]`` (int64) of the passes staged since the last hand-off, by pass phase.

    Each hand-off carries them so that a segment's ``/stat`` covers exactly the
    passes whose rows it holds (their sum over ``Q``, and each phase's);
    ``take`` copies them asynchronously into one of two host buffers and zeroes
    the device copy.
    """

    def __init__(self, config: RecorderConfig, layout: CounterLayout) -> None:
        shape = (len(PASS_PHASES), config.num_layers, layout.width)
        self.acc = torch.zeros(shape, dtype=torch.int64, device=config.device)
        self.pool = HostBufferPool(shape, torch.int64, count=2, pin=config.device.type == "cuda")

    def add(self, current: torch.Tensor, phase: int) -> None:
        self.acc[phase].add_(current)

    def take(self) -> tuple[torch.Tensor, Callable[[], None]]:
        """``(host buffer, release)``; record the copy's event after calling this."""
        host = self.pool.acquire(block=False)  # never waits: released before its rows buffer
        assert host is not None
        host.copy_(self.acc, non_blocking=True)
        self.acc.zero_()
        return host, lambda: self.pool.release(host)

    def reset(self) -> None:
        self.acc.zero_()


class _Overflow:
    """``on_overflow`` bookkeeping shared by the streams: whole hand-offs dropped when the writer is behind.

    ``settle`` hands the writer every copy still in flight (it waits for their
    events, on the calling thread); it runs before blocking for a buffer, since
    the writer thread never waits on CUDA events itself.
    """

    def __init__(self, config: RecorderConfig, settle: Callable[[], None]) -> None:
        self.settle = settle
        self.drop = config.on_overflow == "drop"
        self.dropped_passes = 0  # since start_record
        self.pending = 0  # dropped since the last hand-off: written with the next one
        self.dropped_ranges: list[tuple[int, int]] = []  # (first, last) pass ids of every drop

    def acquire(self, pool: HostBufferPool, wait: bool) -> torch.Tensor | None:
        """A free host buffer: waits for one (``block``, or ``wait``) or returns ``None`` at once (``drop``)."""
        host = pool.acquire(block=False)
        if host is None and (wait or not self.drop):
            self.settle()
            host = pool.acquire(block=True)
        return host

    def dropped(self, passes: int, first: int, last: int) -> None:
        self.dropped_passes += passes
        self.pending += passes
        self.dropped_ranges.append((first, last))

    def take_pending(self) -> int:
        pending, self.pending = self.pending, 0
        return pending

    def reset(self) -> None:
        self.dropped_passes = self.pending = 0
        self.dropped_ranges = []


class PassCounter:
    """Counts of the current pass ``current [L, C]`` and running ``totals [L, C]`` (int64).

    ``ones`` is a static buffer of 1 (recording) or 0 (stopped) used as the
    ``scatter_add_`` source: a CUDA graph captured with recording on can be
    switched off and on without re-capture. ``index`` is a scratch buffer so a
    hook allocates nothing for passes up to ``max_tokens_per_pass`` tokens
    (larger passes fall back to a temporary). ``pass_tokens [1]`` (the tokens of
    the pass just folded) and ``token_total [1]`` (since the last reset) are
    updated on the device at pass end, and so are the same totals split by pass
    phase, ``pass_phase_totals [Q, L, C]`` and ``pass_phase_tokens [Q]`` (their sums over
    ``Q`` are ``totals`` and ``token_total``).
    """

    def __init__(self, config: RecorderConfig, layout: CounterLayout) -> None:
        self.layout = layout
        shape = (config.num_layers, layout.width)
        device = config.device
        scratch = config.max_tokens_per_pass * config.top_k
        self.current = torch.zeros(shape, dtype=torch.int64, device=device)
        self.totals = torch.zeros(shape, dtype=torch.int64, device=device)
        self.ones = torch.zeros(scratch, dtype=torch.int64, device=device)
        self.gate = self.ones[:1]
        self.index = torch.empty(scratch, dtype=torch.int64, device=device)
        self.pass_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_total = torch.zeros(1, dtype=torch.int64, device=device)
        self.pass_phase_totals = torch.zeros((len(PASS_PHASES), *shape), dtype=torch.int64, device=device)
        self.pass_phase_tokens = torch.zeros(len(PASS_PHASES), dtype=torch.int64, device=device)
        self.pass_phase_host = np.zeros((2, len(PASS_PHASES)), dtype=np.int64)  # host: passes, requests of each pass phase

    def set_gate(self, on: bool) -> None:
        """Switch counting on or off (also inside captured CUDA graphs)."""
        self.ones.fill_(1 if on else 0)

    def add_select(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Count ``topk_ids [T, k]`` into layer ``layer``; returns the column index ``[T*k]``.

        Ids in ``[0, P)`` count for their expert, ``-1`` in the padding column,
        any other id in one of the two invalid columns. Column ``c`` holds id
        ``c - 2`` (clamped at both ends). Rows that are not all -1 (padding rows
        of a CUDA graph's static batch are) count in the tokens column.
        """
        flat = topk_ids.reshape(-1)
        n = flat.shape[0]
        if n <= self.index.shape[0]:
            index, ones = self.index[:n], self.ones[:n]
            torch.add(flat, 2, out=index)
        else:
            index, ones = flat.long() + 2, self.gate.expand(n)
        index.clamp_(0, self.layout.above)
        row = self.current[layer]
        row.scatter_add_(0, index, ones)
        real = torch.ne(index.view(topk_ids.shape), self.layout.padding).any(dim=1)
        tokens = self.layout.tokens
        row[tokens : tokens + 1].addcmul_(real.sum(dim=0, keepdim=True), self.gate)
        return index

    def add_dispatch(
        self,
        layer: int,
        send_counts: torch.Tensor,
        recv_counts: torch.Tensor | None,
        dropped: torch.Tensor | None,
    ) -> None:
        """Add ``send_counts [R]``, ``recv_counts [R]`` and ``dropped []`` to layer ``layer``."""
        row = self.current[layer]
        row[self.layout.send].addcmul_(send_counts, self.gate)
        if recv_counts is not None:
            row[self.layout.recv].addcmul_(recv_counts, self.gate)
        if dropped is not None:
            row[self.layout.dropped].addcmul_(dropped.reshape(()), self.gate.reshape(()))

    def fold(self, phase: int, requests: int) -> None:
        """Pass end: add the pass into the totals and its tokens into ``token_total``, and both into
        pass phase ``phase``'s rows (a host int: a view, no device read), with the pass's
        ``requests`` (-1: unknown, adds nothing) on the host; the pass stays readable until :meth:`clear`."""
        self.pass_phase_host[0, phase] += 1
        self.pass_phase_host[1, phase] += max(requests, 0)
        self.totals.add_(self.current)
        self.pass_phase_totals[phase].add_(self.current)
        tokens = self.layout.tokens
        torch.amax(self.current[:, tokens : tokens + 1], dim=0, out=self.pass_tokens)
        self.token_total.add_(self.pass_tokens)
        self.pass_phase_tokens[phase : phase + 1].add_(self.pass_tokens)

    def clear(self) -> None:
        self.current.zero_()

    def reset(self) -> None:
        self.current.zero_()
        self.totals.zero_()
        self.pass_tokens.zero_()
        self.token_total.zero_()
        self.pass_phase_totals.zero_()
        self.pass_phase_tokens.zero_()
        self.pass_phase_host[:] = 0


class ModeSink:
    """What a recording keeps of each pass besides the counter's totals: one sink per mode
    (``stat``: :class:`StatWindow`, ``per_pass``: :class:`PassStream`, ``per_token``:
    :class:`TokenStream`, built by :func:`mode_sink`), behind this one interface, so that the
    recorder's hooks and pass end never ask which mode they run in.

    The defaults are those of a sink that keeps no token rows and hands nothing to a writer.
    Every method runs on the forward thread with fixed-shape device ops only.
    """

    #: Whether the sink hands its rows to the segment writer (streaming modes) rather than keeping a window.
    streamed = False
    #: The dtype of stored token ids (``per_token``), else ``None``.
    token_dtype: np.dtype | None = None

    def restart_rows(self) -> None:
        """A pass or a CUDA-graph capture begins (``per_token``: each layer's rows start at row 0)."""

    def check_room(self, layer: int, tokens: int) -> None:
        """Refuse ``tokens`` more rows of ``layer`` in this pass if they do not fit (before anything is counted)."""

    def add_layer(self, layer: int, index: torch.Tensor) -> int:
        """Keep one layer's rows from the counter's column index ``[T*k]``; the rows the layer now
        holds in the pass (0: the sink keeps no rows)."""
        return 0

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, rows: int, batch: PassBatch | None) -> None:
        """Keep the ended pass: its counter rows ``counter.current [L, C]`` and tokens, its id, time,
        pass phase and request count (-1: unknown), ``rows`` (a host bound on the token rows its
        hooks wrote) and the engine's ``batch`` (``None``: not given)."""
        raise NotImplementedError

    def discard_pass(self, rows: int) -> None:
        """Forget the pass in progress, whose hooks wrote at most ``rows`` token rows."""

    def at_boundary(self) -> bool:
        """Whether what is staged ends on a chunk boundary of the segment (a time rotation waits for it)."""
        return True

    def flush(self, rotate: bool = False, wait: bool = False) -> None:
        """Hand what is staged to the writer; ``rotate`` closes the segment after it (nothing here)."""

    @property
    def dropped_passes(self) -> int:
        """Passes dropped whole since ``start_record`` because the writer was behind."""
        return 0

    def reset(self) -> None:
        """Start empty (a new recording)."""
        raise NotImplementedError


def mode_sink(config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> ModeSink:
    """The sink of ``config.mode``; ``submit`` hands a job to the segment writer, ``settle`` waits for the copies in flight."""
    if config.mode == "stat":
        return StatWindow(config, layout)
    stream = PassStream if config.mode == "per_pass" else TokenStream
    return stream(config, layout, submit, settle)


class WindowCut:
    """A ``stat`` dump's copy of the window ring ``[W, L, P]`` as it was at the cut, taken without
    holding up the pass ends: copy on write into a host buffer.

    The cut's live slots are copied a batch at a time (:meth:`StatWindow.copy_cut`, recorder lock
    held for one batch only), and a pass end about to overwrite a live slot not copied yet copies
    that slot first (:meth:`StatWindow.push`). Copies are ``non_blocking`` (into pinned memory on
    CUDA, ordered on the stream before the overwrite); :meth:`StatWindow.end_cut` gives the event
    to wait for.

    Attributes:
        host: ``[W, L, P]`` int32 host buffer, slot-indexed like the ring.
        order: the live slots at the cut, oldest first.
        pending: ``[W]`` bool, live slots not copied yet.
    """

    def __init__(self, host: torch.Tensor, order: np.ndarray) -> None:
        self.host = host
        self.order = order
        self.pending = np.zeros(len(host), dtype=bool)
        self.pending[order] = True

    def take(self, counts: torch.Tensor, slots: np.ndarray) -> None:
        """Copy the pending ``slots`` of ``counts`` (the ring) into :attr:`host`, run by run of consecutive slots."""
        slots = np.sort(slots[self.pending[slots]])
        if not len(slots):
            return
        self.pending[slots] = False
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        for run in np.split(slots, breaks):
            a, b = int(run[0]), int(run[-1]) + 1
            self.host[a:b].copy_(counts[a:b], non_blocking=True)


class StatWindow(ModeSink):
    """``stat`` mode: a ring of the last ``W`` passes' expert counts ``[W, L, P]`` (int32) and tokens ``[W]`` (int64,
    on the device), plus host metadata (pass id, timestamp, pass phase, requests)."""

    def __init__(self, config: RecorderConfig, layout: CounterLayout) -> None:
        w = config.window
        self.experts = layout.experts
        self.counts = torch.zeros((w, config.num_layers, config.num_physical_experts), dtype=torch.int32, device=config.device)
        self.pass_id = np.full(w, -1, dtype=np.int64)
        self.timestamp = np.zeros(w, dtype=np.float64)
        self.pass_phase = np.zeros(w, dtype=np.int8)
        self.requests = np.full(w, -1, dtype=np.int64)
        self.tokens = torch.zeros(w, dtype=torch.int64, device=config.device)
        self.pushed = 0
        self._cuts: list[WindowCut] = []  # dumps' copies of the ring still being taken

    def host_buffer(self) -> torch.Tensor:
        """A fresh host buffer for one :class:`WindowCut` (pinned on CUDA): ``[W, L, P]`` int32."""
        return torch.empty(tuple(self.counts.shape), dtype=torch.int32, pin_memory=self.counts.device.type == "cuda")

    def cut(self, host: torch.Tensor) -> WindowCut:
        """Begin a dump's copy of the ring into ``host`` (recorder lock held): O(W) host bookkeeping, no copy."""
        cut = WindowCut(host, self.order())
        self._cuts.append(cut)
        return cut

    def copy_cut(self, cut: WindowCut, slots: np.ndarray) -> None:
        """Copy ``slots`` of the cut (those no pass end copied yet) into its host buffer (recorder lock held)."""
        cut.take(self.counts, slots)

    def end_cut(self, cut: WindowCut) -> torch.cuda.Event | None:
        """Stop copying on write for ``cut`` (recorder lock held; after every live slot was taken, or
        after a failure); the CUDA event after its copies (``None`` on the CPU, where they are done)."""
        self._cuts.remove(cut)
        return _event_after_copy(self.counts.device)

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, rows: int, batch: PassBatch | None) -> None:
        """Store the pass's expert counts ``counter.current[:, P columns]`` and tokens in the oldest
        slot (copying it first into a dump's cut that still needs it)."""
        slot = self.pushed % len(self.pass_id)
        for cut in self._cuts:
            if cut.pending[slot]:
                cut.take(self.counts, np.array([slot]))
        self.counts[slot].copy_(counter.current[:, self.experts])
        self.tokens[slot : slot + 1].copy_(counter.pass_tokens)
        self.pass_id[slot], self.timestamp[slot] = pass_id, timestamp
        self.pass_phase[slot], self.requests[slot] = phase, requests
        self.pushed += 1

    def order(self) -> np.ndarray:
        """Slot indices oldest to newest."""
        w = len(self.pass_id)
        if self.pushed <= w:
            return np.arange(self.pushed)
        start = self.pushed % w
        return np.concatenate([np.arange(start, w), np.arange(start)])

    def reset(self) -> None:
        self.pass_id.fill(-1)
        self.pushed = 0


class _RowStream(ModeSink):
    """The hand-off the streaming sinks share: their staged rows go to the segment writer in one
    of two host buffers (an asynchronous copy, a CUDA event, a job), with the chunk's totals by
    pass phase and the passes dropped since the last hand-off; ``on_overflow="drop"`` drops the
    whole hand-off when the writer is behind. Subclasses say what is staged."""

    streamed = True

    def __init__(self, config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.device = config.device
        self.pool = HostBufferPool(shape, dtype, count=2, pin=config.device.type == "cuda")
        self.totals = _ChunkTotals(config, layout)
        self.overflow = _Overflow(config, settle)
        self.submit = submit

    @property
    def dropped_passes(self) -> int:
        return self.overflow.dropped_passes

    def flush(self, rotate: bool = False, wait: bool = False) -> None:
        """Hand the staged passes to the writer; ``rotate`` closes the segment after them; ``wait``
        waits for a free buffer even with ``on_overflow="drop"``."""
        passes = self._staged_passes()
        if passes == 0:
            _submit_empty(self.submit, self.overflow, rotate)
            return
        host = self.overflow.acquire(self.pool, wait)
        if host is None:  # on_overflow="drop": the writer is behind, these whole passes are dropped
            self.overflow.dropped(passes, *self._pass_span())
            self.totals.reset()
            self._forget()
            _submit_empty(self.submit, None, rotate)
            return
        dropped = self.overflow.take_pending()
        rows_of = self._copy_out(host)
        totals, release_totals = self.totals.take()
        event = _event_after_copy(self.device)
        self._forget()

        def done() -> None:
            release_totals()
            self.pool.release(host)

        self.submit(StreamJob(event=event, build=lambda: rows_of(totals.numpy(), dropped), done=done, rotate=rotate))

    def reset(self) -> None:
        self._forget()
        self.totals.reset()
        self.overflow.reset()

    def _staged_passes(self) -> int:
        """Passes staged since the last hand-off."""
        raise NotImplementedError

    def _pass_span(self) -> tuple[int, int]:
        """The first and last staged pass ids."""
        raise NotImplementedError

    def _copy_out(self, host: torch.Tensor) -> Callable[[np.ndarray, int], StreamRows]:
        """Begin the staged rows' copy into ``host`` (asynchronous) and take copies of their host
        metadata; returns what builds the hand-off's rows on the writer thread from the chunk's
        totals by pass phase ``[Q, L, C]`` and the passes dropped before it."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Start the next hand-off empty."""
        raise NotImplementedError


class PassStream(_RowStream):
    """``per_pass`` mode: stage ``S`` passes' rows on the device, then hand them to the writer."""

    def __init__(self, config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> None:
        s = config.stream_chunk_passes
        shape = (s, config.num_layers, layout.width)
        super().__init__(config, layout, submit, settle, shape, torch.int32)
        self.layout = layout
        self.staging = torch.zeros(shape, dtype=torch.int32, device=config.device)
        self.meta = np.zeros((s, 4), dtype=np.float64)  # pass_id, timestamp, pass phase, requests (tokens are in the rows)
        self.filled = 0
        # Hand-offs of a multiple of the counts' chunk rows keep segments on the chunk grid, so a dump
        # joins them by copying chunks (when the full hand-off is such a multiple itself).
        align = chunk_rows((config.num_layers, config.num_physical_experts), np.int32)
        self.align = align if s % align == 0 else 1

    def at_boundary(self) -> bool:
        return self.filled % self.align == 0

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, rows: int, batch: PassBatch | None) -> None:
        """Stage the pass's counter rows and metadata; a full staging buffer is handed over."""
        current = counter.current
        self.staging[self.filled].copy_(current)
        self.totals.add(current, phase)
        self.meta[self.filled] = (pass_id, timestamp, phase, requests)
        self.filled += 1
        if self.filled == len(self.meta):
            self.flush()

    def _staged_passes(self) -> int:
        return self.filled

    def _pass_span(self) -> tuple[int, int]:
        return int(self.meta[0, 0]), int(self.meta[self.filled - 1, 0])

    def _copy_out(self, host: torch.Tensor) -> Callable[[np.ndarray, int], StreamRows]:
        n = self.filled
        host[:n].copy_(self.staging[:n], non_blocking=True)
        meta = self.meta[:n].copy()
        layout = self.layout

        def build(by_phase: np.ndarray, dropped: int) -> StreamRows:
            rows = host[:n].numpy()
            tokens = rows[:, :, layout.tokens].max(axis=1).astype(np.int64)
            phase, requests = meta[:, 2].astype(np.int8), meta[:, 3].astype(np.int64)
            return StreamRows(
                rows={
                    Data.PASSES_PASS_ID: meta[:, 0].astype(np.int64),
                    Data.PASSES_TIMESTAMP: meta[:, 1],
                    Data.PASSES_NUM_TOKENS: tokens,
                    Data.PASSES_PHYSICAL_COUNT: rows[:, :, layout.experts].copy(),
                    Data.PASSES_INVALID_IDS: layout.invalid(rows),
                    Data.PASSES_SEND_COUNT: rows[:, :, layout.send].copy(),
                    Data.PASSES_RECV_COUNT: rows[:, :, layout.recv].copy(),
                    Data.PASSES_PASS_PHASE: phase,
                    Data.PASSES_NUM_REQUESTS: requests.astype(np.int32),
                },
                totals=by_phase.sum(axis=0),
                phase_totals=by_phase.copy(),
                phase_counts=phase_counts(phase, tokens, requests),
                passes=n,
                tokens=int(tokens.sum()),
                first_pass=int(meta[0, 0]),
                last_pass=int(meta[n - 1, 0]),
                dropped_passes=dropped,
            )

        return build

    def _forget(self) -> None:
        self.filled = 0


class TokenStream(_RowStream):
    """``per_token`` mode: every token's ``[L, k]`` ids, staged per pass then per chunk.

    ``pass_stage [L, max_tokens, k]`` (layer-major, so each layer writes one
    contiguous block) collects one pass layer by layer. A layer may be given in
    several calls (the micro-batches of SGLang's two-batch overlap): each call's
    rows follow the layer's earlier ones, so a token's position in the pass is
    its row in call order (``layer_rows [L]``, host ints, says how many rows each
    layer holds; it starts over at every pass and at every graph capture, whose
    offsets a replay repeats). At pass end its first
    ``rows`` rows move into ``chunk [chunk_tokens, L, k]`` and are set back to
    -1, so a layer (or a replayed CUDA graph) that writes fewer rows leaves -1
    there. ``rows`` is a host bound on what the pass wrote (the recorder passes
    the largest row count its hooks saw in the pass or in any graph capture),
    since under graph replay no hook tells the host what was written. The
    writer keeps only the rows that are not all -1 (padding rows of a static
    batch), with their position in the pass. Ids are stored in the smallest
    signed dtype for ``P`` (:func:`~moetrace.trace.writer.token_id_dtype`).

    Requests: with the engine's :class:`~moetrace.batch.PassBatch` of the pass,
    each row also gets its request (an index into the hand-off's request table,
    ``request_ids``: the ids of this hand-off in first-seen order, so bounded by
    the chunk) and its position in that request; ``-1`` without a batch and for
    rows no request owns. The segment writer turns hand-off indices into the
    segment's own table (:class:`~moetrace.trace.segments.SegmentWriter`). Cost per
    pass: one dict lookup per request and a few ``[rows]`` numpy operations.
    """

    def __init__(self, config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> None:
        self.token_dtype = token_id_dtype(config.num_physical_experts)
        dtype = {np.int8: torch.int8, np.int16: torch.int16}.get(self.token_dtype.type, torch.int32)
        row = (config.num_layers, config.top_k)
        super().__init__(config, layout, submit, settle, (config.stream_chunk_tokens, *row), dtype)
        p = config.num_physical_experts
        # Stored id of counter column c = clamp(id + 2, 0, P + 2): c - 2, except both invalid columns -> -2.
        self.lut = torch.arange(-2, p + 1, dtype=dtype, device=config.device)
        self.lut[0] = self.lut[p + 2] = -2
        self.pass_stage = torch.full((config.num_layers, config.max_tokens_per_pass, config.top_k), -1, dtype=dtype, device=config.device)
        # The pass-end transpose [L, T, k] -> [T, L, k] moves each token's k ids as one wide word
        # (e.g. 8 int8 ids as one int64): far fewer strided elements than id by id.
        row_bytes = config.top_k * self.pass_stage.element_size()
        self.word = next((w for n, w in ((8, torch.int64), (4, torch.int32), (2, torch.int16)) if row_bytes % n == 0), dtype)
        self.chunk = torch.full((config.stream_chunk_tokens, *row), -1, dtype=dtype, device=config.device)
        self.pass_id = np.zeros(config.stream_chunk_tokens, dtype=np.int64)
        self.position = np.zeros(config.stream_chunk_tokens, dtype=np.int32)
        self.pass_phase = np.zeros(config.stream_chunk_tokens, dtype=np.int8)
        self.phase_passes = np.zeros(len(PASS_PHASES), dtype=np.int64)  # since the last hand-off
        self.phase_requests = np.zeros(len(PASS_PHASES), dtype=np.int64)
        self.request = np.full(config.stream_chunk_tokens, -1, dtype=np.int32)
        self.request_position = np.full(config.stream_chunk_tokens, -1, dtype=np.int32)
        self.request_table: dict[str, int] = {}  # request id -> index, this hand-off's requests
        self.layer_rows = [0] * config.num_layers  # rows each layer has staged in this pass (or graph capture)
        self._no_rows = [0] * config.num_layers
        self.filled = 0
        self.passes = 0  # passes (with or without tokens) since the last hand-off
        self.first_pass = self.last_pass = -1

    def check_room(self, layer: int, tokens: int) -> None:
        """Refuse ``tokens`` more rows of ``layer`` when the pass would outgrow ``max_tokens_per_pass``."""
        staged, room = self.layer_rows[layer], self.pass_stage.shape[1]
        if staged + tokens > room:
            before = f" after {staged} rows already given for layer {layer} in this pass (micro-batches)" if staged else ""
            raise ValueError(f"pass of {staged + tokens} tokens{before} exceeds max_tokens_per_pass={room}; raise it in RecorderConfig")

    def add_layer(self, layer: int, index: torch.Tensor) -> int:
        """Stage one layer's rows from the counter's column index ``[T*k]`` (``clamp(id + 2, 0, P + 2)``)
        after the rows this layer already holds in the pass; returns the rows it holds now.

        Stored ids: the expert id, -1 for padding, -2 for an invalid id.
        """
        start = self.layer_rows[layer]
        end = start + index.shape[0] // self.pass_stage.shape[2]
        torch.index_select(self.lut, 0, index, out=self.pass_stage[layer, start:end].view(-1))
        self.layer_rows[layer] = end
        return end

    def restart_rows(self) -> None:
        """A pass or a graph capture begins: each layer's rows start again at row 0 (rows are staged
        only inside one or the other, so their beginnings are the only places this is needed)."""
        self.layer_rows[:] = self._no_rows

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, rows: int, batch: PassBatch | None) -> None:
        """Move the pass's first ``rows`` staged rows into the chunk (each row's request from
        ``batch``; ``None``: rows of no known request)."""
        if self.filled + rows > len(self.pass_id):
            self.flush()
        self.totals.add(counter.current, phase)
        if self.passes == 0:
            self.first_pass = pass_id
        self.passes += 1
        self.last_pass = pass_id
        self.phase_passes[phase] += 1
        self.phase_requests[phase] += max(requests, 0)
        if rows == 0:
            return
        target = self.chunk[self.filled : self.filled + rows].view(self.word)
        target.copy_(self.pass_stage[:, :rows].view(self.word).transpose(0, 1))
        self.pass_stage[:, :rows].fill_(-1)
        span = slice(self.filled, self.filled + rows)
        self.pass_id[span] = pass_id
        self.position[span] = np.arange(rows, dtype=np.int32)
        self.pass_phase[span] = phase
        if batch is None:
            self.request[span] = -1
            self.request_position[span] = -1
        else:
            table = self.request_table
            index = np.fromiter((table.setdefault(r, len(table)) for r in batch.request_ids), dtype=np.int64, count=len(batch.request_ids))
            self.request[span], self.request_position[span] = batch.row_requests(index, rows)
        self.filled += rows

    def _staged_passes(self) -> int:
        return self.passes

    def _pass_span(self) -> tuple[int, int]:
        return self.first_pass, self.last_pass

    def _copy_out(self, host: torch.Tensor) -> Callable[[np.ndarray, int], StreamRows]:
        n, passes = self.filled, self.passes
        host[:n].copy_(self.chunk[:n], non_blocking=True)
        pass_phase = self.pass_phase[:n].copy()
        phase_passes, phase_requests = self.phase_passes.copy(), self.phase_requests.copy()
        pass_id, position = self.pass_id[:n].copy(), self.position[:n].copy()
        request, request_position = self.request[:n].copy(), self.request_position[:n].copy()
        request_ids = tuple(self.request_table)
        first, last = self.first_pass, self.last_pass

        def build(by_phase: np.ndarray, dropped: int) -> StreamRows:
            ids = host[:n].numpy()
            real = (ids != -1).reshape(n, ids[0].size if n else 1).any(axis=1)
            # Views of the host buffer when every row is a token: the writer is done with them before ``done`` releases it.
            rows = {Data.TOKENS_TOPK_IDS: ids, Data.TOKENS_PASS_ID: pass_id, Data.TOKENS_POSITION: position,
                    Data.TOKENS_PASS_PHASE: pass_phase, Data.TOKENS_REQUEST: request, Data.TOKENS_REQUEST_POSITION: request_position}
            if not real.all():
                rows = {name: array[real] for name, array in rows.items()}
            counts = np.stack([phase_passes, np.bincount(rows[Data.TOKENS_PASS_PHASE], minlength=len(PASS_PHASES)), phase_requests])
            return StreamRows(
                rows=rows,
                totals=by_phase.sum(axis=0),
                phase_totals=by_phase.copy(),
                phase_counts=counts.astype(np.int64),
                passes=passes,
                tokens=int(real.sum()),
                first_pass=first,
                last_pass=last,
                dropped_passes=dropped,
                request_ids=request_ids,
            )

        return build

    def _forget(self) -> None:
        self.filled = self.passes = 0
        self.phase_passes[:] = self.phase_requests[:] = 0
        self.request_table = {}

    def discard_pass(self, rows: int) -> None:
        """Forget the current pass: set its first ``rows`` staged rows back to -1."""
        self.pass_stage[:, :rows].fill_(-1)

    def reset(self) -> None:
        self.pass_stage.fill_(-1)  # also what graph replays wrote while nothing was recorded
        super().reset()
