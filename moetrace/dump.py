"""Writing a recorder's dumps: the gathers over ranks and the files they produce.

``stat`` mode under ``torch.distributed`` gathers every rank's counter rows,
window and timing to rank 0, which writes one trace with a rank axis
(:meth:`TraceDump.stat`). Streaming modes join the closed segments since the
previous dump into one per-rank trace (:meth:`TraceDump.stream`). Every file
is written through :class:`~moetrace.trace.writer.TraceWriter` (atomic: a
failure leaves nothing under the target name, and the recorder keeps its
state so the dump can be retried).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .accumulators import PassCounter, StatWindow
from .config import RecorderConfig
from .layout import RankLayout
from .session import RecordingSession
from .timing import HISTOGRAM_EDGES, PHASES
from .trace.join import concat_segments
from .trace.schema import Attr, Data, TraceHeader, dataset
from .trace.stat import CounterLayout, write_stat
from .trace.writer import TraceWriter

__all__ = ["TimingParts", "TraceDump", "dist_world", "gather", "gather_objects", "rank_world", "stat_gathers", "streamed_schema"]

#: Per rank, in rank order: timing aggregates ``{field: array}`` and (``stat`` dumps) the window's ``/timing`` rows.
TimingParts = list[tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]]


def dist_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_world(config: RecorderConfig) -> tuple[int, int]:
    """(rank, world size) this recorder's traces carry: its configured layout's when it has one, else the
    default process group's, else (0, 1).

    The layout's identity holds without a process group: vLLM tears its group down before the
    workers' exit dumps, and a driver or converter may give a layout (rank 5 of 8) and never
    start one.
    """
    if config.layout is not None:
        return config.layout.rank, config.layout.world_size
    return dist_world()


def stat_gathers(config: RecorderConfig) -> bool:
    """Whether a ``stat`` dump gathers every rank's rows over the default process group (a collective
    that rank 0 writes): only with ``config.gather_stat`` and while a group of this recorder's world
    size (> 1) is initialised. Otherwise each rank writes its own file (``moetrace merge`` / ``analyze``
    join them)."""
    world = rank_world(config)[1]
    return config.gather_stat and world > 1 and dist_world()[1] == world


def gather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order: ``[...]`` -> ``[world, ...]`` (collective)."""
    if world == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def gather_objects(obj: object, world: int) -> list[object]:
    """Every rank's picklable ``obj`` in rank order (collective)."""
    if world == 1:
        return [obj]
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, obj)
    return gathered


def _rename(source: Path, target: Path) -> bool:
    """Atomically move ``source`` to ``target``; False when that needs a copy (another file system)."""
    try:
        os.replace(source, target)
    except OSError:
        return False
    return True


