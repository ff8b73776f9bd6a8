"""``analyze_trace``: every balance figure of a trace in one streaming read.

Totals come from ``/stat`` (every mode writes it). The time-ordered data
(``/window``, ``/passes`` or ``/tokens``) is read once, a chunk at a time, to
build the drift series and, for ``per_token`` traces, co-activation and
cross-layer transitions. Memory is bounded by the chunk sizes and the
``[L, E, E]`` result matrices, never by the trace length.

``AnalysisReport.to_dict()`` gives the JSON document described in
``docs/analysis.md`` (``schema = "moetrace.analysis"``, ``schema_version = 1``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .. import balance
from ..ids import to_logical
from ..pass_phase import PASS_PHASES
from ..trace.pass_phases import pass_phase_counts, pass_phase_physical_count, phase_of
from ..trace.reader import Trace, open_trace
from ..trace.schema import Attr
from ..words import counted
from .coactivation import (
    CoactivationAccumulator,
    mutual_information_bits,
    top_pairs,
    top_transitions,
)
from .drift import DriftSeries, WindowAccumulator
from .projection import ProjectionRow, ep_projection
from .source import count_records, iter_pass_blocks, select_layers, token_pass_block
from .timing import analyze_timing

__all__ = ["REPORT_SCHEMA", "REPORT_SCHEMA_VERSION", "AnalysisReport", "analyze_trace", "default_window_size", "progress_bar"]

REPORT_SCHEMA = "moetrace.analysis"
REPORT_SCHEMA_VERSION = 1
#: Default number of drift windows when ``window`` is not given.
DEFAULT_WINDOWS = 20


@contextlib.contextmanager
def progress_bar(enabled: bool | None, total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields ``advance(n)``.

    ``enabled=None`` shows it only when stderr is a terminal.
    """
    console = Console(file=sys.stderr)
    show = console.is_terminal if enabled is None else enabled
    if not show or total <= 0:
        yield lambda n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=console.is_terminal) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@dataclasses.dataclass
