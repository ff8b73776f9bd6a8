"""The expert distribution recorder: global, start/stop/dump, device-side counts.

Runtimes call the hooks from inside every MoE layer::

    rec = moetrace.get_recorder()
    with rec.with_forward_pass():
        for i, layer in enumerate(moe_layers):
            with rec.with_current_layer(i):
                topk_ids = router(x)               # [T, k]
                rec.on_select_experts(topk_ids)
                rec.on_dispatch(send_counts)       # [R], optional

Hooks check cheap metadata only (dtype, rank, device, layer index) and count
with fixed-shape device ops; they never read tensor values on the host. When
the recorder is not recording they return at once.

Lifecycle: ``start_record()`` begins a fresh recording (counts zeroed),
``stop_record()`` ends it, ``dump_record()`` writes what was recorded (allowed
while recording or after stop; state is kept, so a failed dump can be
retried), ``reset()`` discards everything. ``start`` while recording and
``stop`` while stopped raise :class:`RecorderStateError`, as does ``dump``
before any ``start``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .accumulators import CounterLayout, PassCounter, PassStream, StatWindow, TokenStream
from .config import RecorderConfig
from .ids import to_logical
from .snapshot import RecorderSnapshot
from .timing import (
    HISTOGRAM_EDGES,
    PHASES,
    PassTiming,
    TimingCaptureError,
    TimingRows,
    TimingStats,
    make_clock,
    row_fields,
)
from .trace.schema import PADDING_IDS, TraceWriteError
from .trace.segments import (
    CheckpointWriter,
    Journal,
    SegmentInfo,
    SegmentWriter,
    checkpoint_path,
    concat_segments,
    journal_path,
    sweep_dead_temporaries,
)
from .trace.stream import BackgroundTraceWriter, HostBufferPool, StreamJob
from .trace.writer import TraceHeader, TraceWriter, check_writable_dir, compression_options

__all__ = [
    "ExpertDistributionRecorder",
    "NoOpRecorder",
    "RecorderStateError",
    "get_recorder",
    "set_recorder",
]

_log = logging.getLogger("moetrace")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}
_UNTIMED = contextlib.nullcontext()


class RecorderStateError(RuntimeError):
    """A lifecycle call that does not fit the recorder's state (e.g. start twice)."""


def _normalise_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _dist_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _LayerScope:
    __slots__ = ("_layer", "_previous", "_recorder")

    def __init__(self, recorder: ExpertDistributionRecorder, layer: int) -> None:
        self._recorder, self._layer = recorder, layer

    def __enter__(self) -> int:
        self._previous = self._recorder._layer
        self._recorder._layer = self._layer
        clock = self._recorder._live_clock
        if clock is not None:
            clock.layer_scopes[self._layer].__enter__()
        return self._layer

    def __exit__(self, *exc: object) -> None:
        self._recorder._layer = self._previous
        clock = self._recorder._live_clock
        if clock is not None:
            clock.layer_scopes[self._layer].__exit__()