class TraceDump:
    """How one recorder's traces are written.

    Args:
        config: the recorder's configuration.
        layout: the counter rows' columns.
        streamed: ``{dataset: (row shape, dtype)}`` of the streamed group (empty in ``stat`` mode).
        clock_kind: the phase clock (``"cuda_event"`` / ``"perf_counter"``), ``None`` without timing.
        compression: h5py filter keywords.
    """

    def __init__(
        self,
        config: RecorderConfig,
        layout: CounterLayout,
        streamed: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        clock_kind: str | None,
        compression: Mapping[str, object],
    ) -> None:
        self.config = config
        self.layout = layout
        self.streamed = dict(streamed)
        self.clock_kind = clock_kind
        self.compression = dict(compression)

    def default_path(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return Path(self.config.output_dir) / f"moetrace-{self.config.mode}-{stamp}-{os.getpid()}.h5"

    def header(self, run_id: str, rank: int, world_size: int, layouts: tuple[RankLayout, ...] | None = None) -> TraceHeader:
        """The trace header; ``layouts``: each rank row's layout (default: this rank's alone)."""
        own = (self.config.rank_layout(*rank_world(self.config)),) if layouts is None else layouts
        return TraceHeader.of_config(self.config, run_id, rank, world_size, own)

    # ------------------------------------------------------------------ pieces
    def write_totals(self, writer: TraceWriter, rows: np.ndarray, num_passes: np.ndarray, num_tokens: np.ndarray) -> None:
        """Write ``/stat`` from counter rows ``[R, L, C]``."""
        write_stat(writer, self.layout, self.config.physical_to_logical, rows, num_passes, num_tokens)  # type: ignore[arg-type]

    def write_stat_file(self, writer: TraceWriter, rows: np.ndarray, passes: np.ndarray, meta: np.ndarray, counts: list[np.ndarray]) -> None:
        """``/stat`` and ``/window`` of a stat dump or checkpoint from host arrays: counter rows
        ``[R, L, C]``, ``(passes, tokens) [R, 2]``, window ``(pass_id, timestamp, tokens) [R, W, 3]``
        (pass id -1 = empty slot) and window counts as consecutive pieces ``[R, w_i, L, P]``
        along the window axis, oldest first (their lengths add up to at least the filled slots)."""
        filled = int((meta[:, :, 0] >= 0).sum(axis=1).max()) if meta.size else 0
        self.write_totals(writer, rows, passes[:, 0], passes[:, 1])
        writer.write(Data.WINDOW_PASS_ID, meta[:, :filled, 0].astype(np.int64))
        writer.write(Data.WINDOW_TIMESTAMP, meta[:, :filled, 1])
        writer.write(Data.WINDOW_NUM_TOKENS, meta[:, :filled, 2].astype(np.int64))
        writer.write_pieces(Data.WINDOW_PHYSICAL_COUNT, counts, axis=1, length=filled, compress=True)

    def write_timing(self, writer: TraceWriter, parts: TimingParts | None) -> None:
        """Root ``timing_*`` attributes, ``/stat`` timing aggregates ``[R, ...]`` and (gathered window) ``/timing`` rows."""
        if parts is None:
            return
        writer.set_attr(Attr.TIMING_PHASES, json.dumps(list(PHASES)))
        writer.set_attr(Attr.TIMING_CLOCK, self.clock_kind)
        writer.set_attr(Attr.TIMING_HISTOGRAM_EDGES, HISTOGRAM_EDGES)
        for name in parts[0][0]:
            writer.write(dataset(Data.STAT, name), np.stack([np.asarray(stats[name]) for stats, _ in parts]))
        if parts[0][1] is None:
            return
        rows = {name: np.concatenate([r[name] for _, r in parts]) for name in parts[0][1]}  # type: ignore[index]
        rows["rank"] = np.concatenate([np.full(len(r["pass_id"]), i, dtype=np.int32) for i, (_, r) in enumerate(parts)])  # type: ignore[index]
        order = np.lexsort((rows["rank"], rows["pass_id"]))
        for name, array in rows.items():
            writer.write(dataset(Data.TIMING, name), array[order])

    # ------------------------------------------------------------------ dumps
    def stat(self, target: Path, run_id: str, rank: int, world: int, counter: PassCounter, window: StatWindow,
             num_passes: int, timing: TimingParts | None, gathered: bool = True) -> Path:
        """``stat`` mode: with ``gathered`` (collective under ``torch.distributed``) gather to rank 0,
        which writes ``target``; without, this rank writes its own row to ``target`` as rank ``rank`` of ``world``.

        Args:
            counter: the pass counter (``totals [L, C]`` and ``token_total [1]`` on the device).
            window: the window of the last passes.
            timing: every gathered rank's timing parts (this rank's alone when not ``gathered``).
        """
        totals = counter.totals
        device = totals.device
        peers = world if gathered else 1  # ranks whose rows go into this file
        layouts = tuple(gather_objects(self.config.rank_layout(rank, world), peers))  # every rank row's layout
        rows = gather(totals, peers).cpu().numpy()
        w = window
        order = w.order()
        slots = len(w.pass_id)
        meta = np.full((slots, 3), -1.0)
        meta[: len(order)] = np.stack([w.pass_id, w.timestamp, w.tokens.cpu().numpy()], axis=1)[order]
        passes = torch.cat([torch.tensor([num_passes], dtype=torch.int64, device=device), counter.token_total])
        if peers == 1:
            # The ring as it is (no reordered copy): the oldest slots first, then the wrapped ones.
            ring = w.counts.cpu().numpy()[None]
            wrap = min(len(order), slots - int(order[0])) if len(order) else 0
            all_counts = [ring[:, int(order[0]) : int(order[0]) + wrap], ring[:, : len(order) - wrap]] if len(order) else [ring[:, :0]]
            all_meta, all_passes = meta[None], passes.cpu().numpy()[None]
        else:
            counts = torch.zeros_like(w.counts)
            counts[: len(order)] = w.counts[torch.as_tensor(order, dtype=torch.long, device=device)]
            all_counts = [gather(counts, peers).cpu().numpy()]
            all_meta = gather(torch.as_tensor(meta, dtype=torch.float64, device=device), peers).cpu().numpy()
            all_passes = gather(passes, peers).cpu().numpy()
        if peers > 1 and rank != 0:
            return target
        header = self.header(run_id, rank=-1 if peers > 1 else rank, world_size=world, layouts=layouts)  # type: ignore[arg-type]
        with TraceWriter(target, header, compression=self.compression) as writer:
            self.write_stat_file(writer, rows, all_passes, all_meta, all_counts)
            self.write_timing(writer, timing)
            return writer.commit()

    def stream(self, target: Path, run_id: str, rank: int, world: int, session: RecordingSession, timing: TimingParts | None) -> Path:
        """Join the closed segments since the previous dump into ``target`` (the session's rows are
        drained already); one segment without timing is renamed, no segment gives an empty trace."""
        taken = session.take_segments()
        if len(taken) == 1 and self.clock_kind is None and _rename(taken[0].path, target):
            written = target  # one closed segment is already a complete trace of these passes
        elif taken:
            written = concat_segments([info.path for info in taken], target, extra=lambda w: self.write_timing(w, timing), compression=self.compression)
        else:
            written = self._empty_stream(target, run_id, rank, world, timing)
        session.consumed(taken, written)  # the segments' rows are now in a complete trace
        return written

    def _empty_stream(self, target: Path, run_id: str, rank: int, world: int, timing: TimingParts | None) -> Path:
        """A streaming dump with no passes since the previous one."""
        with TraceWriter(target, self.header(run_id, rank, world), compression=self.compression) as writer:
            zeros = np.zeros((1, self.config.num_layers, self.layout.width), dtype=np.int64)
            self.write_totals(writer, zeros, np.array([0]), np.array([0]))
            writer.write(Data.STAT_DROPPED_PASSES, np.zeros(1, dtype=np.int64))
            for name, (row_shape, dtype) in self.streamed.items():
                writer.ensure_empty(name, row_shape, dtype)
            self.write_timing(writer, timing)
            return writer.commit()


def streamed_schema(config: RecorderConfig, layout: CounterLayout, token_dtype: np.dtype | None,
                    timing_fields: Mapping[str, tuple[tuple[int, ...], object]] | None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{dataset: (row shape, dtype)}`` of what ``config.mode`` streams (empty for ``stat``).

    Args:
        token_dtype: dtype of ``/tokens/topk_ids`` (``per_token``).
        timing_fields: ``/timing`` row fields when timing is on.
    """
    if config.mode == "per_pass":
        r = config.ep_size
        shapes: dict[str, tuple[tuple[int, ...], object]] = {
            Data.PASSES_PASS_ID: ((), np.int64), Data.PASSES_TIMESTAMP: ((), np.float64), Data.PASSES_NUM_TOKENS: ((), np.int64),
            Data.PASSES_PHYSICAL_COUNT: ((config.num_layers, layout.num_experts), np.int32),
            Data.PASSES_INVALID_IDS: ((config.num_layers,), np.int32),
            Data.PASSES_SEND_COUNT: ((config.num_layers, r), np.int32), Data.PASSES_RECV_COUNT: ((config.num_layers, r), np.int32),
        }
    elif config.mode == "per_token":
        shapes = {
            Data.TOKENS_TOPK_IDS: ((config.num_layers, config.top_k), token_dtype),
            Data.TOKENS_PASS_ID: ((), np.int64), Data.TOKENS_POSITION: ((), np.int32),
        }
    else:
        return {}
    if timing_fields is not None:
        shapes.update({dataset(Data.TIMING, name): spec for name, spec in timing_fields.items()})
    return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in shapes.items()}  # type: ignore[call-overload]