class AnalysisReport(balance.LoadMetrics):
    """Balance, entropy, co-activation and drift figures of one trace.

    Attributes:
        path: the trace.
        attrs: the trace's root attributes.
        layer_ids: model layer ids ``[L]`` analysed.
        physical_count: ``[L, P]`` token copies per physical expert (all ranks).
        logical_count: ``[L, E]`` token copies per logical expert (all ranks).
        ep_size: EP ranks ``R`` of the recorded layout.
        num_passes: forward passes (largest count over recording ranks).
        num_tokens: tokens (sum over recording ranks).
        invalid_ids, dropped: totals over ranks and the selected layers.
        top: how many hottest experts / pairs to list per layer.
        coactivation: co-activation and transitions (``per_token`` traces only).
        drift: per-window series (when the trace has time-ordered data).
        notes: what could not be computed and why, or consistency warnings.
        timing: phase timing and stragglers (:func:`moetrace.analysis.timing.analyze_timing`),
            ``None`` when the trace was recorded without timing.
        pass_phase: the pass phase analysed (``prefill``, ``decode``, ...: counts, passes, tokens
            and drift of its passes only), ``None`` for every pass.
    """

    path: Path
    attrs: dict[str, object]
    layer_ids: np.ndarray
    physical_count: np.ndarray
    logical_count: np.ndarray
    ep_size: int
    num_passes: int
    num_tokens: int
    invalid_ids: int
    dropped: int
    top: int
    coactivation: CoactivationAccumulator | None
    drift: DriftSeries | None
    notes: list[str]
    timing: dict[str, object] | None = None
    pass_phase: str | None = None

    def hottest(self, layer: int) -> list[dict[str, float]]:
        """The ``top`` busiest logical experts of compact layer ``layer``."""
        counts = self.logical_count[layer]
        total, mean = int(counts.sum()), counts.mean()
        order = np.argsort(-counts, kind="stable")[: self.top]
        return [
            {"expert": int(e), "count": int(counts[e]), "share": counts[e] / total if total else 0.0, "load_ratio": counts[e] / mean if mean else 0.0}
            for e in order
        ]

    @functools.cached_property
    def ep_projection(self) -> list[ProjectionRow]:
        """Rank balance EP would give this load, per divisor ``R`` of ``E`` (:mod:`.projection`)."""
        return ep_projection(self.logical_count)

    def headline(self) -> list[str]:
        """The figures that mean something for this trace, one line each (each under 80 columns).

        Expert balance always; rank balance only when the trace has ``ep_size > 1``
        (with one rank every rank figure is 1 by definition).
        """
        num_experts = self.logical_count.shape[1]
        hot = balance.hot_expert_count(num_experts)
        if not self.logical_count.any():
            return ["no expert assignments recorded: no balance to report (was the recorder started?)"]
        lines = [
            f"expert imbalance {self.overall_expert_imbalance:.2f} (hottest/mean; "
            f"worst layer {float(self.expert_imbalance.max()):.2f})  mean CV {float(self.expert_cv.mean()):.2f}",
            f"hottest 10% ({hot} of {num_experts} experts) take {100 * self.overall_hot_expert_share:.1f}% "
            f"(even: {100 * hot / num_experts:.1f}%)",
            self._idle_line(),
        ]
        if self.ep_size > 1:
            lines.append(
                f"rank balance over {self.ep_size} EP ranks: balancedness {self.balancedness:.3f}  "
                f"max layer imbalance {float(self.layer_imbalance.max()):.2f}"
            )
        else:
            lines.append("rank balance: needs EP (one rank recorded); see the EP projection")
        return lines

    def _idle_line(self) -> str:
        """Experts that got no token, counted in the unit each count is in: (layer, expert) cells, and experts idle in every layer."""
        layers, num_experts = self.logical_count.shape
        idle_everywhere = int((self.logical_count.sum(axis=0) == 0).sum())
        return (f"idle (no token): {int(self.dead_experts.sum()):,} of {counted(layers * num_experts, '(layer, expert) cell')}; "
                f"{idle_everywhere:,} of {counted(num_experts, 'expert')} idle in every layer")

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        """The JSON document (``docs/analysis.md`` describes every field)."""
        a = self.attrs
        load = self.rank_load
        layers = []
        for i, layer in enumerate(self.layer_ids):
            layers.append(
                {
                    "layer": int(layer),
                    "assignments": int(self.logical_count[i].sum()),
                    "balancedness": float(self.layer_balancedness[i]),
                    "imbalance": float(self.layer_imbalance[i]),
                    "expert_imbalance": float(self.expert_imbalance[i]),
                    "expert_cv": float(self.expert_cv[i]),
                    "hot_expert_share": float(self.hot_expert_share[i]),
                    "entropy_ratio": float(self.entropy_ratio[i]),
                    "dead_experts": [int(e) for e in np.flatnonzero(self.logical_count[i] == 0)],
                    "hottest": self.hottest(i),
                    "rank_load": [int(x) for x in load[i]],
                }
            )
        rank_total = load.sum(axis=0)
        return {
            "schema": REPORT_SCHEMA,
            "schema_version": REPORT_SCHEMA_VERSION,
            "trace": {
                "path": str(self.path),
                **{k: a.get(k) for k in ("mode", "id_space", "model", "engine", "run_id", "rank", "world_size", "ep_size", "top_k", "num_logical_experts", "num_physical_experts", "num_layers")},
            },
            "layers": [int(x) for x in self.layer_ids],
            "pass_phase": self.pass_phase,
            "totals": {
                "passes": self.num_passes,
                "tokens": self.num_tokens,
                "assignments": int(self.logical_count.sum()),
                "invalid_ids": self.invalid_ids,
                "dropped": self.dropped,
            },
            "overall": {
                "balancedness": self.balancedness,
                "max_layer_imbalance": float(self.layer_imbalance.max()),
                "mean_entropy_ratio": float(self.entropy_ratio.mean()),
                "dead_experts": int(self.dead_experts.sum()),
                "expert_imbalance": self.overall_expert_imbalance,
                "max_layer_expert_imbalance": float(self.expert_imbalance.max()),
                "mean_expert_cv": float(self.expert_cv.mean()),
                "hot_expert_share": self.overall_hot_expert_share,
                "hot_experts": balance.hot_expert_count(self.logical_count.shape[1]),
                "rank_balance_needs_ep": self.ep_size == 1,
            },
            "headline": self.headline(),
            "expert_imbalance": [float(x) for x in self.expert_imbalance],
            "per_layer": layers,
            "ranks": {
                "ep_size": self.ep_size,
                "total_load": [int(x) for x in rank_total],
                "hottest_rank": int(np.argmax(rank_total)),
                "balancedness": balance.balancedness(rank_total[None, :]),
            },
            "coactivation": self._coactivation_dict(),
            "transitions": self._transitions_dict(),
            "ep_projection": [row.to_dict() for row in self.ep_projection],
            "drift": self.drift.to_dict() if self.drift is not None and len(self.drift) else None,
            "timing": self.timing,
            "notes": list(self.notes),
        }

    def _coactivation_dict(self) -> dict[str, object] | None:
        co = self.coactivation
        if co is None:
            return None
        return {
            "per_layer": [
                {"layer": int(layer), "tokens": int(co.routed_tokens[i]), "top_pairs": top_pairs(co.coactivation[i], co.expert_tokens[i], int(co.routed_tokens[i]), self.top)}
                for i, layer in enumerate(self.layer_ids)
            ]
        }

    def _transitions_dict(self) -> list[dict[str, object]] | None:
        co = self.coactivation
        if co is None:
            return None
        out = []
        for i in range(len(co.transitions)):
            mi = mutual_information_bits(co.transitions[i])
            num_experts = co.transitions.shape[1]
            out.append(
                {
                    "from_layer": int(self.layer_ids[i]),
                    "to_layer": int(self.layer_ids[i + 1]),
                    "mutual_information_bits": mi,
                    "normalized_mutual_information": mi / math.log2(num_experts) if num_experts > 1 else 0.0,
                    "top": top_transitions(co.transitions[i], self.top),
                }
            )
        return out


