"""Analysis across the recordings of one deployment: a time series of runs.

A long-running server is many recordings: it restarts, operators (or EPLB's
schedule) start and stop its recorder, it dumps every N minutes. Each
recording has its own ``run_id``, rank layout and physical expert map. This
module reads any number of them as one series, ordered by wall-clock time:

- a *recording* is one dump of one run: the input files that share a
  ``run_id`` (one gathered file, or the per-rank files of one dump; a run
  that dumped several times gives one recording per dump), summarised
  by :func:`summarise_recording` with exactly the figures ``moetrace
  analyze`` gives for it alone;
- the series compares recordings in **logical** expert space, so an EPLB
  remap (another ``physical_to_logical``, redundant slots, another EP size)
  between two recordings changes their rank figures but not the comparison;
- recordings of different models, layer sets, expert counts or top-k are
  refused, naming the file and the attribute.

Memory is bounded by the summary: a recording is reduced to ``[L, E]``
logical counts, ``[L, R]`` rank loads and a few scalars where it is read
(in this process, or on a Dask worker with ``client=``), never held whole.
``moetrace merge`` stays the tool that joins the ranks of one run into one
file; this module never joins files, it lines recordings up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import balance
from ..trace.reader import open_trace
from ..trace.schema import COMPACTED_FROM_ATTR, Attr, TraceError

__all__ = [
    "DEPLOYMENT_SCHEMA",
    "DeploymentReport",
    "RecordingSummary",
    "analyze_deployment",
    "group_recordings",
    "summarise_recording",
]

DEPLOYMENT_SCHEMA = "moetrace-deployment"
"""``schema`` field of the JSON document (:meth:`DeploymentReport.to_dict`)."""

#: Attributes every recording of one deployment must share (what the model is).
SAME_MODEL_ATTRS = ("model", "num_layers", "num_logical_experts", "top_k")
SECONDS_PER_HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class RecordingSummary:
    """One recording reduced to what the series needs (small: ``O(L·E)``).

    Attributes:
        run_id: the recording's run id.
        paths: its input files.
        created_unix: when it was written (earliest ``created_unix`` of its files).
        mode, engine: as in the trace.
        ep_size: EP ranks ``R`` of its own layout.
        num_physical_experts: physical slots ``P`` of its own map.
        layer_ids: ``[L]`` model layer ids.
        logical_count: ``[L, E]`` token copies per logical expert.
        rank_load: ``[L, R]`` token copies per EP rank, through its own map.
        num_passes, num_tokens, dropped_passes, invalid_ids, dropped: totals.
        slowest_rank: the rank that was slowest most often (``None`` without timing).
        slowest_rank_share: the share of passes it was slowest in.
        wait_share: share of step time fast ranks waited for the slowest.
        physical_to_logical_digest: a hash of its physical map (a change marks a remap).
    """

    run_id: str
    paths: tuple[str, ...]
    created_unix: float
    mode: str
    engine: str
    ep_size: int
    num_physical_experts: int
    layer_ids: np.ndarray
    logical_count: np.ndarray
    rank_load: np.ndarray
    num_passes: int
    num_tokens: int
    dropped_passes: int
    invalid_ids: int
    dropped: int
    slowest_rank: int | None
    slowest_rank_share: float | None
    wait_share: float | None
    physical_to_logical_digest: str
    model_attrs: dict[str, Any]

    @property
    def balancedness(self) -> float | None:
        """Rank balancedness of this recording's own layout (``None`` with one rank)."""
        return balance.balancedness(self.rank_load) if self.ep_size > 1 else None

    @property
    def expert_imbalance(self) -> float:
        """Hottest over mean logical expert, all layers (:func:`moetrace.balance.overall_expert_imbalance`)."""
        return balance.overall_expert_imbalance(self.logical_count)

    def hottest(self, top: int) -> list[dict[str, Any]]:
        """The ``top`` busiest ``(layer, logical expert)`` cells, with their load over the layer mean."""
        return _hottest(self.logical_count, self.layer_ids, top)

    def to_dict(self, top: int) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "paths": list(self.paths), "created_unix": self.created_unix,
            "mode": self.mode, "engine": self.engine, "ep_size": self.ep_size,
            "num_physical_experts": self.num_physical_experts, "passes": self.num_passes,
            "tokens": self.num_tokens, "assignments": int(self.logical_count.sum()),
            "dropped_passes": self.dropped_passes, "invalid_ids": self.invalid_ids, "dropped": self.dropped,
            "balancedness": self.balancedness, "expert_imbalance": self.expert_imbalance,
            "hottest": self.hottest(top), "slowest_rank": self.slowest_rank,
            "slowest_rank_share": self.slowest_rank_share, "wait_share": self.wait_share,
            "physical_map": self.physical_to_logical_digest,
        }


def _hottest(logical: np.ndarray, layer_ids: np.ndarray, top: int) -> list[dict[str, Any]]:
    mean = logical.mean(axis=1, keepdims=True)
    ratio = np.divide(logical, mean, out=np.zeros(logical.shape, dtype=np.float64), where=mean > 0)
    order = np.argsort(-ratio, axis=None, kind="stable")[:top]
    cells = [np.unravel_index(i, logical.shape) for i in order]
    return [{"layer": int(layer_ids[i]), "expert": int(e), "count": int(logical[i, e]), "load_ratio": float(ratio[i, e])}
            for i, e in cells if logical[i, e] > 0]


