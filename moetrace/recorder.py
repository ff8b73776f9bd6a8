"""The expert distribution recorder: global, start/stop/dump, device-side counts.

Runtimes call the hooks from inside every MoE layer::

    rec = moetrace.get_recorder()
    with rec.with_forward_pass():
        for i, layer in enumerate(moe_layers):
            with rec.with_current_layer(i):
                topk_ids = router(x)               # [T, k]
                rec.on_select_experts(topk_ids)
                rec.on_dispatch(send_counts)       # [R], optional

Hooks check cheap metadata only (dtype, rank, device, layer index) and count with three fixed-shape device
ops into the pass counter (:mod:`moetrace.recording.pass_counter`); they never read tensor values on the
host, and return at once when not recording.

Lifecycle: ``start_record()`` begins a fresh recording (counts zeroed), ``stop_record()`` ends it,
``dump_record()`` writes what was recorded (while recording or after stop; a failed dump can be retried),
``reset()`` discards everything. ``start`` while recording, ``stop`` while stopped and ``dump`` before any
``start`` raise :class:`RecorderStateError`.

This module holds the hooks and the recording state machine; nothing in it asks for the mode: everything
that differs between modes is the mode's object (:mod:`moetrace.recording.modes`), built once (its sink, its
dumper in :mod:`moetrace.recording.dump_cuts`, its schema and files). The hooks' argument checks are
:mod:`moetrace.recording.hook_args`; the phase timing :mod:`moetrace.recording.timing_state`; the recording's
files while it runs :mod:`moetrace.recording.session`; writing the dumps' files :mod:`moetrace.recording.dump_files`;
the host copy that ``snapshot()`` reads :mod:`moetrace.snapshot`; the process-wide recorder :mod:`moetrace.process_recorder`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from .batch import PassBatch
from .config import RecorderConfig, rank_identity
from .devices import resolve_device
from .graphs import is_capturing
from .pass_phase import UNKNOWN, pass_phase_code, pass_requests
from .recording.dump_cuts import CutPoint, DumpLedger
from .recording.dump_files import TraceDump, shared_start
from .recording.hook_args import checked_batch, checked_dispatch, checked_ids, checked_layer
from .recording.modes import recording_mode
from .recording.pass_counter import PassCounter
from .recording.session import RecordingSession, SessionSlot, Staged
from .recording.timing_state import recording_timing
from .snapshot import RecorderSnapshot, SnapshotChannel
from .timing import PHASES, UNTIMED
from .trace.stat import CounterLayout
from .trace.writer import compression_options

__all__ = ["ExpertDistributionRecorder", "RecorderStateError"]

_log = logging.getLogger("moetrace")
_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}


class RecorderStateError(RuntimeError):
    """A lifecycle call that does not fit the recorder's state (e.g. start twice)."""


class _LayerScope:
    __slots__ = ("_layer", "_previous", "_recorder")

    def __init__(self, recorder: ExpertDistributionRecorder, layer: int) -> None:
        self._recorder, self._layer = recorder, layer

    def __enter__(self) -> int:
        self._previous = self._recorder._layer
        self._recorder._layer = self._layer
        clock = self._recorder._timing.live
        if clock is not None:
            clock.layer_scopes[self._layer].__enter__()
        return self._layer

    def __exit__(self, *exc: object) -> None:
        self._recorder._layer = self._previous
        clock = self._recorder._timing.live
        if clock is not None:
            clock.layer_scopes[self._layer].__exit__()