def default_window_size(trace: Trace, unit_count: int) -> int:
    passes = unit_count if trace.mode != "per_token" else int(trace.num_passes().max(initial=0))
    if trace.mode == "per_pass" and trace.attrs.get(Attr.RANK) == -1:
        passes = int(trace.num_passes().max(initial=0))
    return max(1, math.ceil(passes / DEFAULT_WINDOWS))


def analyze_trace(
    source: Trace | Path | str,
    *,
    layers: Sequence[int] | None = None,
    window: int | None = None,
    top: int = 5,
    progress: bool | None = False,
    chunk_passes: int = 1024,
    chunk_tokens: int = 32768,
    phase: str | None = None,
) -> AnalysisReport:
    """Analyse a trace in one streaming read.

    Args:
        source: a moetrace HDF5 trace (any mode): an open :class:`Trace` (read, left open:
            ``moetrace analyze`` opens the file once) or its path (opened and closed here).
        layers: model layer ids to analyse (default all).
        window: passes per drift window (default: about 20 windows).
        top: hottest experts / pairs / transitions listed per layer.
        progress: show a rich progress bar on stderr (``None``: when a terminal).
        chunk_passes, chunk_tokens: rows read at once (bound the memory).
        phase: analyse the passes of this pass phase only (``prefill``, ``decode``, ``mixed``,
            ``idle``, ``unknown``: :data:`moetrace.pass_phase.PASS_PHASES`); ``None``: every pass.

    Raises:
        TraceError: the file is not a readable trace, a layer is unknown, or the trace records
            no pass phases and ``phase`` asks for one.
        ValueError: ``window`` or ``top`` is not positive, or ``phase`` names no pass phase.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of passes, got {window}")
    if top < 1:
        raise ValueError(f"top must be positive, got {top}")
    if isinstance(source, Trace):
        return _analyze(source, layers, window, top, progress, chunk_passes, chunk_tokens, phase)
    with open_trace(source) as trace:
        return _analyze(trace, layers, window, top, progress, chunk_passes, chunk_tokens, phase)


def _analyze(trace: Trace, layers: Sequence[int] | None, window: int | None, top: int, progress: bool | None,
             chunk_passes: int, chunk_tokens: int, phase: str | None) -> AnalysisReport:
    index = select_layers(trace, layers)
    code = None if phase is None else phase_of(trace, phase)
    if code is None:
        physical = trace.physical_count()[index].astype(np.int64)
        logical = trace.logical_count()[index].astype(np.int64)
        num_passes, num_tokens = int(trace.num_passes().max(initial=0)), trace.tokens_served()
    else:
        every_layer = pass_phase_physical_count(trace)[code]
        physical = every_layer[index].astype(np.int64)
        logical = to_logical(every_layer, trace.physical_to_logical)[index].astype(np.int64)
        passes, tokens, _ = pass_phase_counts(trace)
        num_passes, num_tokens = int(passes[code]), int(tokens[code])
    drift, coactivation, notes = _stream(trace, index, window, progress, chunk_passes, chunk_tokens, physical, code)
    if code is not None:
        notes.append(f"pass phase {phase!r} only: {num_passes} passes; invalid ids, dropped copies and phase timing are over every pass")
    return AnalysisReport(
        path=trace.path,
        attrs=trace.attrs,
        layer_ids=np.asarray(trace.layers[index]),
        physical_count=physical,
        logical_count=logical,
        ep_size=trace.ep_size,
        num_passes=num_passes,
        num_tokens=num_tokens,
        pass_phase=None if code is None else PASS_PHASES[code],
        invalid_ids=int(trace.invalid_ids()[:, index].sum()),
        dropped=int(trace.dropped_tokens()[:, index].sum()),
        top=top,
        coactivation=coactivation,
        drift=drift if len(drift) else None,
        notes=notes,
        timing=analyze_timing(trace),
    )


def _stream(trace: Trace, index: np.ndarray, window: int | None, progress: bool | None, chunk_passes: int,
            chunk_tokens: int, physical: np.ndarray, phase: int | None = None) -> tuple[DriftSeries, CoactivationAccumulator | None, list[str]]:
    """The one read of the time-ordered data: the drift series, co-activation (``per_token``) and notes.

    ``index`` selects the analysed layers; ``physical`` is their ``[L, P]`` ``/stat`` totals,
    which the streamed rows must add up to; ``phase``: the pass phase code whose passes are read.
    """
    mapping = trace.physical_to_logical[index]
    notes: list[str] = []
    unit, records = count_records(trace)
    windows = WindowAccumulator(window or default_window_size(trace, records), mapping, trace.ep_size, trace.layers[index])
    coactivation = None
    with progress_bar(progress, records, f"analyzing {trace.path.name} ({unit})") as advance:
        if trace.mode == "per_token":
            coactivation = CoactivationAccumulator(mapping, index, trace.num_logical_experts)
            for chunk in trace.iter_tokens(chunk_tokens, counted_only=True, phase=phase):
                windows.add(token_pass_block(chunk, index, trace.num_physical_experts))
                coactivation.add(chunk.topk_ids)
                advance(len(chunk.pass_id))
        else:
            for block in iter_pass_blocks(trace, index, chunk_passes, phase):
                windows.add(block)
                advance(len(block.pass_id))
            notes.append("co-activation and cross-layer transitions need a per_token trace")
    drift = windows.finish()
    if trace.mode != "stat" and records and not np.array_equal(windows.total, physical):
        notes.append(f"/{'tokens' if trace.mode == 'per_token' else 'passes'} does not add up to /stat totals; the trace may have been edited or partly written")
    if not records:
        notes.append("no time-ordered data (empty window or stream): no drift series")
    return drift, coactivation, notes
