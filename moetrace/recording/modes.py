"""The recorder's modes, one class each: everything that differs between ``stat``, ``per_pass`` and ``per_token``.

A mode owns what it keeps of each pass (its sink), how a dump is cut (its dumper), what it
streams (its schema), its default file name, what its recording session opens while it runs
(checkpoints or segments), and its compression default. The recorder builds its mode once
(:func:`recording_mode`) and never asks which it is.

**A new mode** is one new subclass of :class:`RecordingMode` here, listed in
:data:`MODE_CLASSES` (its name also in :data:`moetrace.config.MODES`, which validates
configurations), plus its tests: the mode's counts against an independent count of the same
ids, its dump read back, the op-count test of ``tests/recorder/test_hook_ops.py``, and the
streaming and fault suites if it streams. Its sink, if none of the existing ones fits, goes
in its own module next to :mod:`.window` and :mod:`.streams`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..config import RecorderConfig
from ..trace.files import checkpoint_path, journal_path
from ..trace.schema import STRING_DTYPE, Data, TraceHeader, dataset
from ..trace.stat import CounterLayout
from ..trace.writer import token_id_dtype
from ..trace.writer_process import WriterSpec
from .dump_cuts import DumpLedger, HandSession, ModeDumper, StatDumper, StreamDumper
from .dump_files import TraceDump
from .pass_counter import PassCounter
from .session import WriterSpecFor
from .sink import ModeSink, Submit
from .streams import PassStream, RowStream, TokenStream
from .timing_state import NoTiming
from .window import StatWindow

__all__ = ["MODE_CLASSES", "PerPassMode", "PerTokenMode", "RecordingMode", "StatMode", "recording_mode"]

#: ``{dataset: (row shape, dtype)}`` of what a mode streams.
Schema = dict[str, tuple[tuple[int, ...], np.dtype]]


class RecordingMode:
    """One recorder mode (see the module docstring for what a new mode takes).

    Args:
        config: the recorder's configuration (its ``mode`` is this class's :attr:`name`).
    """

    #: The mode's name: ``RecorderConfig.mode``, the trace's ``mode`` attribute, and the default file name's.
    name: ClassVar[str]
    #: Whether the pass counter must keep every row of a pass (a pass over ``max_tokens_per_pass`` is refused).
    keeps_token_rows: ClassVar[bool] = False
    #: What ``compression="auto"`` means for this mode.
    auto_compression: ClassVar[str] = "none"

    def __init__(self, config: RecorderConfig) -> None:
        self.config = config

    def compression(self) -> str:
        """The configured compression, ``"auto"`` resolved for this mode."""
        return self.auto_compression if self.config.compression == "auto" else self.config.compression

    def dump_path(self, path: Path | str | None) -> Path:
        """Where a dump asked for at ``path`` goes (``.h5`` added when missing); with no path, the
        mode's default file name ``output_dir/moetrace-<mode>-<time>-<pid>.h5``."""
        if path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            return Path(self.config.output_dir) / f"moetrace-{self.name}-{stamp}-{os.getpid()}.h5"
        target = Path(path)
        return target if target.suffix == ".h5" else target.with_name(target.name + ".h5")

    def keeps_files(self) -> bool:
        """Whether a recording keeps files while it runs (crash safety: segments or checkpoints)."""
        return True

    def sink(self, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> ModeSink:
        """What the mode keeps of each pass; ``submit`` hands a job to the segment writer, ``settle``
        waits for the copies in flight."""
        raise NotImplementedError

    def streamed_schema(self, layout: CounterLayout, timing_fields: Mapping[str, tuple[tuple[int, ...], object]] | None) -> Schema:
        """``{dataset: (row shape, dtype)}`` of what the mode streams, ``/timing`` rows included when
        ``timing_fields`` (the timing row fields) are given; empty when it streams nothing."""
        return {}

    def session_files(self, layout: CounterLayout, streamed: Schema, compression: Mapping[str, object]) -> WriterSpecFor:
        """What the recording's session opens while it runs (h5py filter keywords ``compression``)."""
        raise NotImplementedError

    def dumper(self, dump: TraceDump, counter: PassCounter, sink: ModeSink, timing: NoTiming,
               ledger: DumpLedger, lock: threading.RLock, hand_session: HandSession) -> ModeDumper:
        """How a dump is cut under the recorder's ``lock`` (over the recorder's counter and ``sink``)."""
        raise NotImplementedError


class StatMode(RecordingMode):
    """``stat``: totals and a ring of the last ``window`` passes; cumulative, collective dumps with
    a rank axis; checkpoints every ``rotation_passes`` passes (none when 0)."""

    name = "stat"

    def keeps_files(self) -> bool:
        return bool(self.config.rotation_passes)

    def sink(self, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> StatWindow:
        return StatWindow(self.config, layout)

    def session_files(self, layout: CounterLayout, streamed: Schema, compression: Mapping[str, object]) -> WriterSpecFor:
        segment_bytes = self.config.segment_bytes

        def spec_for(directory: Path, header: TraceHeader) -> WriterSpec:
            return WriterSpec(journal_path(directory, header.run_id, header.rank), checkpoint_path(directory, header.run_id, header.rank),
                              directory, header, {}, layout, segment_bytes, compression)

        return spec_for

    def dumper(self, dump: TraceDump, counter: PassCounter, sink: ModeSink, timing: NoTiming,
               ledger: DumpLedger, lock: threading.RLock, hand_session: HandSession) -> StatDumper:
        assert isinstance(sink, StatWindow), "StatMode.sink built it"
        return StatDumper(self.config, dump, counter, sink, timing, ledger, lock)


class _StreamingMode(RecordingMode):
    """What the streaming modes share: a row stream as sink, rotating segments, per-rank dumps of
    the passes since the previous cut."""

    stream: ClassVar[type[RowStream]]

    def sink(self, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> RowStream:
        return self.stream(self.config, layout, submit, settle)

    def streamed_schema(self, layout: CounterLayout, timing_fields: Mapping[str, tuple[tuple[int, ...], object]] | None) -> Schema:
        shapes = self._rows(layout)
        if timing_fields is not None:
            shapes.update({dataset(Data.TIMING, name): spec for name, spec in timing_fields.items()})
        return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in shapes.items()}  # type: ignore[call-overload]

    def _rows(self, layout: CounterLayout) -> dict[str, tuple[tuple[int, ...], object]]:
        """The mode's own streamed rows (no ``/timing``)."""
        raise NotImplementedError

    def session_files(self, layout: CounterLayout, streamed: Schema, compression: Mapping[str, object]) -> WriterSpecFor:
        config = self.config

        def spec_for(directory: Path, header: TraceHeader) -> WriterSpec:
            return WriterSpec(journal_path(directory, header.run_id, header.rank), None, directory, header, streamed, layout,
                              config.segment_bytes, compression)

        return spec_for

    def dumper(self, dump: TraceDump, counter: PassCounter, sink: ModeSink, timing: NoTiming,
               ledger: DumpLedger, lock: threading.RLock, hand_session: HandSession) -> StreamDumper:
        return StreamDumper(self.config, dump, timing, ledger, hand_session)


class PerPassMode(_StreamingMode):
    """``per_pass``: every pass's counter rows (``/passes``), streamed; lzf by default (counts compress well)."""

    name = "per_pass"
    auto_compression = "lzf"
    stream = PassStream

    def _rows(self, layout: CounterLayout) -> dict[str, tuple[tuple[int, ...], object]]:
        layers, ranks = self.config.num_layers, self.config.ep_size
        return {
            Data.PASSES_PASS_ID: ((), np.int64), Data.PASSES_TIMESTAMP: ((), np.float64), Data.PASSES_NUM_TOKENS: ((), np.int64),
            Data.PASSES_PHYSICAL_COUNT: ((layers, layout.num_experts), np.int32),
            Data.PASSES_INVALID_IDS: ((layers,), np.int32),
            Data.PASSES_SEND_COUNT: ((layers, ranks), np.int32), Data.PASSES_RECV_COUNT: ((layers, ranks), np.int32),
            Data.PASSES_PASS_PHASE: ((), np.int8), Data.PASSES_NUM_REQUESTS: ((), np.int32),
        }


class PerTokenMode(_StreamingMode):
    """``per_token``: every token's ``[L, k]`` ids (``/tokens``), streamed; the pass counter keeps every row."""

    name = "per_token"
    keeps_token_rows = True
    stream = TokenStream

    def _rows(self, layout: CounterLayout) -> dict[str, tuple[tuple[int, ...], object]]:
        return {
            Data.TOKENS_TOPK_IDS: ((self.config.num_layers, self.config.top_k), token_id_dtype(self.config.num_physical_experts)),
            Data.TOKENS_PASS_ID: ((), np.int64), Data.TOKENS_POSITION: ((), np.int32), Data.TOKENS_PASS_PHASE: ((), np.int8),
            Data.TOKENS_REQUEST: ((), np.int32), Data.TOKENS_REQUEST_POSITION: ((), np.int32),
            Data.REQUEST_TABLE_ID: ((), STRING_DTYPE),
        }


#: Every mode, by name.
MODE_CLASSES: dict[str, type[RecordingMode]] = {mode.name: mode for mode in (StatMode, PerPassMode, PerTokenMode)}


def recording_mode(config: RecorderConfig) -> RecordingMode:
    """The mode object of ``config.mode``."""
    return MODE_CLASSES[config.mode](config)
