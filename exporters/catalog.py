"""The recorder's exported metrics, defined once for every exporter.

Each :class:`~moetrace.exporters.spec.MetricSpec` names a metric for Prometheus and for OpenTelemetry,
says what kind it is, which labels it carries and which
:class:`~moetrace.snapshot.RecorderSnapshot` field or property gives its value.
Values are never computed here: they come from the snapshot's properties,
which call :mod:`moetrace.balance` (the one definition of each
formula).

Label dimensions (``dims``) index the value array:

- ``()``: one value per process;
- ``("layer",)``: ``[L]``, labelled with the model layer id (``layer_ids[l]``);
- ``("pass_phase",)``: ``[Q]``, labelled with the pass phase name (``unknown``, ``prefill``, ``decode``,
  ``mixed``, ``idle``: :data:`moetrace.pass_phase.PASS_PHASES`, a bounded set). The label is
  ``pass_phase``, not ``phase``: ``phase`` is the timing histograms' label (route, dispatch, expert, combine);
- ``("layer", "ep_rank")``: ``[L, R]``, second axis is the EP rank;
- ``("layer", "expert")``: ``[L, E]``, second axis is the logical expert id; or, for the
  hottest-experts top-N, ``(layer index [N], expert [N], count [N])`` (only those cells).

Every sample also carries ``rank``: the EP rank of the process that recorded it.

Bounded by default: a rank process exports O(layers) series (what it knows
about itself) plus a fixed top-N of hot experts; the ``[layer, ep_rank]``
matrices (:data:`PER_EP_RANK`, option ``per_ep_rank``) and the ``[layer,
expert]`` counts (:data:`PER_EXPERT`, option ``per_expert``) are opt-in. The
fleet's view (per-layer balancedness over ranks, the straggler) is computed by
the Prometheus recording rules of :func:`rules_path`, over every rank's
``moetrace_layer_received_tokens_total``.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np

from moetrace.balance import HOT_EXPERTS
from moetrace.pass_phase import PASS_PHASES
from moetrace.snapshot import RecorderSnapshot

from .spec import MetricSpec, enabled

__all__ = ["ALL", "HISTOGRAMS", "INFO", "METRICS", "PER_EP_RANK", "PER_EXPERT", "histogram_samples", "info_labels",
           "markdown_table", "rules_path", "samples", "selected", "series_per_process"]


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_forward_passes_total", "moetrace.forward_passes", "counter", "{pass}", (),
               "Forward passes recorded since start_record.", "`num_passes`",
               lambda s: s.num_passes),
    MetricSpec("moetrace_tokens_total", "moetrace.tokens", "counter", "{token}", (),
               "Tokens recorded since start_record (sum of each pass's token count; 0 on a rank whose TP attention group "
               "peer counts the same tokens, so the sum over ranks counts each token once).", "`counted(num_tokens)`",
               lambda s: s.counted(s.num_tokens)),
    MetricSpec("moetrace_layer_routed_tokens_total", "moetrace.layer.routed_tokens", "counter", "{token}", ("layer",),
               "Token copies (token x top-k slot) routed to any expert of the layer.",
               "`counted(tokens_per_layer)`, tokens_per_layer = Σ_e count[l, e]", lambda s: s.counted(s.tokens_per_layer)),
    MetricSpec("moetrace_balancedness", "moetrace.balancedness", "gauge", "1", (),
               "Balancedness over EP ranks, all layers, Σ_l mean_r T / Σ_l max_r T (1 = perfect; "
               "always 1 with ep_size=1: rank balance needs EP, see moetrace_expert_imbalance).",
               "`balancedness` = Σ_l mean_r T[l,r] / Σ_l max_r T[l,r]", lambda s: s.balancedness),
    MetricSpec("moetrace_layer_balancedness", "moetrace.layer.balancedness", "gauge", "1", ("layer",),
               "Per-layer balancedness over EP ranks mean_r T / max_r T (1 = perfect; always 1 with ep_size=1).",
               "`layer_balancedness` = mean_r T[l,r] / max_r T[l,r]", lambda s: s.layer_balancedness),
    MetricSpec("moetrace_layer_imbalance", "moetrace.layer.imbalance", "gauge", "1", ("layer",),
               "Per-layer imbalance over EP ranks max_r T / mean_r T (1 = perfect; always 1 with ep_size=1).",
               "`layer_imbalance` = max_r T[l,r] / mean_r T[l,r]", lambda s: s.layer_imbalance),
    MetricSpec("moetrace_expert_imbalance", "moetrace.expert_imbalance", "gauge", "1", (),
               "Expert imbalance over all layers: hottest logical expert over the mean, load-weighted (1 = even; needs no EP).",
               "`overall_expert_imbalance` = Σ_l max_e count[l,e] / Σ_l mean_e count[l,e]",
               lambda s: s.overall_expert_imbalance),
    MetricSpec("moetrace_layer_expert_imbalance", "moetrace.layer.expert_imbalance", "gauge", "1", ("layer",),
               "Per-layer expert imbalance: hottest logical expert over the mean (1 = even; needs no EP).",
               "`expert_imbalance` = max_e count[l,e] / mean_e count[l,e]", lambda s: s.expert_imbalance),
    MetricSpec("moetrace_layer_expert_cv", "moetrace.layer.expert_cv", "gauge", "1", ("layer",),
               "Coefficient of variation of the load over logical experts (0 = even).",
               "`expert_cv` = std_e count[l,e] / mean_e count[l,e] (population std)", lambda s: s.expert_cv),
    MetricSpec("moetrace_layer_hot_expert_share", "moetrace.layer.hot_expert_share", "gauge", "1", ("layer",),
               "Share of the layer's token copies taken by its hottest 10% of logical experts (even load: ceil(E/10)/E).",
               "`hot_expert_share` = Σ of the ceil(E/10) largest count[l,e] / Σ_e count[l,e]",
               lambda s: s.hot_expert_share),
    MetricSpec("moetrace_layer_entropy_ratio", "moetrace.layer.entropy_ratio", "gauge", "1", ("layer",),
               "Routing entropy over logical experts divided by log(E) (1 = uniform).",
               "`entropy_ratio` = −Σ_e p log p / log E, p = count[l,e] / Σ_e count[l,e]",
               lambda s: s.entropy_ratio),
    MetricSpec("moetrace_layer_dead_experts", "moetrace.layer.dead_experts", "gauge", "{expert}", ("layer",),
               "Logical experts that received no token since start_record.",
               "`dead_experts` = #{e : count[l, e] = 0}", lambda s: s.dead_experts),
    MetricSpec("moetrace_invalid_ids_total", "moetrace.invalid_ids", "counter", "{id}", ("layer",),
               "Selected expert ids outside [0, P) other than the -1 padding id.", "`invalid_ids`",
               lambda s: s.invalid_ids),
    MetricSpec("moetrace_dropped_tokens_total", "moetrace.dropped_tokens", "counter", "{token}", ("layer",),
               "Token copies dropped over expert capacity (reported by on_dispatch).", "`dropped`",
               lambda s: s.dropped),
    MetricSpec("moetrace_dropped_passes_total", "moetrace.dropped_passes", "counter", "{pass}", (),
               "Streaming passes dropped whole because the trace writer was behind (on_overflow=\"drop\").",
               "`dropped_passes`", lambda s: s.dropped_passes),
    MetricSpec("moetrace_layer_sent_tokens_total", "moetrace.layer.sent_tokens", "counter", "{token}", ("layer",),
               "Token copies this rank's dispatch sent to all EP ranks, itself included (reported by on_dispatch).",
               "`layer_sent` = Σ_r send[l, r]", lambda s: s.send_count.sum(axis=1)),
    MetricSpec("moetrace_layer_received_tokens_total", "moetrace.layer.received_tokens", "counter", "{token}", ("layer",),
               "Token copies the experts of this rank received from all EP ranks, itself included: its expert load "
               "(reported by on_dispatch with recv_counts; the fleet rules read it).",
               "`layer_received` = Σ_s recv[l, s]", lambda s: s.recv_count.sum(axis=1)),
    MetricSpec("moetrace_hot_expert_routed_tokens", "moetrace.hot_expert.routed_tokens", "gauge", "{token}", ("layer", "expert"),
               f"Token copies this rank routed to each of its {HOT_EXPERTS} hottest (layer, logical expert) cells since "
               "start_record (a fixed top-N: the cells, so the series, change as the load moves).",
               f"`hot_experts` = the {HOT_EXPERTS} largest count[l, e]", lambda s: s.hot_experts),
    MetricSpec("moetrace_alltoall_ideal_bytes_total", "moetrace.alltoall.ideal_bytes", "counter", "By", ("layer",),
               "Ideal EP all-to-all volume, dispatch plus combine (0 when hidden_size is unknown).",
               "`alltoall_bytes_ideal` = 2·T·k·H·b, T = routed copies / k", lambda s: s.alltoall_bytes_ideal),
    MetricSpec("moetrace_alltoall_actual_bytes_total", "moetrace.alltoall.actual_bytes", "counter", "By", ("layer",),
               "Bytes this rank sent to other EP ranks, dispatch plus combine (0 when hidden_size is unknown).",
               "`alltoall_bytes_actual` = 2·(Σ_{r≠rank} send[l, r])·H·b", lambda s: s.alltoall_bytes_actual),
    MetricSpec("moetrace_pass_phase_passes_total", "moetrace.pass_phase.passes", "counter", "{pass}", ("pass_phase",),
               "Forward passes recorded per pass phase (what the engine's batch was: prefill, decode, mixed, idle; "
               "unknown when its adapter did not say).", "`pass_phase_num_passes`", lambda s: s.pass_phase_num_passes),
    MetricSpec("moetrace_pass_phase_tokens_total", "moetrace.pass_phase.tokens", "counter", "{token}", ("pass_phase",),
               "Tokens recorded per pass phase (0 on a TP replica rank, as moetrace_tokens_total).",
               "`counted(pass_phase_num_tokens)`", lambda s: s.counted(s.pass_phase_num_tokens)),
    MetricSpec("moetrace_pass_phase_requests_total", "moetrace.pass_phase.requests", "counter", "{request}", ("pass_phase",),
               "Requests per pass phase, summed over passes (a request in 10 decode passes counts 10; passes whose "
               "adapter gave no count add nothing).", "`counted(pass_phase_num_requests)`", lambda s: s.counted(s.pass_phase_num_requests)),
    MetricSpec("moetrace_pass_phase_balancedness", "moetrace.pass_phase.balancedness", "gauge", "1", ("pass_phase",),
               "Balancedness over EP ranks of the load of one pass phase, all layers (1 = perfect; 1 with no load or ep_size=1).",
               "`pass_phase_balancedness[q]` = balancedness of pass_phase_physical_count[q]", lambda s: s.pass_phase_balancedness),
    MetricSpec("moetrace_pass_phase_expert_imbalance", "moetrace.pass_phase.expert_imbalance", "gauge", "1", ("pass_phase",),
               "Expert imbalance of the load of one pass phase, all layers: hottest logical expert over the mean, "
               "load-weighted (1 = even; needs no EP).",
               "`pass_phase_expert_imbalance[q]` = overall_expert_imbalance of pass_phase_logical_count[q]",
               lambda s: s.pass_phase_expert_imbalance),
    MetricSpec("moetrace_recording", "moetrace.recording", "gauge", "1", (),
               "1 while the recorder counts, 0 when stopped.", "`recording`",
               lambda s: int(s.recording)),
    MetricSpec("moetrace_snapshot_timestamp_seconds", "moetrace.snapshot.timestamp", "gauge", "s", (),
               "Unix time of the pass end whose totals the other metrics show.", "`timestamp`",
               lambda s: s.timestamp),
    MetricSpec("moetrace_peak_memory_bytes", "moetrace.peak_memory", "gauge", "By", (),
               "Largest per-pass peak of device memory allocated (CUDA, timing=True); NaN on CPU or without timing.",
               "`peak_memory_bytes`", lambda s: s.peak_memory_bytes),
    MetricSpec("moetrace_errors", "moetrace.errors", "gauge", "{error}", (),
               "Background errors the recorder holds (e.g. a failed streaming write); see GET /status.",
               "`len(errors)`", lambda s: len(s.errors)),
    MetricSpec("moetrace_retention_removed_files_total", "moetrace.retention.removed_files", "counter", "{file}", (),
               "Dumps the retention policy removed from output_dir (0 without a policy).",
               "`retention['removed_files']`", lambda s: _retention(s, "removed_files")),
    MetricSpec("moetrace_retention_removed_bytes_total", "moetrace.retention.removed_bytes", "counter", "By", (),
               "Bytes of the dumps the retention policy removed (0 without a policy).",
               "`retention['removed_bytes']`", lambda s: _retention(s, "removed_bytes")),
    MetricSpec("moetrace_retention_compacted_files_total", "moetrace.retention.compacted_files", "counter", "{file}", (),
               "Streaming dumps the retention policy compacted to their stat totals (0 without a policy).",
               "`retention['compacted_files']`", lambda s: _retention(s, "compacted_files")),
    MetricSpec("moetrace_retention_directory_bytes", "moetrace.retention.directory_bytes", "gauge", "By", (),
               "Bytes of moetrace files in output_dir after the last retention pass (0 without a policy).",
               "`retention['directory_bytes']`", lambda s: _retention(s, "directory_bytes")),
)
"""Metrics every exporter emits."""


PER_EP_RANK: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_rank_routed_tokens_total", "moetrace.rank.routed_tokens", "counter", "{token}", ("layer", "ep_rank"),
               "Token copies routed to the experts hosted by EP rank ep_rank (load T[l, r]).",
               "`counted(rank_load)`, T[l, r] = Σ_{p on r} physical_count[l, p]; rank r hosts p ∈ [r·P/R, (r+1)·P/R)", lambda s: s.counted(s.rank_load), opt_in="per_ep_rank"),
    MetricSpec("moetrace_dispatch_sent_tokens_total", "moetrace.dispatch.sent_tokens", "counter", "{token}", ("layer", "ep_rank"),
               "Token copies this rank sent to EP rank ep_rank (reported by on_dispatch).", "`send_count`",
               lambda s: s.send_count, opt_in="per_ep_rank"),
    MetricSpec("moetrace_dispatch_received_tokens_total", "moetrace.dispatch.received_tokens", "counter", "{token}", ("layer", "ep_rank"),
               "Token copies this rank received from EP rank ep_rank (reported by on_dispatch).", "`recv_count`",
               lambda s: s.recv_count, opt_in="per_ep_rank"),
)
"""The ``[layer, ep_rank]`` matrices, only with ``per_ep_rank=True``: L x R series each (4,176 at DeepSeek-V3's
58 layers x EP72); a fleet reads their sums from the rules instead."""


def _retention(s: RecorderSnapshot, key: str) -> int:
    return int(s.retention[key]) if s.retention is not None else 0  # type: ignore[call-overload]


def _phase_hist(s: RecorderSnapshot) -> tuple[np.ndarray, np.ndarray]:
    return s.phase_histogram, s.phase_seconds_sum


def _step_hist(s: RecorderSnapshot) -> tuple[np.ndarray, np.ndarray]:
    if s.timing is None:
        return np.zeros((0, 0), dtype=np.int64), np.zeros(0)
    return s.timing["step_histogram"][None, :], np.array([s.step_seconds_sum])


HISTOGRAMS: tuple[MetricSpec, ...] = (
    MetricSpec("moetrace_phase_seconds", "moetrace.phase", "histogram", "s", ("phase",),
               "Per-pass time of one MoE phase in one layer (route, dispatch, expert, combine), all layers pooled; timing=True only.",
               "`phase_histogram` [F, B], `phase_seconds_sum` [F]", _phase_hist),
    MetricSpec("moetrace_step_seconds", "moetrace.step", "histogram", "s", (),
               "Time of one recorded forward pass on this rank (host wall on CPU, device time on CUDA); timing=True only.",
               "`timing['step_histogram']`, `step_seconds_sum`", _step_hist),
)
"""Histograms of phase timing (series only when the recorder times phases). ``value``: ``snapshot -> (fine-bucket
counts [S, B], sums [S])`` with ``S`` series (one per phase, or one), buckets of ``moetrace.timing.HISTOGRAM_EDGES``;
OpenTelemetry gets ``<otel_name>.time`` and ``<otel_name>.count`` counters instead of buckets."""

PER_EXPERT = MetricSpec(
    "moetrace_expert_routed_tokens_total", "moetrace.expert.routed_tokens", "counter", "{token}", ("layer", "expert"),
    "Token copies routed to each logical expert (only with per_expert=True: L x E series).",
    "`counted(logical_count[l, e])`", lambda s: s.counted(s.logical_count), opt_in="per_expert",
)
"""The per-expert metric, emitted only when asked (layers x experts series)."""

INFO = MetricSpec(
    "moetrace_info", "moetrace.info", "info", "1",
    ("model", "engine", "mode", "id_space", "ep_size", "layout", "global_rank", "tp_rank", "dp_rank", "pp_rank", "replica"),
    "Recorder description: model, engine, mode, id space, EP size, the parallel layout and this rank's "
    "coordinates in it; replica=\"true\" when its token counters read 0 because a TP peer counts them (value is always 1).",
    "constant 1", lambda s: info_labels(s),
)
"""The constant-1 metric whose labels describe the recorder."""

ALL: tuple[MetricSpec, ...] = (*METRICS, *PER_EP_RANK, PER_EXPERT)
"""Every counter and gauge, default and opt-in (histograms and info apart)."""


def selected(per_expert: bool = False, per_ep_rank: bool = False) -> tuple[MetricSpec, ...]:
    """The counters and gauges an exporter emits: :data:`METRICS` plus the opt-in families asked for."""
    return enabled(ALL, per_expert=per_expert, per_ep_rank=per_ep_rank)


def series_per_process(num_layers: int, ep_size: int, num_experts: int, per_expert: bool = False,
                       per_ep_rank: bool = False) -> int:
    """Series one rank process exports without timing (info included): the formula of ``docs/observability.md``.

    Default ``S + F·Q + D·L + N`` (``S`` per-process series, ``F`` per-pass-phase metrics over the
    ``Q`` pass phases, ``D`` per-layer metrics, ``N`` hot experts); ``per_ep_rank`` adds ``3·L·R``,
    ``per_expert`` adds ``L·E``.
    """
    sizes = {(): 1, ("pass_phase",): len(PASS_PHASES), ("layer",): num_layers, ("layer", "ep_rank"): num_layers * ep_size,
             ("layer", "expert"): num_layers * num_experts}
    total = 1  # moetrace_info
    for spec in selected(per_expert, per_ep_rank):
        total += min(HOT_EXPERTS, num_layers * num_experts) if spec.kind == "gauge" and spec.dims == ("layer", "expert") \
            else sizes[spec.dims]
    return total


def rules_path() -> Path:
    """The Prometheus recording rules for the fleet view (``moetrace/data/prometheus/moetrace-fleet.rules.yml``)."""
    return Path(str(resources.files("moetrace.data") / "prometheus" / "moetrace-fleet.rules.yml"))


def _label_values(dim: str, index: np.ndarray, layer_ids: np.ndarray) -> list[int] | list[str]:
    if dim == "pass_phase":
        return [PASS_PHASES[int(v)] for v in index]
    return [int(v) for v in (layer_ids[index] if dim == "layer" else index)]


def samples(spec: MetricSpec, snap: RecorderSnapshot) -> Iterator[tuple[dict[str, int | str], float | int]]:
    """``(labels, value)`` for each series of ``spec`` in ``snap``; labels are ints (pass phases: names), ``rank`` first."""
    value = spec.value(snap)
    if not spec.dims:
        yield {"rank": snap.rank}, value  # type: ignore[misc]
        return
    if isinstance(value, tuple):  # sparse cells: (index per dim ..., values)
        *index, array = value
    else:
        array = np.asarray(value)
        if array.ndim != len(spec.dims):
            raise ValueError(f"{spec.prom_name}: value has shape {array.shape}, expected dims {spec.dims}")
        index = [axis.reshape(-1) for axis in np.indices(array.shape)]
        array = array.reshape(-1)
    columns = [_label_values(dim, np.asarray(i), snap.layer_ids) for dim, i in zip(spec.dims, index, strict=True)]
    items = array.tolist()  # Python ints for integer arrays, floats otherwise
    for n, item in enumerate(items):
        labels: dict[str, int | str] = {"rank": snap.rank}
        for dim, column in zip(spec.dims, columns, strict=True):
            labels[dim] = column[n]
        yield labels, item


def histogram_samples(spec: MetricSpec, snap: RecorderSnapshot) -> Iterator[tuple[dict[str, object], np.ndarray, int, float]]:
    """``(labels, cumulative counts at EXPORT_EDGES, count, sum)`` per series; nothing without timing."""
    from moetrace.timing import PHASES, cumulative_buckets

    fine, sums = spec.value(snap)
    for i in range(fine.shape[0]):
        labels: dict[str, object] = {"rank": snap.rank}
        if spec.dims:
            labels["phase"] = PHASES[i]
        yield labels, cumulative_buckets(fine[i]), int(fine[i].sum()), float(sums[i])


def info_labels(snap: RecorderSnapshot) -> dict[str, str]:
    """Label values of the info metric (plus ``rank``)."""
    layout = snap.rank_layout
    coords = {"layout": layout.describe(), "global_rank": str(layout.rank), "tp_rank": str(layout.tp_rank),
              "dp_rank": str(layout.dp_rank), "pp_rank": str(layout.pp_rank)} if layout is not None else \
        {"layout": "", "global_rank": "", "tp_rank": "", "dp_rank": "", "pp_rank": ""}
    return {"rank": str(snap.rank), "model": snap.model, "engine": snap.engine, "mode": snap.mode,
            "id_space": snap.id_space, "ep_size": str(snap.ep_size), **coords, "replica": str(snap.replicates_tokens).lower()}


def markdown_table() -> str:
    """The metric reference table of ``docs/observability.md``, generated from this catalog."""
    rows = ["| Prometheus | OpenTelemetry | kind | unit | labels | meaning | formula (`RecorderSnapshot`) |",
            "|---|---|---|---|---|---|---|"]
    for spec in (*ALL, *HISTOGRAMS, INFO):
        labels = ", ".join(("rank", *spec.dims))
        kind = {"histogram": "histogram", "info": "gauge (info)"}.get(spec.kind, spec.kind)
        otel = f"`{spec.otel_name}.time`, `{spec.otel_name}.count`" if spec.kind == "histogram" else f"`{spec.otel_name}`"
        opt = f" Opt-in: `{spec.opt_in}=True`." if spec.opt_in else ""
        rows.append(f"| `{spec.prom_name}` | {otel} | {kind} | `{spec.unit}` | {labels} | {spec.help}{opt} | {spec.formula} |")
    return "\n".join(rows) + "\n"