def _digest(mapping: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(mapping, dtype=np.int32).tobytes()).hexdigest()[:12]


def group_recordings(paths: Sequence[Path | str]) -> list[list[Path]]:
    """Group input files into recordings, each sorted by path, recordings in wall-clock order.

    A recording is one dump of one run: the files of one ``run_id`` (its ranks'
    files), and when a run dumped several times (streaming dumps hold the
    passes since the previous one), each rank's ``i``-th dump, by
    ``created_unix``, belongs to recording ``i`` of that run.

    Raises:
        TraceError: a file is not a readable trace, is given twice, recordings
            are of different models (the message names the file and the
            attribute), or a run has several cumulative ``stat`` dumps of one rank.
    """
    if not paths:
        raise TraceError("no traces to analyse")
    by_rank: dict[tuple[str, int], list[tuple[float, Path, dict[str, Any]]]] = {}
    first: tuple[Path, dict[str, Any], np.ndarray] | None = None
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.resolve() in seen:
            raise TraceError(f"{path}: given twice")
        seen.add(path.resolve())
        with open_trace(path) as trace:
            attrs = dict(trace.attrs)
            layers = np.asarray(trace.layers)
        if first is None:
            first = (path, attrs, layers)
        else:
            _check_same_model(path, attrs, layers, *first)
        by_rank.setdefault((str(attrs[Attr.RUN_ID]), int(attrs[Attr.RANK])), []).append((float(attrs.get(Attr.CREATED_UNIX, 0.0)), path, attrs))
    groups: dict[tuple[str, int], list[Path]] = {}
    created: dict[tuple[str, int], float] = {}
    for (run, rank), dumps in by_rank.items():
        dumps.sort(key=lambda d: (d[0], str(d[1])))
        cumulative = [d[1] for d in dumps if d[2]["mode"] == "stat" and COMPACTED_FROM_ATTR not in d[2]]
        if len(dumps) > 1 and cumulative:
            raise TraceError(f"{cumulative[0]}: run {run} rank {rank} has {len(dumps)} dumps and stat dumps are cumulative "
                             "(every pass since start_record); give only its last stat dump, or record per_pass")
        for i, (when, path, _) in enumerate(dumps):
            groups.setdefault((run, i), []).append(path)
            created[(run, i)] = min(created.get((run, i), math.inf), when)
    order = sorted(groups, key=lambda g: (created[g], g))
    return [sorted(groups[g], key=str) for g in order]


def _check_same_model(path: Path, attrs: dict[str, Any], layers: np.ndarray, first_path: Path, first: dict[str, Any], first_layers: np.ndarray) -> None:
    for key in SAME_MODEL_ATTRS:
        if attrs.get(key) != first.get(key):
            raise TraceError(f"{path}: {key}={attrs.get(key)!r} differs from {first_path}'s {first.get(key)!r}; "
                             "recordings of different models cannot form one series (analyse each deployment on its own)")
    if not np.array_equal(layers, first_layers):
        raise TraceError(f"{path}: MoE layers {[int(x) for x in layers]} differ from {first_path}'s {[int(x) for x in first_layers]}; "
                         "recordings of different layer sets cannot form one series")


def summarise_recording(paths: Sequence[Path | str], layers: Sequence[int] | None = None) -> RecordingSummary:
    """The summary of one recording: the figures ``moetrace analyze`` gives for its files alone.

    Runs wherever it is called (a Dask worker included) and returns only the summary.

    Raises:
        TraceError: the files are not one run, or a file is unreadable.
    """
    from .distributed import analyze_traces
    from .summary import analyze_trace

    files = [Path(p) for p in paths]
    report = analyze_trace(files[0], layers=layers) if len(files) == 1 else analyze_traces(files, layers=layers)
    created, dropped_passes = math.inf, 0
    for path in files:
        with open_trace(path) as trace:
            created = min(created, float(trace.attrs.get(Attr.CREATED_UNIX, 0.0)))
            dropped_passes += int(np.asarray(trace.dropped_passes()).sum())
            mapping = np.asarray(trace.physical_to_logical)
    timing = report.timing or {}
    shares = timing.get("slowest_rank_share")
    slowest = int(np.argmax(shares)) if shares else None
    attrs = report.attrs
    return RecordingSummary(
        run_id=str(attrs[Attr.RUN_ID]), paths=tuple(str(p) for p in files), created_unix=created,
        mode=str(attrs[Attr.MODE]), engine=str(attrs.get(Attr.ENGINE, "")), ep_size=report.ep_size,
        num_physical_experts=int(attrs[Attr.NUM_PHYSICAL_EXPERTS]), layer_ids=np.asarray(report.layer_ids),
        logical_count=np.asarray(report.logical_count, dtype=np.int64), rank_load=np.asarray(report.rank_load, dtype=np.int64),
        num_passes=int(report.num_passes), num_tokens=int(report.num_tokens), dropped_passes=dropped_passes,
        invalid_ids=int(report.invalid_ids), dropped=int(report.dropped),
        slowest_rank=slowest, slowest_rank_share=None if slowest is None else float(shares[slowest]),
        wait_share=timing.get("wait_share"), physical_to_logical_digest=_digest(mapping),
        model_attrs={k: attrs.get(k) for k in SAME_MODEL_ATTRS},
    )


