"""``moetrace placement``'s input: the loads of the selected layers, their time-ordered series, and the sizes to plan for."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moetrace.analysis.source import load_series, select_layers
from moetrace.ids import to_logical
from moetrace.placement.checks import PlacementConfig
from moetrace.placement.series import PassSeries
from moetrace.trace.pass_phases import pass_phase_physical_count, phase_of
from moetrace.trace.reader import open_trace
from moetrace.trace.schema import Attr, TraceDamageError, TraceError

from ..errors import CommandError
from ..options import existing_file

__all__ = ["Loads", "expert_bytes_of", "read_current", "read_loads", "sizes_of"]


def _sizes(num_experts: int, gpus: int, slots: int | None, groups: int | None, nodes: int | None) -> tuple[PlacementConfig, list[str]]:
    """Fill the defaults: ``--slots`` E rounded up to a multiple of K, ``--groups`` and ``--nodes`` 1."""
    used = []
    if slots is None:
        slots = math.ceil(num_experts / gpus) * gpus
        why = "the expert count" if slots == num_experts else f"the {num_experts} experts rounded up to a multiple of --gpus"
        used.append(f"--slots {slots} ({why})")
    if groups is None:
        groups = 1
        used.append("--groups 1")
    if nodes is None:
        nodes = 1
        used.append("--nodes 1")
    return PlacementConfig(slots, groups, nodes, gpus), used


def read_current(path: Path) -> np.ndarray:
    try:
        document = json.loads(existing_file(path, "plan").read_text())
        return np.asarray(document["phy2log"], dtype=np.int64)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CommandError(f"--current {path}: not a placement plan with a phy2log list (write one with `moetrace placement ... --out`): {exc}") from None


def expert_bytes_of(attrs: dict[str, Any], intermediate_size: int | None) -> int | None:
    """Bytes of one SwiGLU expert (gate, up, down: ``3·H·I·b``) from the trace's ``H`` and ``b``."""
    if intermediate_size is None:
        return None
    hidden = int(attrs.get(Attr.HIDDEN_SIZE) or 0)
    if hidden <= 0:
        raise CommandError("--intermediate-size needs the trace's hidden size, and this trace does not carry one (record with RecorderConfig(hidden_size=...))")
    return 3 * hidden * intermediate_size * int(attrs.get(Attr.DTYPE_BYTES) or 2)


def _series(tr: Any, index: np.ndarray, bucket: int | None, required: bool, phase: int | None = None) -> PassSeries | None:
    try:
        return load_series(tr, index, bucket, phase)
    except TraceDamageError:
        raise  # a damaged trace is never answered with the fallback plan
    except TraceError:
        if required:
            raise
        return None


def _many_series(traces: list[Path], layers: list[int] | None, bucket: int | None, scheduler: str | None) -> PassSeries:
    from moetrace.analysis.distributed import dask_client, pass_series

    files = [existing_file(t) for t in traces]
    if scheduler is None:
        return pass_series(files, layers=layers, bucket=bucket)
    with dask_client(scheduler) as client:
        return pass_series(files, layers=layers, bucket=bucket, client=client)


def sizes_of(gpus: int, slots: int | None, groups: int | None, nodes: int | None) -> Callable[[int], tuple[PlacementConfig, list[str]]]:
    """The sizes for ``E`` experts, once the trace says ``E`` (:func:`_sizes`)."""
    return lambda num_experts: _sizes(num_experts, gpus, slots, groups, nodes)


@dataclasses.dataclass
class Loads:
    """What the trace(s) give the planner: loads over the selected layers and, when time-ordered, their series."""

    layer_ids: list[int]
    num_model_layers: int  # the trace's highest layer id + 1 (SGLang's map has a row for each)
    weight: np.ndarray  # [L, E] logical loads
    physical: np.ndarray  # [L, P] the run's own physical counts
    attrs: dict[str, Any]
    config: PlacementConfig
    defaults: list[str]
    series: PassSeries | None


def read_loads(traces: list[Path], layers: list[int] | None, scheduler: str | None, bucket_of: Callable[[], int | None],
                sizes: Callable[[int], tuple[PlacementConfig, list[str]]], required: bool, phase: str | None = None) -> Loads:
    """Read the loads (after the sizes are checked against the trace's expert count, then the backtest bucket);
    ``phase``: the passes of one pass phase only (a prefill-only or decode-only plan)."""
    trace, many = traces[0], len(traces) > 1 or scheduler is not None
    with open_trace(existing_file(trace)) as tr:
        index = select_layers(tr, layers)
        layer_ids = [int(x) for x in tr.layers[index]]
        num_model_layers = int(np.max(tr.layers)) + 1
        code = None if phase is None else phase_of(tr, phase)
        if code is None:
            weight, physical = tr.logical_count()[index].astype(np.float64), tr.physical_count()[index]
        else:
            by_phase = pass_phase_physical_count(tr)[code]
            weight, physical = to_logical(by_phase, tr.physical_to_logical)[index].astype(np.float64), by_phase[index]
        attrs = tr.attrs
        config, defaults = sizes(weight.shape[1])
        bucket = bucket_of()
        series = None if many else _series(tr, index, bucket, required=required, phase=code)
    if many:  # one run's per-rank files / segments: their passes in time order (moetrace.analysis.distributed)
        series = _many_series(traces, layers, bucket, scheduler)
    if series is not None:  # plan and score on the time-ordered passes (a stat trace's window may be shorter than its totals)
        weight, physical = series.logical.sum(axis=0), series.physical.sum(axis=0)
    return Loads(layer_ids, num_model_layers, weight, physical, attrs, config, defaults, series)
