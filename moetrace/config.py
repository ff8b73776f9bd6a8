"""Validated configuration for the recorder and the capturer.

Every field is checked once, at construction, so that the hot path never has
to look at a value twice. Errors say which field is wrong and what to pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from .layout import RankLayout
from .trace.retention import RetentionPolicy

__all__ = ["MODES", "NOMINAL_PASSES_PER_SECOND", "CaptureConfig", "RecorderConfig", "RecorderMode", "rank_identity"]

RecorderMode = Literal["stat", "per_pass", "per_token"]
MODES: tuple[str, ...] = ("stat", "per_pass", "per_token")
#: Passes a second that ``segment_seconds`` maps to when ``segment_passes`` is not given (a 10 ms
#: pass; the period is a pass count so that every rank's periodic work falls on the same pass).
NOMINAL_PASSES_PER_SECOND = 100


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _checked_period(seconds: object, passes: object) -> float:
    """``segment_seconds`` as a float, once it and ``segment_passes`` are checked."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)) or not 0 <= seconds < float("inf"):
        raise ValueError(f"segment_seconds must be a number of seconds >= 0 (0 = no periodic work), got {seconds!r}")
    if passes is not None and (isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 0):
        raise ValueError(f"segment_passes must be a number of passes >= 0 (0 = no periodic work) or None (from segment_seconds), got {passes!r}")
    return float(seconds)