class _SnapshotChannel:
    """Two host buffers that receive the totals asynchronously at pass end.

    ``publish`` (forward thread) copies into the older buffer with
    ``non_blocking=True`` and records an event; ``latest`` (any thread) returns
    the newest buffer whose copy has completed, never waiting for the device.
    Both run under the recorder's lock.
    """

    def __init__(self, shape: tuple[int, int], device: torch.device) -> None:
        pin = device.type == "cuda"
        self._buffers = [torch.zeros(shape, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._meta: list[tuple[int, int, float] | None] = [(0, 0, time.time()), None]
        self._cuda = device.type == "cuda"
        self._newest = 0
        self._cached: tuple[np.ndarray, tuple[int, int, float]] = (self._buffers[0].numpy().copy(), (0, 0, time.time()))

    def publish(self, totals: torch.Tensor, num_passes: int, num_tokens: int, timestamp: float) -> None:
        slot = 1 - self._newest
        self._buffers[slot].copy_(totals, non_blocking=True)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        self._meta[slot] = (num_passes, num_tokens, timestamp)
        self._newest = slot

    def latest(self) -> tuple[np.ndarray, tuple[int, int, float]]:
        for slot in (self._newest, 1 - self._newest):
            event, meta = self._events[slot], self._meta[slot]
            if meta is not None and (event is None or event.query()):
                self._cached = (self._buffers[slot].numpy().copy(), meta)
                break
        return self._cached

    def clear(self) -> None:
        for buf in self._buffers:
            buf.zero_()
        self._events = [None, None]
        self._meta = [(0, 0, time.time()), None]
        self._newest = 0
        self._cached = (self._buffers[0].numpy().copy(), self._meta[0])  # type: ignore[assignment]


class ExpertDistributionRecorder:
    """Counts routed experts per layer, expert and EP rank on the device.

    Args:
        config: a validated :class:`~moetrace.config.RecorderConfig`.
    """

    def __init__(self, config: RecorderConfig) -> None:
        self.config = config.replace(device=_normalise_device(config.device))  # type: ignore[arg-type]
        cfg = self.config
        self._device: torch.device = cfg.device  # type: ignore[assignment]
        self._cuda = self._device.type == "cuda"
        self._layout = CounterLayout(cfg.num_physical_experts, cfg.ep_size)
        # Buffers are normal tensors even when built under torch.inference_mode() (as engines
        # often do), so lifecycle calls outside it can update them in place.
        with torch.inference_mode(False):
            self._counter = PassCounter(cfg, self._layout)
            self._counter.set_gate(False)
            self._window = StatWindow(cfg, self._layout) if cfg.mode == "stat" else None
            self._pass_stream = PassStream(cfg, self._layout, self._submit) if cfg.mode == "per_pass" else None
            self._token_stream = TokenStream(cfg, self._layout, self._submit) if cfg.mode == "per_token" else None
            self._snapshots = _SnapshotChannel((cfg.num_layers, self._layout.width), self._device)
        # Phase timing (host-side): the clock, aggregates over all passes and per-pass rows.
        self._clock = make_clock(cfg.num_layers, self._device, cfg.timing_ring) if cfg.timing else None
        self._live_clock = None  # the clock while a timed pass runs, else None
        self._timing_stats = TimingStats(cfg.num_layers)
        self._timing_rows = TimingRows(cfg.num_layers, cfg.window if cfg.mode == "stat" else cfg.stream_chunk_passes)
        self._dumped_timing: dict[str, np.ndarray] | None = None
        self._lock = threading.RLock()
        self._recording = False
        self._started = False
        self._in_pass = False
        self._pass_active = False
        self._pass_tokens = 0
        self._next_pass_id = 0
        self._layer: int | None = None
        self._disabled = 0
        self._num_passes = 0
        self._num_tokens = 0
        self._dumped_passes = 0
        self._dumped_tokens = 0
        self._run_id = uuid.uuid4().hex
        # Crash safety: streaming modes write rotating segments through a writer thread,
        # stat mode checkpoints through one (see moetrace.trace.segments).
        self._segment: BackgroundTraceWriter | None = None
        self._journal: Journal | None = None
        self._rotate_at = 0.0
        self._checkpoint_buffers: tuple[HostBufferPool, HostBufferPool] | None = None
        self._undumped_segments: list[SegmentInfo] = []  # closed segments taken by a dump that failed
        self._compression = compression_options(cfg.resolved_compression)
        self.last_dump_path: Path | None = None
        self._errors: list[str] = []

    # ------------------------------------------------------------------ properties
    @property
    def recording(self) -> bool:
        """Whether hooks currently count."""
        return self._recording

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def num_passes(self) -> int:
        """Forward passes recorded since ``start_record``."""
        return self._num_passes

    @property
    def dropped_passes(self) -> int:
        """Passes dropped whole since ``start_record`` because the writer was behind (``on_overflow="drop"``)."""
        stream = self._pass_stream or self._token_stream
        return stream.overflow.dropped_passes if stream is not None else 0

    @property
    def undumped_passes(self) -> int:
        """Passes recorded since the last dump (since ``start_record`` before any dump)."""
        return self._num_passes - self._dumped_passes

    @property
    def id_space(self) -> str:
        """``"physical"`` when a non-identity physical-to-logical map is set, else ``"logical"``."""
        return "physical" if self.config.has_logical_map else "logical"

    # ------------------------------------------------------------------ context managers
    @contextlib.contextmanager
    def with_forward_pass(self, forward_pass_id: int | None = None) -> Iterator[int]:
        """Mark one model forward. Yields the pass id (auto-incremented when ``None``).

        Passes do not nest. If the body raises, the partial pass is discarded.
        """
        if self._in_pass:
            raise RecorderStateError("with_forward_pass is already active: forward passes do not nest")
        pass_id = self._next_pass_id if forward_pass_id is None else int(forward_pass_id)
        self._next_pass_id = pass_id + 1
        self._in_pass = True
        self._pass_active = self._recording
        self._pass_tokens = 0
        ok = False
        try:
            if self._pass_active and self._clock is not None:
                self._begin_timing()  # may refuse (CUDA-graph capture): the finally below still ends the pass
            yield pass_id
            ok = True
        finally:
            if self._pass_active and not (self._cuda and torch.cuda.is_current_stream_capturing()):
                if ok:
                    self._end_pass(pass_id)
                else:
                    self._discard_pass()
            self._in_pass = False
            self._pass_active = False
            self._live_clock = None

    def _begin_timing(self) -> None:
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise TimingCaptureError(
                "phase timing cannot run inside CUDA-graph capture (timed CUDA events are not capturable); "
                "use RecorderConfig(timing=False) for a captured model, or capture outside with_forward_pass"
            )
        assert self._clock is not None
        self._clock.begin_pass()
        self._live_clock = self._clock

    def with_current_layer(self, layer_idx: int) -> _LayerScope:
        """Set the MoE layer (compact index ``0..L-1``) that hooks in the block count into."""
        if not 0 <= layer_idx < self.config.num_layers:
            raise ValueError(f"layer index {layer_idx} is outside [0, num_layers={self.config.num_layers})")
        return _LayerScope(self, layer_idx)

    def with_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time phase ``name`` (one of :data:`moetrace.PHASES`) of the current layer.

        Use inside ``with_current_layer``. A shared null context (nothing
        timed, nothing allocated) unless ``RecorderConfig(timing=True)`` and a
        pass is being recorded. Phases are timed with ``perf_counter_ns`` on
        CPU and CUDA events on a GPU (see :mod:`moetrace.timing`).
        """
        clock = self._live_clock
        try:
            phase = _PHASE_INDEX[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown phase {name!r}; use one of {PHASES}") from None
        if clock is None or self._disabled:
            return _UNTIMED
        layer = self._layer
        if layer is None:
            raise RecorderStateError(f"with_phase({name!r}) called outside with_current_layer(); wrap the MoE layer in recorder.with_current_layer(i)")
        return clock.scopes[layer][phase]

    @contextlib.contextmanager
    def disable_this_region(self) -> Iterator[None]:
        """Hooks inside the block count nothing (e.g. warm-up or a draft model)."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    # ------------------------------------------------------------------ hooks
    def _active(self) -> bool:
        if self._disabled:
            return False
        if self._pass_active:
            return True
        # Inside CUDA-graph capture with recording on: capture the (gated) counting ops.
        return self._cuda and self._recording and torch.cuda.is_current_stream_capturing()

    def _resolve_layer(self, layer: int | None, hook: str) -> int:
        if layer is None:
            layer = self._layer
            if layer is None:
                raise RecorderStateError(
                    f"{hook} called outside with_current_layer(); wrap the MoE layer in "
                    "recorder.with_current_layer(i) or pass layer=i"
                )
            return layer
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"{hook}: layer {layer} is outside [0, num_layers={self.config.num_layers})")
        return layer

    def _check_tensor(self, name: str, tensor: object, ndim: int) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be an integer tensor, got dtype {tensor.dtype}")
        if tensor.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {list(tensor.shape)}")
        if tensor.device != self._device:
            raise ValueError(f"{name} is on {tensor.device} but the recorder counts on {self._device}; configure device={tensor.device}")
        return tensor

    def on_select_experts(self, topk_ids: torch.Tensor, layer: int | None = None) -> None:
        """Count the experts selected for each token.

        Args:
            topk_ids: ``[T, k]`` integer physical expert ids; ``-1`` is ignored,
                other out-of-range ids count as invalid.
            layer: MoE layer index; defaults to the one set by ``with_current_layer``.
        """
        if not self._active():
            return
        layer = self._resolve_layer(layer, "on_select_experts")
        ids = self._check_tensor("topk_ids", topk_ids, 2)
        if ids.shape[1] != self.config.top_k:
            raise ValueError(f"topk_ids has {ids.shape[1]} columns but the recorder was configured with top_k={self.config.top_k}")
        tokens = ids.shape[0]
        if self._token_stream is not None and tokens > self.config.max_tokens_per_pass:
            raise ValueError(f"pass of {tokens} tokens exceeds max_tokens_per_pass={self.config.max_tokens_per_pass}; raise it in RecorderConfig")
        index = self._counter.add_select(layer, ids)
        if tokens > self._pass_tokens:
            self._pass_tokens = tokens
        if self._token_stream is not None:
            self._token_stream.add_layer(layer, index)

    def on_dispatch(
        self,
        send_counts: torch.Tensor,
        recv_counts: torch.Tensor | None = None,
        dropped: torch.Tensor | None = None,
        layer: int | None = None,
    ) -> None:
        """Record what this rank's dispatch moves in the current layer.

        Args:
            send_counts: ``[R]`` token copies this rank sends to each EP rank.
            recv_counts: ``[R]`` token copies this rank receives from each EP rank.
            dropped: ``[]`` or ``[1]`` token copies dropped over expert capacity.
            layer: MoE layer index; defaults to the one set by ``with_current_layer``.
        """
        if not self._active():
            return
        layer = self._resolve_layer(layer, "on_dispatch")
        ep = self.config.ep_size
        for name, tensor in (("send_counts", send_counts), ("recv_counts", recv_counts)):
            if tensor is not None and self._check_tensor(name, tensor, 1).shape[0] != ep:
                raise ValueError(f"{name} must have shape [ep_size={ep}], got {list(tensor.shape)}")
        if dropped is not None:
            self._check_tensor("dropped", dropped, dropped.dim() if isinstance(dropped, torch.Tensor) else 0)
            if dropped.numel() != 1:
                raise ValueError(f"dropped must hold one count, got shape {list(dropped.shape)}")
        self._counter.add_dispatch(layer, send_counts, recv_counts, dropped)

    # ------------------------------------------------------------------ pass end
    def _end_pass(self, pass_id: int) -> None:
        timings = self._clock.end_pass(pass_id) if self._live_clock is not None else ()  # type: ignore[union-attr]
        with self._lock:
            for timing in timings:
                self._add_timing(timing)
            counter, tokens, timestamp = self._counter, self._pass_tokens, time.time()
            counter.fold()
            if self._window is not None:
                self._window.push(counter.current, pass_id, timestamp, tokens)
            if self._pass_stream is not None:
                self._pass_stream.push(counter.current, pass_id, timestamp, tokens)
            if self._token_stream is not None:
                self._token_stream.end_pass(pass_id, counter.current)
            counter.clear()
            self._num_passes += 1
            self._num_tokens += tokens
            self._snapshots.publish(counter.totals, self._num_passes, self._num_tokens, timestamp)
            if self._segment is not None and time.monotonic() >= self._rotate_at:
                self._rotate(pass_id)

    def _rotate(self, pass_id: int, wait: bool = False) -> None:
        """Segment due (``segment_seconds``): hand what is staged to the writer thread, which closes
        the segment (streaming) or writes a checkpoint (stat). Only enqueues: never waits."""
        self._rotate_at = time.monotonic() + self.config.segment_seconds
        if self._window is not None:
            self._checkpoint(pass_id, wait)
            return
        self._flush_timing_rows()
        for stream in (self._pass_stream, self._token_stream):
            if stream is not None:
                stream.flush(rotate=True, wait=wait)

    def _checkpoint(self, pass_id: int, wait: bool) -> None:
        """Stat mode: copy totals and window to host buffers (asynchronously) and let the
        writer thread write the checkpoint; skipped when the previous one is still being
        written, unless ``wait``."""
        assert self._window is not None and self._segment is not None
        if self._checkpoint_buffers is None:
            pin = self._cuda
            with torch.inference_mode(False):  # normal tensors, even when the first checkpoint runs under it
                self._checkpoint_buffers = (
                    HostBufferPool(tuple(self._counter.totals.shape), torch.int64, 1, pin),
                    HostBufferPool(tuple(self._window.counts.shape), torch.int32, 1, pin),
                )
        totals_pool, window_pool = self._checkpoint_buffers
        totals = totals_pool.acquire(block=wait)
        if totals is None:
            return
        window = window_pool.acquire()
        assert window is not None
        totals.copy_(self._counter.totals, non_blocking=True)
        window.copy_(self._window.counts, non_blocking=True)
        event = torch.cuda.Event() if self._cuda else None
        if event is not None:
            event.record()
        w = self._window
        order = w.order()
        meta = np.stack([w.pass_id, w.timestamp, w.num_tokens], axis=1)[order]
        passes, tokens = self._num_passes, self._num_tokens

        def build() -> tuple[object, int, int]:
            rows, counts = totals.numpy()[None].copy(), [window.numpy()[order][None]]
            return (lambda writer: self._write_stat_file(writer, rows, np.array([[passes, tokens]]), meta[None], counts)), pass_id, passes

        def done() -> None:
            window_pool.release(window)
            totals_pool.release(totals)

        self._segment.submit(StreamJob(event=event, build=build, done=done))

    def _add_timing(self, timing: PassTiming) -> None:
        """Fold one resolved pass's timing into the aggregates and rows (streaming: hand full blocks over)."""
        self._timing_stats.add(timing)
        self._timing_stats.dropped_passes = self._clock.dropped_passes if self._clock is not None else 0
        self._timing_rows.push(timing)
        if self.config.mode != "stat" and self._timing_rows.pushed == self._timing_rows.capacity:
            self._flush_timing_rows()

    def _flush_timing_rows(self) -> None:
        """Streaming modes: submit the staged ``/timing`` rows to the segment writer."""
        if not self._timing_rows.pushed:
            return
        rows = {f"timing/{name}": array for name, array in self._timing_rows.ordered().items()}
        self._timing_rows.reset()
        self._submit(StreamJob(event=None, build=lambda: rows, done=lambda: None))

    def _resolve_timing(self) -> None:
        """Dump time: fold the passes whose CUDA events were still in flight (waits for them)."""
        if self._clock is not None:
            for timing in self._clock.flush():
                self._add_timing(timing)

    def _discard_pass(self) -> None:
        if self._clock is not None:
            self._clock.discard_pass()
        with self._lock:
            self._counter.clear()
            if self._token_stream is not None:
                self._token_stream.discard_pass()

    def _submit(self, job: StreamJob) -> None:
        if self._segment is None:
            job.done()
            return
        self._segment.submit(job)

    # ------------------------------------------------------------------ lifecycle
    def start_record(self) -> None:
        """Begin a fresh recording (counts, window and streams start empty)."""
        with self._lock:
            if self._recording:
                raise RecorderStateError("already recording; call stop_record() first")
            self._clear()
            self._run_id = self._shared_run_id()
            self._open_segment()
            self._started = True
            self._recording = True
            self._counter.set_gate(True)

    def stop_record(self) -> None:
        """Stop counting; what was recorded stays available to ``dump_record``."""
        with self._lock:
            if not self._recording:
                raise RecorderStateError("not recording; call start_record() first")
            self._recording = False
            self._counter.set_gate(False)
            if self._segment is not None:  # everything recorded so far goes into closed segments / a checkpoint
                self._rotate(self._next_pass_id - 1, wait=True)

    def reset(self) -> None:
        """Discard everything recorded; keeps recording if it was."""
        with self._lock:
            self._clear()
            if self._recording:
                self._open_segment()

    def _clear(self) -> None:
        self._close_segment(keep=False)
        self._counter.reset()
        for part in (self._window, self._pass_stream, self._token_stream):
            if part is not None:
                part.reset()
        self._snapshots.clear()
        if self._clock is not None:
            self._clock.reset()
        self._timing_stats.reset()
        self._timing_rows.reset()
        self._dumped_timing = None
        self._num_passes = 0
        self._num_tokens = 0
        self._dumped_passes = 0
        self._dumped_tokens = 0
        self._errors = []

    def _shared_run_id(self) -> str:
        run_id = [uuid.uuid4().hex]
        if _dist_world()[1] > 1:
            dist.broadcast_object_list(run_id, src=0)
        return run_id[0]

    def _header(self, rank: int, world_size: int) -> TraceHeader:
        cfg = self.config
        return TraceHeader(
            mode=cfg.mode,
            id_space=self.id_space,
            num_layers=cfg.num_layers,
            num_physical_experts=cfg.num_physical_experts,
            top_k=cfg.top_k,
            ep_size=cfg.ep_size,
            layer_ids=np.asarray(cfg.layer_ids),
            physical_to_logical=cfg.physical_to_logical,  # type: ignore[arg-type]
            model=cfg.model,
            engine=cfg.engine,
            run_id=self._run_id,
            rank=rank,
            world_size=world_size,
            hidden_size=cfg.hidden_size or 0,
            dtype_bytes=cfg.dtype_bytes,
        )

    def _streamed_schema(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{dataset: (row shape, dtype)}`` of what this mode streams."""
        cfg = self.config
        if self._pass_stream is not None:
            lay, r = self._layout, cfg.ep_size
            shapes: dict[str, tuple[tuple[int, ...], object]] = {
                "passes/pass_id": ((), np.int64), "passes/timestamp": ((), np.float64), "passes/num_tokens": ((), np.int64),
                "passes/physical_count": ((cfg.num_layers, lay.num_experts), np.int32),
                "passes/invalid_ids": ((cfg.num_layers,), np.int32),
                "passes/send_count": ((cfg.num_layers, r), np.int32), "passes/recv_count": ((cfg.num_layers, r), np.int32),
            }
        elif self._token_stream is not None:
            shapes = {
                "tokens/topk_ids": ((cfg.num_layers, cfg.top_k), self._token_stream.np_dtype),
                "tokens/pass_id": ((), np.int64), "tokens/position": ((), np.int32),
            }
        else:
            return {}
        if self._clock is not None:
            shapes.update({f"timing/{name}": spec for name, spec in row_fields(cfg.num_layers).items()})
        return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in shapes.items()}  # type: ignore[call-overload]

    def _open_segment(self) -> None:
        """Start the writer thread: rotating segments (streaming modes) or checkpoints (stat)."""
        cfg = self.config
        if cfg.mode == "stat" and not cfg.segment_seconds:
            return
        directory = check_writable_dir(Path(cfg.output_dir))
        sweep_dead_temporaries(directory)
        rank, world = _dist_world()
        header = self._header(rank, world)
        self._journal = Journal(journal_path(directory, self._run_id, rank))
        self._journal.note("start", pid=os.getpid(), host=socket.gethostname(), run_id=self._run_id, rank=rank, world_size=world, mode=cfg.mode, segment_seconds=cfg.segment_seconds, segment_bytes=cfg.segment_bytes)
        if cfg.mode == "stat":
            sink: CheckpointWriter | SegmentWriter = CheckpointWriter(checkpoint_path(directory, self._run_id, rank), header, self._journal, self._compression)
        else:
            sink = SegmentWriter(directory, header, self._streamed_schema(), self._write_totals, (cfg.num_layers, self._layout.width), cfg.segment_bytes, self._journal, self._compression)
        self._segment = BackgroundTraceWriter(sink)
        self._rotate_at = time.monotonic() + (cfg.segment_seconds or float("inf"))
        _OPEN_SEGMENTS.add(self)

    def _close_segment(self, keep: bool) -> None:
        """Stop the writer thread. ``keep``: close the open segment (or write a last checkpoint) and
        leave the files for ``moetrace recover``; else delete every file of the run not dumped yet."""
        segment, journal = self._segment, self._journal
        if segment is None:
            return
        if keep:
            self._rotate(self._next_pass_id - 1, wait=True)
        segment.close()
        self._segment, self._journal = None, None
        _OPEN_SEGMENTS.discard(self)
        sink = segment.sink
        if isinstance(sink, SegmentWriter):
            if not keep:
                sink.abort()
                for info in [*self._undumped_segments, *sink.take_completed()]:
                    info.path.unlink(missing_ok=True)
                self._undumped_segments = []
        elif not keep:
            sink.path.unlink(missing_ok=True)
        assert journal is not None
        if keep:
            journal.note("closed", undumped_passes=self.undumped_passes)
            journal.close()
        else:
            journal.close()
            journal.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ dump
    def _default_path(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return Path(self.config.output_dir) / f"moetrace-{self.config.mode}-{stamp}-{os.getpid()}.h5"

    def dump_record(self, path: Path | str | None = None) -> Path:
        """Write what was recorded to an HDF5 trace (atomically) and return its path.

        ``stat`` mode under ``torch.distributed`` is collective: every rank must
        call it; rank 0 writes one file with a rank axis and every rank returns
        its path. Streaming modes write one file per rank (``-rank{r}`` suffix
        when the world has several ranks) holding the passes since the previous
        dump (its ``/stat`` covers the same passes), so a long run can be dumped
        in segments. After a failure the recorded data is intact and the dump
        can be retried.
        """
        with self._lock:
            if not self._started:
                raise RecorderStateError("nothing recorded yet: call start_record() before dump_record()")
            target = Path(path) if path is not None else self._default_path()
            if target.suffix != ".h5":
                target = target.with_name(target.name + ".h5")
            rank, world = _dist_world()
            if self.config.mode == "stat":
                written = self._dump_stat(target, rank, world)
                self._dumped_passes = self._num_passes  # stat dumps are cumulative: every pass is in this one
            else:
                if world > 1:
                    target = target.with_name(f"{target.stem}-rank{rank}{target.suffix}")
                written = self._dump_stream(target, rank, world)
            self.last_dump_path = written
            return written

    def _gather(self, tensor: torch.Tensor, world: int) -> torch.Tensor:
        if world == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts)

    def _gather_timing(self, world: int, rows: bool) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]] | None:
        """Every rank's timing aggregates (and window rows when ``rows``), rank order; ``None`` when timing is off."""
        if self._clock is None:
            return None
        self._resolve_timing()
        mine = (self._timing_since_dump(), self._timing_rows.ordered() if rows else None)
        if world == 1:
            return [mine]
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, mine)
        return gathered  # type: ignore[return-value]

    def _timing_since_dump(self) -> dict[str, np.ndarray]:
        """Aggregates since the previous streaming dump (additive fields; maxima are since start_record)."""
        current = self._timing_stats.arrays()
        if self._dumped_timing is None:
            return current
        for name in ("phase_seconds_sum", "phase_count", "phase_histogram", "step_seconds_sum", "step_count", "step_histogram"):
            current[name] = current[name] - self._dumped_timing[name]
        return current

    def _write_timing(self, writer: TraceWriter, parts: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]] | None) -> None:
        """Root ``timing_*`` attributes, ``/stat`` timing aggregates ``[R, ...]`` and (gathered window) ``/timing`` rows."""
        if parts is None:
            return
        assert self._clock is not None
        writer.set_attr("timing_phases", json.dumps(list(PHASES)))
        writer.set_attr("timing_clock", self._clock.kind)
        writer.set_attr("timing_histogram_edges", HISTOGRAM_EDGES)
        for name in parts[0][0]:
            writer.write(f"stat/{name}", np.stack([np.asarray(stats[name]) for stats, _ in parts]))
        if parts[0][1] is None:
            return
        rows = {name: np.concatenate([r[name] for _, r in parts]) for name in parts[0][1]}  # type: ignore[index]
        rows["rank"] = np.concatenate([np.full(len(r["pass_id"]), i, dtype=np.int32) for i, (_, r) in enumerate(parts)])  # type: ignore[index]
        order = np.lexsort((rows["rank"], rows["pass_id"]))
        for name, array in rows.items():
            writer.write(f"timing/{name}", array[order])

    def _dump_stat(self, target: Path, rank: int, world: int) -> Path:
        assert self._window is not None
        timing = self._gather_timing(world, rows=True)
        rows = self._gather(self._counter.totals, world).cpu().numpy()
        w = self._window
        order = w.order()
        slots = len(w.pass_id)
        meta = np.full((slots, 3), -1.0)
        meta[: len(order)] = np.stack([w.pass_id, w.timestamp, w.num_tokens], axis=1)[order]
        passes = torch.tensor([self._num_passes, self._num_tokens], dtype=torch.int64, device=self._device)
        if world == 1:
            # The ring as it is (no reordered copy): the oldest slots first, then the wrapped ones.
            ring = w.counts.cpu().numpy()[None]
            wrap = min(len(order), slots - int(order[0])) if len(order) else 0
            all_counts = [ring[:, int(order[0]) : int(order[0]) + wrap], ring[:, : len(order) - wrap]] if len(order) else [ring[:, :0]]
            all_meta, all_passes = meta[None], passes.cpu().numpy()[None]
        else:
            counts = torch.zeros_like(w.counts)
            counts[: len(order)] = w.counts[torch.as_tensor(order, dtype=torch.long, device=self._device)]
            all_counts = [self._gather(counts, world).cpu().numpy()]
            all_meta = self._gather(torch.as_tensor(meta, dtype=torch.float64, device=self._device), world).cpu().numpy()
            all_passes = self._gather(passes, world).cpu().numpy()
        if rank != 0:
            return target
        writer = TraceWriter(target, self._header(rank=-1 if world > 1 else rank, world_size=world), compression=self._compression)
        try:
            self._write_stat_file(writer, rows, all_passes, all_meta, all_counts)
            self._write_timing(writer, timing)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    def _write_stat_file(self, writer: TraceWriter, rows: np.ndarray, passes: np.ndarray, meta: np.ndarray, counts: list[np.ndarray]) -> None:
        """``/stat`` and ``/window`` of a stat dump or checkpoint from host arrays: counter rows
        ``[R, L, C]``, ``(passes, tokens) [R, 2]``, window ``(pass_id, timestamp, tokens) [R, W, 3]``
        (pass id -1 = empty slot) and window counts as consecutive pieces ``[R, w_i, L, P]``
        along the window axis, oldest first (their lengths add up to at least the filled slots)."""
        filled = int((meta[:, :, 0] >= 0).sum(axis=1).max()) if meta.size else 0
        self._write_totals(writer, rows, passes[:, 0], passes[:, 1])
        writer.write("window/pass_id", meta[:, :filled, 0].astype(np.int64))
        writer.write("window/timestamp", meta[:, :filled, 1])
        writer.write("window/num_tokens", meta[:, :filled, 2].astype(np.int64))
        writer.write_pieces("window/physical_count", counts, axis=1, length=filled, compress=True)

    def _write_totals(self, writer: TraceWriter, rows: np.ndarray, num_passes: np.ndarray, num_tokens: np.ndarray) -> None:
        """Write ``/stat`` from counter rows ``[R, L, C]``."""
        lay = self._layout
        physical = rows[:, :, lay.experts]
        writer.write("stat/physical_count", physical, compress=True)
        writer.write("stat/logical_count", to_logical(physical, self.config.physical_to_logical), compress=True)  # type: ignore[arg-type]
        writer.write("stat/invalid_ids", lay.invalid(rows))
        writer.write(PADDING_IDS, rows[:, :, lay.padding])
        writer.write("stat/send_count", rows[:, :, lay.send])
        writer.write("stat/recv_count", rows[:, :, lay.recv])
        writer.write("stat/dropped", rows[:, :, lay.dropped])
        writer.write("stat/num_passes", np.asarray(num_passes, dtype=np.int64))
        writer.write("stat/num_tokens", np.asarray(num_tokens, dtype=np.int64))

    def _dump_stream(self, target: Path, rank: int, world: int) -> Path:
        """Close the open segment and join the segments since the previous dump into ``target``."""
        segment = self._segment
        if segment is None:
            raise RecorderStateError("no streaming segment is open (it was already dumped after stop_record); call start_record() to record again")
        timing = self._gather_timing(1, rows=False)
        self._rotate(self._next_pass_id - 1, wait=True)
        segment.drain()
        if segment.error is not None:
            error = segment.error
            self._errors.append(f"streaming write failed: {error}")
            raise TraceWriteError(f"the background trace writer failed earlier ({error}); the passes since then are lost, call reset() or start_record()") from error
        sink = segment.sink
        assert isinstance(sink, SegmentWriter) and self._journal is not None
        taken = self._undumped_segments = self._undumped_segments + sink.take_completed()
        if len(taken) == 1 and self._clock is None and _rename(taken[0].path, target):
            written = target  # one closed segment is already a complete trace of these passes
        elif taken:
            written = concat_segments([info.path for info in taken], target, extra=lambda w: self._write_timing(w, timing), compression=self._compression)
        else:
            written = self._write_empty_stream(target, rank, world, timing)
        # The segments' rows are now in a complete trace.
        self._journal.note("dumped", segments=[info.index for info in taken], path=str(written))
        for info in taken:
            info.path.unlink(missing_ok=True)
        self._undumped_segments = []
        self._dumped_passes, self._dumped_tokens = self._num_passes, self._num_tokens
        self._dumped_timing = self._timing_stats.arrays() if self._clock is not None else None
        if not self._recording:
            self._close_segment(keep=False)
        return written

    def _write_empty_stream(self, target: Path, rank: int, world: int, timing: list | None) -> Path:
        """A streaming dump with no passes since the previous one."""
        writer = TraceWriter(target, self._header(rank, world), compression=self._compression)
        try:
            zeros = np.zeros((1, self.config.num_layers, self._layout.width), dtype=np.int64)
            self._write_totals(writer, zeros, np.array([0]), np.array([0]))
            writer.write("stat/dropped_passes", np.zeros(1, dtype=np.int64))
            for name, (row_shape, dtype) in self._streamed_schema().items():
                writer.ensure_empty(name, row_shape, dtype)
            self._write_timing(writer, timing)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    # ------------------------------------------------------------------ snapshot / status
    def snapshot(self) -> RecorderSnapshot:
        """The latest completed host copy of the totals; never waits for the device."""
        cfg, lay = self.config, self._layout
        with self._lock:
            rows, (num_passes, num_tokens, timestamp) = self._snapshots.latest()
            recording, last, errors = self._recording, self.last_dump_path, tuple(self._errors)
            timing = self._timing_stats.arrays() if self._clock is not None else None
        physical = rows[:, lay.experts]
        return RecorderSnapshot(
            timestamp=timestamp,
            recording=recording,
            mode=cfg.mode,
            id_space=self.id_space,
            model=cfg.model,
            engine=cfg.engine,
            rank=cfg.ep_rank,
            ep_size=cfg.ep_size,
            top_k=cfg.top_k,
            hidden_size=cfg.hidden_size or 0,
            dtype_bytes=cfg.dtype_bytes,
            layer_ids=np.asarray(cfg.layer_ids),
            num_passes=num_passes,
            num_tokens=num_tokens,
            physical_count=physical,
            logical_count=to_logical(physical, cfg.physical_to_logical),  # type: ignore[arg-type]
            invalid_ids=lay.invalid(rows),
            send_count=rows[:, lay.send],
            recv_count=rows[:, lay.recv],
            dropped=rows[:, lay.dropped],
            last_dump_path=str(last) if last else None,
            errors=errors,
            dropped_passes=self.dropped_passes,
            timing=timing,
        )

    def status(self) -> dict[str, object]:
        """A JSON-ready summary for control endpoints."""
        with self._lock:
            segment_error = self._segment.error if self._segment is not None else None
            errors = [*self._errors, *([f"streaming write failed: {segment_error}"] if segment_error else [])]
            return {
                "configured": True,
                "recording": self._recording,
                "mode": self.config.mode,
                "passes": self._num_passes,
                "tokens": self._num_tokens,
                "dropped_passes": self.dropped_passes,
                "last_dump_path": str(self.last_dump_path) if self.last_dump_path else None,
                "output_dir": str(self.config.output_dir),
                "errors": errors,
            }