@dataclasses.dataclass
class DeploymentReport:
    """Recordings of one deployment in wall-clock order, with per-hour and whole-span figures.

    Attributes:
        recordings: one :class:`RecordingSummary` per run, oldest first.
        top: hottest cells listed per recording, hour and span.
    """

    recordings: list[RecordingSummary]
    top: int = 5

    @property
    def layer_ids(self) -> np.ndarray:
        return self.recordings[0].layer_ids

    @property
    def logical_count(self) -> np.ndarray:
        """``[L, E]`` logical copies over the whole span."""
        return np.sum([r.logical_count for r in self.recordings], axis=0)

    def drift(self) -> list[float]:
        """Mean over layers of the JS divergence between each recording and the next (``len - 1`` values)."""
        rs = self.recordings
        return [float(balance.js_divergence(a.logical_count, b.logical_count).mean()) for a, b in itertools.pairwise(rs)]

    def remaps(self) -> list[int]:
        """Indices ``i`` where recording ``i`` has another physical map or EP size than ``i - 1``."""
        rs = self.recordings
        return [i for i in range(1, len(rs))
                if (rs[i].physical_to_logical_digest, rs[i].ep_size) != (rs[i - 1].physical_to_logical_digest, rs[i - 1].ep_size)]

    def hours(self) -> list[dict[str, Any]]:
        """Per wall-clock hour (``floor(created_unix / 3600)``): summed counts and their balance."""
        buckets: dict[int, list[RecordingSummary]] = {}
        for r in self.recordings:
            buckets.setdefault(int(r.created_unix // SECONDS_PER_HOUR), []).append(r)
        return [self._span_dict(members, hour_unix=hour * SECONDS_PER_HOUR) for hour, members in sorted(buckets.items())]

    def _span_dict(self, members: list[RecordingSummary], **extra: Any) -> dict[str, Any]:
        logical = np.sum([r.logical_count for r in members], axis=0)
        sizes = {r.ep_size for r in members}
        balancedness = None
        if len(sizes) == 1 and sizes != {1}:  # one layout size: the rank loads add up
            balancedness = balance.balancedness(np.sum([r.rank_load for r in members], axis=0))
        slow = [r.slowest_rank for r in members if r.slowest_rank is not None]
        return {
            **extra,
            "recordings": len(members),
            "passes": sum(r.num_passes for r in members),
            "tokens": sum(r.num_tokens for r in members),
            "assignments": int(logical.sum()),
            "dropped_passes": sum(r.dropped_passes for r in members),
            "balancedness": balancedness,
            "balancedness_min": min((r.balancedness for r in members if r.balancedness is not None), default=None),
            "expert_imbalance": balance.overall_expert_imbalance(logical),
            "hottest": _hottest(logical, self.layer_ids, self.top),
            "slowest_rank_recordings": {str(k): slow.count(k) for k in sorted(set(slow))},
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (``docs/analysis.md``, "Across recordings")."""
        drift = self.drift()
        span = self._span_dict(
            self.recordings,
            start_unix=self.recordings[0].created_unix, end_unix=self.recordings[-1].created_unix,
            remaps=self.remaps(),
            drift_mean=float(np.mean(drift)) if drift else None, drift_max=float(np.max(drift)) if drift else None,
        )
        return {
            "schema": DEPLOYMENT_SCHEMA,
            "schema_version": 1,
            "model": self.recordings[0].model_attrs,
            "layers": [int(x) for x in self.layer_ids],
            "span": span,
            "recordings": [r.to_dict(self.top) for r in self.recordings],
            "drift_between_recordings": drift,
            "hours": self.hours(),
        }


def analyze_deployment(paths: Sequence[Path | str], *, layers: Sequence[int] | None = None, top: int = 5, client: Any = None) -> DeploymentReport:
    """The recordings among ``paths`` as one series (see the module docstring).

    Args:
        paths: trace files of any number of recordings (runs) of one model.
        layers: model layer ids to analyse (default: all).
        top: hottest cells listed per recording, hour and span.
        client: a ``distributed.Client``: each recording is summarised on its cluster.

    Raises:
        TraceError: unreadable inputs, recordings of different models, or files
            that claim one run but do not form one.
        ValueError: ``top`` is not positive.
    """
    if top < 1:
        raise ValueError(f"top must be positive, got {top}")
    groups = group_recordings(paths)
    if client is None:
        summaries = [summarise_recording(g, layers) for g in groups]
    else:
        futures = client.map(summarise_recording, [[str(p.resolve()) for p in g] for g in groups], layers=layers, pure=False)
        summaries = client.gather(futures)
    summaries.sort(key=lambda s: (s.created_unix, s.run_id))
    return DeploymentReport(summaries, top)