@dataclasses.dataclass(frozen=True)
class RecorderConfig:
    """What the recorder records and where it keeps it.

    Args:
        num_layers: number of MoE layers ``L`` (compact numbering ``0..L-1``).
        num_physical_experts: physical expert slots ``P`` (ids seen by hooks).
        top_k: experts per token ``k``.
        physical_to_logical: optional map ``[L, P]`` from physical slot to
            logical expert (EPLB vocabulary). ``None`` means identity.
        ep_size: expert-parallel ranks ``R``; physical experts are split
            contiguously, ``P / R`` per rank.
        ep_rank: this process's EP rank.
        mode: ``"stat"``, ``"per_pass"`` or ``"per_token"``.
        window: passes kept in the ``stat`` mode's time-ordered window.
        device: where the counting buffers live (the hooks' tensors' device).
        output_dir: where dumps go when no path is given.
        layer_ids: model layer index of each MoE layer ``[L]`` (gaps allowed).
        max_tokens_per_pass: largest pass ``per_token`` mode accepts.
        stream_chunk_passes: passes staged before a
            ``per_pass`` hand-off to the background writer.
        stream_chunk_tokens: tokens staged before a ``per_token`` hand-off.
        hidden_size: model hidden size ``H`` (for all-to-all byte figures).
        dtype_bytes: bytes per activation element ``b``.
        model: model name written into traces and metrics.
        engine: engine name written into traces and metrics.
        timing: time the phases bracketed by ``with_phase`` (and each layer
            and pass); off by default, and then free.
        timing_ring: passes whose CUDA timing events may be in flight at
            once (CUDA only; a pass finding every slot busy is not timed).
        segment_seconds: crash safety, the period of the recording's periodic
            work: streaming modes close their open segment file (complete,
            fsynced, renamed), ``stat`` mode writes a checkpoint of its totals
            and window. The period is counted in passes, not on the clock, so
            that every rank of a fleet does it at the same pass (under expert
            parallelism one rank's pause is every rank's): ``segment_passes``
            when given, else ``segment_seconds`` times
            :data:`NOMINAL_PASSES_PER_SECOND` (10 s: every 1,000th pass). ``0``
            turns the periodic work (and stat checkpoints) off. See
            docs/trace-format.md.
        segment_passes: the period in passes itself (``None``: from
            ``segment_seconds``; ``0``: off). Rank 0's value holds for every
            rank of a process group (agreed at ``start_record``).
        segment_bytes: streaming modes also close the open segment once it
            holds this many bytes of raw rows, whichever comes first.
        compression: filter for streamed rows and large ``/stat`` and
            ``/window`` datasets: ``"none"``, ``"lzf"``, ``"gzip[:level]"``,
            or with the optional ``hdf5plugin`` extra ``"zstd[:level]"`` /
            ``"blosc2[:level]"`` (see ``moetrace.trace.writer.compression_options``).
            ``"auto"`` (default): ``"lzf"`` for ``per_pass`` (sparse counts
            shrink 60x and write faster), ``"none"`` for ``per_token`` (skewed
            int8 ids gain about 10% from lzf at a fraction of the throughput)
            and for ``stat`` dumps (see docs/benchmarks.md).
        layout: the engine's parallel layout as seen by this rank
            (:class:`moetrace.layout.RankLayout`: TP, DP, EP, PP sizes and
            coordinates). Written into traces, snapshots and ``/status``, and
            used to count each token once where ranks replicate routing (TP
            attention). ``None``: every rank holds its own tokens
            (``RankLayout.independent`` with this ``ep_size``/``ep_rank``).
        on_overflow: what a streaming mode does when its background writer
            falls behind and both host buffers are in flight: ``"block"``
            waits (the forward stalls, nothing is lost) or ``"drop"`` drops
            the staged passes whole, counts them (``dropped_passes``) and
            never waits.
        retention: bounded disk for a long-running recorder
            (:class:`~moetrace.trace.retention.RetentionPolicy`: keep the last N
            dumps / D seconds / B bytes of ``output_dir``, older streaming dumps
            compacted to their totals), applied after every dump; ``None``: keep all.
        gather_stat: ``stat`` dumps under an initialised process group of this
            rank's world size gather every rank's rows to rank 0, which writes
            one file (a collective: every rank dumps together). ``False``: each
            rank writes its own ``-rank<r>`` file, for engines that dump their
            ranks one at a time (vLLM: a control endpoint and an exit dump per
            worker); ``moetrace merge`` / ``analyze`` join them.
        run_id: the run id every rank's traces carry (a launcher gives all ranks the
            same one, so ``moetrace merge`` / ``analyze`` join their files); ``None``:
            a new one at each ``start_record``, broadcast to the ranks of the
            process group when there is one.
    """

    num_layers: int
    num_physical_experts: int
    top_k: int
    physical_to_logical: np.ndarray | None = None
    ep_size: int = 1
    ep_rank: int = 0
    mode: str = "stat"
    window: int = 1000
    device: torch.device | str = "cpu"
    output_dir: Path | str = "."
    layer_ids: tuple[int, ...] | None = None
    max_tokens_per_pass: int = 8192
    stream_chunk_passes: int = 256
    stream_chunk_tokens: int = 65536
    hidden_size: int | None = None
    dtype_bytes: int = 2
    model: str = ""
    engine: str = ""
    timing: bool = False
    timing_ring: int = 4
    segment_seconds: float = 10.0
    segment_passes: int | None = None
    segment_bytes: int = 256 * 2**20
    compression: str = "auto"
    on_overflow: str = "block"
    retention: RetentionPolicy | None = None
    layout: RankLayout | None = None
    gather_stat: bool = True
    run_id: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        num_layers = _positive_int("num_layers", self.num_layers)
        num_physical = _positive_int("num_physical_experts", self.num_physical_experts)
        top_k = _positive_int("top_k", self.top_k)
        if top_k > num_physical:
            raise ValueError(f"top_k={top_k} exceeds num_physical_experts={num_physical}")
        ep_size = _positive_int("ep_size", self.ep_size)
        if num_physical % ep_size:
            raise ValueError(
                f"num_physical_experts={num_physical} is not divisible by ep_size={ep_size}; "
                "each EP rank must own the same number of physical experts"
            )
        if not 0 <= int(self.ep_rank) < ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} is outside [0, ep_size={ep_size})")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.timing, bool):
            raise ValueError(f"timing must be True or False, got {self.timing!r}")
        for name in ("window", "max_tokens_per_pass", "stream_chunk_passes", "stream_chunk_tokens", "dtype_bytes", "timing_ring", "segment_bytes"):
            set_(self, name, _positive_int(name, getattr(self, name)))
        set_(self, "segment_seconds", _checked_period(self.segment_seconds, self.segment_passes))
        from .trace.writer import compression_options

        if self.compression != "auto":  # "auto": each mode's default (moetrace.recording.modes)
            compression_options(self.compression)  # raises ValueError naming the accepted specs
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            raise ValueError(f"retention must be a moetrace.trace.retention.RetentionPolicy or None, got {type(self.retention).__name__}")
        if not isinstance(self.gather_stat, bool):
            raise ValueError(f"gather_stat must be True or False, got {self.gather_stat!r}")
        if self.on_overflow not in ("block", "drop"):
            raise ValueError(f"on_overflow must be 'block' or 'drop', got {self.on_overflow!r}")
        if self.stream_chunk_tokens < self.max_tokens_per_pass:
            raise ValueError(
                f"stream_chunk_tokens={self.stream_chunk_tokens} must be >= max_tokens_per_pass="
                f"{self.max_tokens_per_pass} so that one pass always fits in a chunk"
            )
        if self.layout is not None:
            if not isinstance(self.layout, RankLayout):
                raise ValueError(f"layout must be a moetrace.layout.RankLayout, got {type(self.layout).__name__}")
            if (self.layout.ep_size, self.layout.ep_rank) != (ep_size, int(self.ep_rank)):
                raise ValueError(f"layout says EP rank {self.layout.ep_rank} of {self.layout.ep_size} but ep_size={ep_size}, "
                                 f"ep_rank={self.ep_rank}; pass the same EP coordinates to both")
        if self.run_id is not None and not (isinstance(self.run_id, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id)):
            raise ValueError(f"run_id must be 1-64 letters, digits, '_' or '-' (it names journal files), got {self.run_id!r}")
        if self.hidden_size is not None:
            set_(self, "hidden_size", _positive_int("hidden_size", self.hidden_size))
        set_(self, "num_layers", num_layers)
        set_(self, "num_physical_experts", num_physical)
        set_(self, "top_k", top_k)
        set_(self, "ep_size", ep_size)
        set_(self, "ep_rank", int(self.ep_rank))
        set_(self, "device", torch.device(self.device))
        set_(self, "output_dir", Path(self.output_dir))
        set_(self, "physical_to_logical", self._checked_map(num_layers, num_physical))
        set_(self, "layer_ids", self._checked_layer_ids(num_layers))

    def _checked_map(self, num_layers: int, num_physical: int) -> np.ndarray:
        if self.physical_to_logical is None:
            return np.tile(np.arange(num_physical, dtype=np.int64), (num_layers, 1))
        raw = self.physical_to_logical
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().cpu().numpy()
        mapping = np.asarray(raw)
        if mapping.ndim == 1:
            mapping = np.tile(mapping, (num_layers, 1))
        if mapping.shape != (num_layers, num_physical):
            raise ValueError(
                f"physical_to_logical must have shape [num_layers, num_physical_experts] = "
                f"[{num_layers}, {num_physical}], got {list(mapping.shape)}"
            )
        if not np.issubdtype(mapping.dtype, np.integer):
            raise ValueError(f"physical_to_logical must hold integers, got dtype {mapping.dtype}")
        if mapping.min() < 0:
            raise ValueError("physical_to_logical holds negative ids; every physical slot must map to an expert")
        return mapping.astype(np.int64)

    def _checked_layer_ids(self, num_layers: int) -> tuple[int, ...]:
        if self.layer_ids is None:
            return tuple(range(num_layers))
        ids = tuple(int(i) for i in self.layer_ids)
        if len(ids) != num_layers:
            raise ValueError(f"layer_ids has {len(ids)} entries, expected num_layers={num_layers}")
        if any(b <= a for a, b in itertools.pairwise(ids)) or (ids and ids[0] < 0):
            raise ValueError(f"layer_ids must be non-negative and strictly increasing, got {list(ids)}")
        return ids

    @property
    def num_logical_experts(self) -> int:
        """Logical experts ``E`` (``max(physical_to_logical) + 1``)."""
        assert self.physical_to_logical is not None
        return int(self.physical_to_logical.max()) + 1

    @property
    def has_logical_map(self) -> bool:
        """True when physical ids differ from logical ids somewhere."""
        assert self.physical_to_logical is not None
        identity = np.arange(self.num_physical_experts)
        return not bool((self.physical_to_logical == identity).all())

    @property
    def rotation_passes(self) -> int:
        """The period of the recording's periodic work in passes (``0``: none): ``segment_passes``, else
        ``segment_seconds`` at :data:`NOMINAL_PASSES_PER_SECOND`."""
        if self.segment_passes is not None:
            return int(self.segment_passes)
        return math.ceil(self.segment_seconds * NOMINAL_PASSES_PER_SECOND)


    @property
    def experts_per_rank(self) -> int:
        """Physical experts each EP rank owns (``P / R``)."""
        return self.num_physical_experts // self.ep_size

    def replace(self, **changes: object) -> RecorderConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """Sizes of the per-request routed-experts capturer.

    Args:
        num_layers: model layers ``L`` that may be captured.
        top_k: experts per token ``k``.
        max_tokens_per_pass: largest forward pass in tokens.
        num_kv_slots: KV-cache slots of the serving engine (host buffer rows).
        device: device of the ids handed to ``capture``.
    """

    num_layers: int
    top_k: int
    max_tokens_per_pass: int
    num_kv_slots: int
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "max_tokens_per_pass", "num_kv_slots"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        object.__setattr__(self, "device", torch.device(self.device))


def rank_identity(config: RecorderConfig | None = None, layout: RankLayout | None = None,
                  group: dist.ProcessGroup | None = None) -> RankLayout:
    """This rank's identity (its rank, world size and parallel coordinates), from whichever of a
    config, a layout and a process group are given; the one place moetrace works it out.

    The first that knows wins: ``layout``; ``config.layout``; the process ``group`` (default: the
    default group, when initialised), every rank holding its own tokens with the config's EP
    coordinates; else rank 0 of 1. A layout holds without a process group: vLLM tears its group down
    before the workers' exit dumps, and a driver or converter may give a layout (rank 5 of 8) and
    never start one.

    Args:
        config: the recorder's configuration (its ``layout``, ``ep_size`` and ``ep_rank``).
        layout: a layout that overrides everything else.
        group: the process group whose rank and size to take (``None``: the default group).
    """
    if layout is not None:
        return layout
    if config is not None and config.layout is not None:
        return config.layout
    rank, world = 0, 1
    if group is not None or (dist.is_available() and dist.is_initialized()):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    ep_size, ep_rank = (config.ep_size, config.ep_rank) if config is not None else (1, 0)
    return RankLayout.independent(rank, world, ep_size, ep_rank)