def _rename(source: Path, target: Path) -> bool:
    """Atomically move ``source`` to ``target``; False when that needs a copy (another file system)."""
    try:
        os.replace(source, target)
    except OSError:
        return False
    return True


_OPEN_SEGMENTS: weakref.WeakSet[ExpertDistributionRecorder] = weakref.WeakSet()


@atexit.register
def _close_segments_at_exit() -> None:
    """Stop writer threads before the interpreter tears HDF5 down (a daemon thread
    frozen inside h5py would deadlock the exit). Passes never dumped stay on disk as
    closed segments (or a checkpoint) for ``moetrace recover``."""
    for recorder in list(_OPEN_SEGMENTS):
        with recorder._lock:
            undumped = recorder.undumped_passes
            if undumped:
                _log.warning(
                    "moetrace: %d recorded passes were never dumped; they are kept in %s: run `moetrace recover %s`",
                    undumped, recorder.config.output_dir, recorder.config.output_dir,
                )
            recorder._close_segment(keep=bool(undumped))


class NoOpRecorder:
    """The global default: every hook and context manager does nothing.

    Lifecycle calls raise :class:`RecorderStateError` telling the user to
    configure a real recorder first.
    """

    recording = False
    mode = "none"
    num_passes = 0
    last_dump_path: Path | None = None

    def with_forward_pass(self, forward_pass_id: int | None = None) -> contextlib.nullcontext[int]:
        return contextlib.nullcontext(-1 if forward_pass_id is None else forward_pass_id)

    def with_current_layer(self, layer_idx: int) -> contextlib.nullcontext[int]:
        return contextlib.nullcontext(layer_idx)

    def disable_this_region(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def with_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return _UNTIMED

    def on_select_experts(self, topk_ids: torch.Tensor, layer: int | None = None) -> None:
        return None

    def on_dispatch(self, send_counts: torch.Tensor, recv_counts: torch.Tensor | None = None, dropped: torch.Tensor | None = None, layer: int | None = None) -> None:
        return None

    def _unconfigured(self, what: str) -> RecorderStateError:
        return RecorderStateError(f"{what}: no recorder is configured; call moetrace.configure(...) or set_recorder(...) first")

    def start_record(self) -> None:
        raise self._unconfigured("start_record")

    def stop_record(self) -> None:
        raise self._unconfigured("stop_record")

    def dump_record(self, path: Path | str | None = None) -> Path:
        raise self._unconfigured("dump_record")

    def reset(self) -> None:
        return None

    def snapshot(self) -> RecorderSnapshot:
        raise self._unconfigured("snapshot")

    def status(self) -> dict[str, object]:
        return {"configured": False, "recording": False, "mode": "none", "passes": 0, "tokens": 0, "last_dump_path": None, "output_dir": None, "errors": []}


Recorder = ExpertDistributionRecorder | NoOpRecorder
_global_recorder: Recorder = NoOpRecorder()


def get_recorder() -> Recorder:
    """The process-wide recorder (a :class:`NoOpRecorder` until one is set)."""
    return _global_recorder


def set_recorder(recorder: Recorder | None) -> Recorder:
    """Install ``recorder`` as the process-wide recorder (``None`` restores the no-op); returns the previous one."""
    global _global_recorder
    previous = _global_recorder
    _global_recorder = recorder if recorder is not None else NoOpRecorder()
    return previous