class ExpertDistributionRecorder:
    """Counts routed experts per layer, expert and EP rank on the device.

    Args:
        config: a validated :class:`~moetrace.config.RecorderConfig`.
    """

    def __init__(self, config: RecorderConfig) -> None:
        self.config = config.replace(device=resolve_device(config.device))  # type: ignore[arg-type]
        cfg = self.config
        self._device: torch.device = cfg.device  # type: ignore[assignment]
        self._layout = CounterLayout(cfg.num_physical_experts, cfg.ep_size)
        self._files = SessionSlot(self)  # crash safety: the recording's files while it runs
        self._mode = recording_mode(cfg)  # everything that differs between modes, asked once here
        # Buffers are normal tensors even when built under torch.inference_mode() (as engines
        # often do), so lifecycle calls outside it can update them in place.
        with torch.inference_mode(False):
            self._counter = PassCounter(cfg, self._layout, self._mode.keeps_token_rows)
            self._counter.set_gate(False)
            self._sink = self._mode.sink(self._layout, self._files.submit, self._files.settle)  # what the mode keeps of each pass
            self._snapshots = SnapshotChannel(tuple(self._counter.pass_phase_totals.shape), self._device)  # type: ignore[arg-type]
        # Phase timing (host-side): the clock, aggregates over all passes and per-pass rows.
        self._timing = recording_timing(cfg, self._device, self._sink.streamed, self._files.submit)
        self._lock = threading.RLock()
        self._recording = self._started = self._in_pass = self._pass_active = False
        self._batch: PassBatch | None = None  # the engine's batch of the pass being run (host arrays), if it gave one
        self._capture_open = False  # a hook ran under graph capture since the last hook that did not
        self._next_pass_id = 0
        self._pass_phase = UNKNOWN  # the pass phase set_pass_phase named for the pass in progress (or the next one)
        self._pass_requests = -1
        self._layer: int | None = None
        self._disabled = self._num_passes = 0
        self._run_id = uuid.uuid4().hex
        self._period = cfg.rotation_passes  # passes between rotations / checkpoints, agreed at start_record
        self._staged = Staged(self._counter, self._sink, self._timing.flush_rows)
        streamed = self._mode.streamed_schema(self._layout, self._timing.row_schema())
        self._dump = TraceDump(cfg, self._layout, streamed, self._timing.kind, compression_options(self._mode.compression()))
        self._ledger = DumpLedger(cfg, self._lock)  # dumps' files are written on its thread, never the forward thread
        self._dumper = self._mode.dumper(self._dump, self._counter, self._sink, self._timing, self._ledger, self._lock, self._hand_session)

    # ------------------------------------------------------------------ properties
    @property
    def recording(self) -> bool:
        """Whether hooks currently count."""
        return self._recording

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def run_id(self) -> str:
        """The current (or last) recording's run id: a trace's ``run_id`` attribute."""
        return self._run_id

    @property
    def num_passes(self) -> int:
        """Forward passes recorded since ``start_record``."""
        return self._num_passes

    @property
    def dropped_passes(self) -> int:
        """Passes dropped whole since ``start_record`` because the writer was behind (``on_overflow="drop"``)."""
        return self._sink.dropped_passes

    @property
    def undumped_passes(self) -> int:
        """Passes recorded since the last dump (since ``start_record`` before any dump)."""
        return self._num_passes - self._ledger.dumped_passes

    @property
    def id_space(self) -> str:
        """``"physical"`` when a non-identity physical-to-logical map is set, else ``"logical"``."""
        return "physical" if self.config.has_logical_map else "logical"

    # ------------------------------------------------------------------ context managers
    @contextlib.contextmanager
    def with_forward_pass(self, forward_pass_id: int | None = None, batch: PassBatch | None = None) -> Iterator[int]:
        """Mark one model forward. Yields the pass id (auto-incremented when ``None``).

        ``batch``: the engine's batch of this pass (:class:`~moetrace.batch.PassBatch`, host
        arrays), which ties ``per_token`` rows to their requests and gives the pass its phase;
        :meth:`set_batch` gives it from inside the pass instead. Passes do not nest. If the
        body raises, the partial pass is discarded, and so is a pass begun before ``start_record``.
        """
        if self._in_pass:
            raise RecorderStateError("with_forward_pass is already active: forward passes do not nest")
        pass_id = self._next_pass_id if forward_pass_id is None else int(forward_pass_id)
        self._next_pass_id = pass_id + 1
        self._batch = checked_batch(batch)
        self._in_pass = True
        self._pass_active = self._recording
        self._counter.restart_rows()  # also a graph captured inside this pass starts at row 0
        ok = False
        try:
            self._timing.begin_pass(self._pass_active, self._device)  # refuses a CUDA-graph capture: the finally below still ends the pass
            yield pass_id
            ok = True
        finally:
            if (self._pass_active or self._recording) and not is_capturing(self._device):
                if ok and self._pass_active:
                    self._end_pass(pass_id)
                else:  # it raised, or began before start_record: what a replay staged in it is not the recording's
                    self._discard_pass()
            self._in_pass = False
            self._pass_active = False
            self._timing.close_pass()
            self._batch = None

    def set_batch(self, batch: PassBatch | None) -> None:
        """Give the batch of the pass being run (inside ``with_forward_pass``), replacing any given before.

        For adapters that learn the batch only inside the pass (SGLang's model runner enters the
        pass itself). Host-side bookkeeping only: no device work, nothing per token.
        """
        if not self._in_pass:
            raise RecorderStateError("set_batch() called outside with_forward_pass(); give the batch of a pass while it runs")
        self._batch = checked_batch(batch)

    @property
    def current_batch(self) -> PassBatch | None:
        """The batch of the pass being run, as the engine gave it (``None``: none given, or no pass)."""
        return self._batch

    def set_pass_phase(self, phase: str | int, num_requests: int = -1) -> None:
        """Name the pass phase of the pass in progress (or, outside ``with_forward_pass``, of the next pass).

        ``phase``: a name of :data:`moetrace.pass_phase.PASS_PHASES` (``prefill``, ``decode``, ``mixed``,
        ``idle``; ``unknown`` when nobody calls this) or its code; ``num_requests``: requests in the
        pass's batch (-1: unknown; an ``idle`` pass has 0, given or not). Not the timing phases of
        :meth:`with_phase`. Host state only: the adapter calls it once per pass, outside any CUDA
        graph; the pass end (every pass, a replay too) counts the pass into it and resets it.

        Raises:
            ValueError: an unknown phase, or a count that breaks :data:`moetrace.pass_phase.REQUESTS_RULE`
                (0 requests in a non-idle pass, requests in an idle one, below -1).
        """
        code = pass_phase_code(phase)
        self._pass_requests = pass_requests(code, num_requests)
        self._pass_phase = code

    def with_current_layer(self, layer_idx: int) -> _LayerScope:
        """Set the MoE layer (compact index ``0..L-1``) that hooks in the block count into."""
        return _LayerScope(self, checked_layer(layer_idx, self.config.num_layers, "with_current_layer"))

    def with_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time phase ``name`` (one of :data:`moetrace.PHASES`) of the current layer.

        Use inside ``with_current_layer``. A shared null context (nothing
        timed, nothing allocated) unless ``RecorderConfig(timing=True)`` and a
        pass is being recorded. Phases are timed with ``perf_counter_ns`` on
        CPU and CUDA events on a GPU (see :mod:`moetrace.timing`).
        """
        clock = self._timing.live
        try:
            phase = _PHASE_INDEX[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown phase {name!r}; use one of {PHASES}") from None
        if clock is None or self._disabled:
            return UNTIMED
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
        # Being captured into a CUDA graph (engines capture at start-up, before any start_record):
        # queue the gated counting ops whether recording or not; the gate decides at each replay.
        if not is_capturing(self._device):
            self._capture_open = False
            return False
        if not self._capture_open:  # the first hook of a capture (engines warm up each graph eagerly before capturing it)
            self._capture_open = True
            self._counter.restart_rows()
        self._timing.begin_capture(self._device)  # raises with timing: timed events cannot be captured
        return True

    def _resolve_layer(self, layer: int | None, hook: str) -> int:
        if layer is not None:
            return checked_layer(layer, self.config.num_layers, hook)
        if self._layer is None:
            raise RecorderStateError(f"{hook} called outside with_current_layer(); wrap the MoE layer in recorder.with_current_layer(i) or pass layer=i")
        return self._layer

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
        self._counter.add_select(layer, checked_ids(topk_ids, self.config.top_k, self._device))

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
        checked_dispatch(send_counts, recv_counts, dropped, self.config.ep_size, self._device)
        self._counter.add_dispatch(layer, send_counts, recv_counts, dropped)

    # ------------------------------------------------------------------ pass end
    def _end_pass(self, pass_id: int) -> None:
        timings = self._timing.end_pass(pass_id)
        with self._lock:
            self._timing.add(timings)
            counter, timestamp = self._counter, time.time()
            phase, requests = self._pass_phase, self._pass_requests
            self._pass_phase, self._pass_requests = UNKNOWN, -1
            if self._batch is not None:  # the engine's batch names its phase and requests (it wins over set_pass_phase)
                phase, requests = pass_phase_code(self._batch.phase), self._batch.num_requests
            counter.fold(phase, requests)
            self._sink.end_pass(counter, pass_id, timestamp, phase, requests, self._batch)
            counter.clear()
            self._num_passes += 1
            self._snapshots.publish(counter.pass_phase_totals, counter.pass_phase_tokens, phase, self._num_passes, timestamp, counter.pass_phase_host)
            if self._files.after_pass(pass_id, self._num_passes):  # the writer failed: stop, the engine goes on
                self._recording = False
                self._counter.set_gate(False)

    def _discard_pass(self) -> None:
        self._pass_phase, self._pass_requests = UNKNOWN, -1
        self._timing.discard_pass()
        with self._lock:
            self._counter.clear()

    # ------------------------------------------------------------------ lifecycle
    def start_record(self) -> None:
        """Begin a fresh recording (counts, window and streams start empty; waits for dumps still being written)."""
        self._ledger.queue.wait()  # their segments belong to the recording that _clear closes
        with self._lock:
            if self._recording:
                raise RecorderStateError("already recording; call stop_record() first")
            self._clear()
            self._run_id, self._period = shared_start(self.config)
            self._open_session()
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
            self._snapshots.settle()
            self._files.rotate(self._next_pass_id - 1, self._num_passes)  # everything so far into closed segments / a checkpoint

    def reset(self) -> None:
        """Discard everything recorded (after the dumps still being written); keeps recording if it was."""
        self._ledger.queue.wait()
        with self._lock:
            self._clear()
            if self._recording:
                self._open_session()

    def _clear(self) -> None:
        self._close_session(keep=False)
        self._counter.reset()
        self._sink.reset()
        self._snapshots.clear()
        self._timing.reset()
        self._num_passes = 0
        self._ledger.clear()

    def _open_session(self) -> None:
        """Start the recording's files: rotating segments (streaming modes) or checkpoints (stat)."""
        if not self._mode.keeps_files():
            return
        identity = rank_identity(self.config)
        header = self._dump.header(self._run_id, identity.rank, identity.world_size)
        spec_for = self._mode.session_files(self._layout, self._dump.streamed, self._dump.compression)
        self._files.open(RecordingSession(self.config, header, spec_for, self._staged, self._period))

    def _close_session(self, keep: bool) -> None:
        """Stop the writer. ``keep``: close the open segment (or write a last checkpoint) and leave the files for ``moetrace recover``; else delete every file of the run not dumped yet."""
        self._files.close(keep, self._next_pass_id - 1, self._num_passes, self.undumped_passes)

    def _close_at_exit(self) -> None:
        """Interpreter exit (:func:`moetrace.recording.session.close_at_exit`): keep undumped passes on disk."""
        with self._lock:
            undumped = self.undumped_passes
            if undumped:
                out = self.config.output_dir
                _log.warning("moetrace: %d recorded passes were never dumped; they are kept in %s: run `moetrace recover %s`", undumped, out, out)
            self._close_session(keep=bool(undumped))

    # ------------------------------------------------------------------ dump
    def dump_record(self, path: Path | str | None = None, wait: bool = True) -> Path:
        """Write what was recorded to an HDF5 trace (atomically) and return its path.

        The dump is a cut at a pass boundary: under the lock a pass end also takes, the mode's
        dumper (:mod:`moetrace.recording.dump_cuts`) only hands the staged rows over (streaming modes) or
        copies the totals and begins a copy on write of the window (``stat``); recording goes on
        at once. The rest runs off the lock, and the file is joined or written on a background
        thread (in a child process when large), so the forward thread never waits for it.

        ``wait=True`` (the default) returns once the file is in place and raises if the dump
        failed; ``wait=False`` returns the path at once (the file appears there, complete, when
        the background dump ends: :meth:`wait_dumps` waits for it and raises its error,
        ``status()`` lists it under ``pending_dumps``, a failure under ``errors``). A caller on
        the engine's forward thread (SGLang's scheduler) passes ``wait=False``.

        ``stat`` mode under ``torch.distributed`` is collective: every rank must call it;
        rank 0 writes one file with a rank axis and every rank returns its path. Streaming
        modes write one file per rank (``-rank{r}`` suffix when the world has several
        ranks) holding the passes since the previous cut (its ``/stat`` covers the same
        passes), so a long run can be dumped in segments. After a failure the segments are
        kept and the next dump holds their passes too (or ``moetrace recover`` after a crash).
        """
        prepared = self._dumper.prepare()  # stat: the host ring, allocated before the lock
        with self._lock:
            if not self._started:
                raise RecorderStateError("nothing recorded yet: call start_record() before dump_record()")
            if self._dumper.needs_session and self._files.session is None:
                raise RecorderStateError("no streaming segment is open (it was already dumped after stop_record); call start_record() to record again")
            self._snapshots.settle()
            target = self._mode.dump_path(path)
            at = CutPoint(self._num_passes, self._next_pass_id - 1, self._recording, self._run_id, self._files.session)
            target, outside = self._dumper.cut(target, at, prepared)
        pending = self._ledger.queue.submit(target, outside())  # outside the lock: gathers, copies in flight
        return pending.result() if wait else target

    def _hand_session(self, session: RecordingSession | None, run_id: str) -> bool:
        """A streaming dump after ``stop_record`` takes the open session (``None``), and a failed
        one gives it back (lock held); ``False``: refused, a new recording began meanwhile."""
        if session is None:
            self._files.take()
            return True
        if self._files.session is None and not self._recording and self._run_id == run_id:
            self._files.open(session)
            return True
        return False

    @property
    def pending_dumps(self) -> int:
        """Dumps whose file is still being written on the background dump thread."""
        return len(self._ledger.pending)

    def wait_dumps(self) -> None:
        """Wait for every dump started so far; raises the first one's error if any failed."""
        for pending in self._ledger.pending:
            pending.result()

    @property
    def last_dump_path(self) -> Path | None:
        """The last file a dump put in place."""
        return self._ledger.last_path

    # ------------------------------------------------------------------ snapshot / status
    def snapshot(self) -> RecorderSnapshot:
        """The latest completed host copy of the totals; never waits for the device."""
        with self._lock:
            rows, (passes, tokens, stamp), host = self._snapshots.latest_phases()
            recording, last, errors = self._recording, self._ledger.last_path, tuple(self._ledger.errors)
            timing = self._timing.stats()
        return RecorderSnapshot.of_rows(
            self.config, self._layout, rows, (passes, int(tokens.sum()), stamp), recording=recording, id_space=self.id_space,
            pass_phase_num_passes=host[0], pass_phase_num_tokens=tokens, pass_phase_num_requests=host[1],
            last_dump_path=str(last) if last else None, errors=errors, dropped_passes=self.dropped_passes, timing=timing,
            rank_layout=rank_identity(self.config), retention=self._ledger.retention_stats(),
        )

    def status(self) -> dict[str, object]:
        """A JSON-ready summary for control endpoints."""
        with self._lock:
            tokens = self._snapshots.latest()[1][1]
            segment_error = self._files.error
            errors = [*self._ledger.errors, *([f"streaming write failed: {segment_error}"] if segment_error else [])]
            last = self.last_dump_path
            return {
                "configured": True, "recording": self._recording, "mode": self.config.mode, "passes": self._num_passes,
                "tokens": tokens, "dropped_passes": self.dropped_passes, "last_dump_path": str(last) if last else None,
                "pending_dumps": [str(p.target) for p in self._ledger.pending], "output_dir": str(self.config.output_dir),
                "errors": errors, "retention": self._ledger.retention_stats(),
                "layout": rank_identity(self.config).as_dict(),
            }

