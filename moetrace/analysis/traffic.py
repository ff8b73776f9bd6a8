"""Who sends to whom: the all-to-all of an expert-parallel run as rank x rank and node x node matrices.

A token copy goes from its **source**, the rank that routed the token (its attention rank
under DP attention: the counted rank row of its token group), to its **destination**, the
EP rank that holds the physical slot it was routed to (rank ``r`` holds slots
``[r·P/R, (r+1)·P/R)``). Ranks ``[n·G, (n+1)·G)`` form node ``n`` (``G`` GPUs per node).

- ``stat`` and ``per_pass`` traces from every rank give the rank matrix exactly: each
  rank's per-slot counts (``/stat/physical_count``, or its passes of one pass phase)
  summed over the slots each rank holds.
- ``per_token`` traces give it from the tokens' ids, and also **nodes per token**: how
  many distinct nodes (and remote nodes) each token's top-k reaches, and the node
  de-duplicated matrix (one copy per token per destination node: what DeepEP's normal
  kernels send over RDMA before forwarding inside the node over NVLink).

What-if: with another placement ``phy2log [L, N]`` the recorded routes are re-projected:
per-slot counts are folded to logical experts and split evenly over the plan's replicas
(:func:`moetrace.placement.plan.replica_load`); token rows pick a replica as SGLang's
rank-invariant dispatch does (:func:`moetrace.placement.sglang_plan.sglang_slots`).

Memory: one rank row's ``[L, P]`` counts or one chunk of token rows at a time, plus the
``[L, R, R]`` result; never ranks x passes. Bytes follow seed 002's formulas
(:func:`moetrace.dispatch.exchanged_bytes`: dispatch plus combine, ``2·copies·H·b``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..balance import rank_load
from ..dispatch import exchanged_bytes, node_copies
from ..ids import to_logical
from ..layout import RankLayout, counted_rows
from ..placement.plan import replica_load
from ..placement.sglang_plan import sglang_slots
from ..trace.pass_phases import phase_of
from ..trace.reader import Trace, open_trace
from ..trace.schema import Attr, TraceError
from .source import iter_pass_blocks, select_layers

__all__ = [
    "HOTTEST_LINKS",
    "Fabric",
    "Traffic",
    "TrafficCounter",
    "hottest_links",
    "inter_node_share",
    "node_matrix",
    "plan_inter_node_share",
    "trace_traffic",
]

#: Links listed by :meth:`Traffic.to_dict` (``hottest_links``).
HOTTEST_LINKS = 10

#: Ids of one per-token chunk's ``[tokens, L, k]`` read at once (1 Mi: 2,259 DeepSeek-V3 tokens, 4 MiB as int32).
TOKEN_CHUNK_CELLS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fabric:
    """``ranks`` EP ranks, ``gpus_per_node`` to a node, ``num_slots`` physical slots split evenly over the ranks.

    Raises:
        ValueError: ``gpus_per_node`` does not divide ``ranks`` or ``ranks`` does not divide ``num_slots``.
    """

    ranks: int
    gpus_per_node: int
    num_slots: int

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.ranks % self.gpus_per_node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must divide the {self.ranks} EP ranks; pass the GPUs each node holds")
        if self.num_slots % self.ranks:
            raise ValueError(f"{self.num_slots} physical slots do not split evenly over {self.ranks} EP ranks")

    @property
    def nodes(self) -> int:
        return self.ranks // self.gpus_per_node

    def rank_of_slot(self, slots: np.ndarray) -> np.ndarray:
        """EP rank holding each slot (same shape; ``-1`` stays ``-1``)."""
        slots = np.asarray(slots)
        return np.where(slots >= 0, slots // (self.num_slots // self.ranks), -1)


def node_matrix(rank_tokens: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """``[..., R, R]`` rank-pair copies -> ``[..., N, N]`` node-pair copies (``N = R / G``)."""
    return node_copies(node_copies(rank_tokens, gpus_per_node, axis=-1), gpus_per_node, axis=-2)


def inter_node_share(node_tokens: np.ndarray) -> float | None:
    """Off-diagonal copies / all copies of a ``[N, N]`` node matrix (``None`` when it holds none)."""
    total = float(node_tokens.sum())
    return None if total == 0 else (total - float(np.trace(node_tokens))) / total


def hottest_links(matrix: np.ndarray, count: int = HOTTEST_LINKS) -> list[dict[str, float | int]]:
    """The ``count`` largest off-diagonal cells of ``[X, X]`` as ``{"source", "destination", "tokens"}``, largest first
    (ties by source, then destination); cells holding nothing are left out."""
    off = np.array(matrix, dtype=np.float64)
    np.fill_diagonal(off, 0.0)
    flat = off.ravel()
    order = np.lexsort((np.arange(flat.size), -flat))[:count]
    size = off.shape[0]
    return [{"source": int(i // size), "destination": int(i % size), "tokens": _number(flat[i])} for i in order if flat[i] > 0]


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else float(value)


def _numbers(array: np.ndarray) -> list:
    """A JSON list of ``array``: integers where every value is whole (exact counts), floats otherwise (a what-if split)."""
    whole = np.all(np.mod(array, 1) == 0)
    return (array.astype(np.int64) if whole else array.astype(np.float64)).tolist()


class TrafficCounter:
    """Additive accumulator of the traffic of ``num_layers`` layers over a :class:`Fabric`.

    Attributes:
        rank_tokens: ``[L, R, R]`` copies from source rank to destination rank (float64: a what-if
            splits an expert's copies over its replicas).
        node_reach: ``[L, N, N]`` tokens of a source node that reach at least one slot on a
            destination node (token rows only).
        nodes_per_token, remote_nodes_per_token: ``[L, N + 1]`` tokens by distinct nodes (remote
            nodes: other than the source's) their top-k reaches (token rows only).
        token_rows: whether token rows were added (the last three mean something).
    """

    def __init__(self, fabric: Fabric, num_layers: int) -> None:
        self.fabric, self.num_layers = fabric, num_layers
        r, n = fabric.ranks, fabric.nodes
        self.rank_tokens = np.zeros((num_layers, r, r), dtype=np.float64)
        self.node_reach = np.zeros((num_layers, n, n), dtype=np.int64)
        self.nodes_per_token = np.zeros((num_layers, n + 1), dtype=np.int64)
        self.remote_nodes_per_token = np.zeros((num_layers, n + 1), dtype=np.int64)
        self.token_rows = False

    def add_slot_counts(self, source: int, slot_count: np.ndarray) -> None:
        """Copies rank ``source`` routed to each slot, ``[L, P]``."""
        self.rank_tokens[:, source, :] += rank_load(np.asarray(slot_count, dtype=np.float64), self.fabric.ranks)

    def add_token_slots(self, source: np.ndarray, slots: np.ndarray) -> None:
        """Token rows: the source rank of each ``[M]`` and its slots ``[M, L, k]`` (``< 0``: no copy).

        One layer at a time, so the temporaries are ``[M, k]`` whatever the layer count.
        """
        fabric = self.fabric
        r, n, g = fabric.ranks, fabric.nodes, fabric.gpus_per_node
        self.token_rows = True
        source = np.asarray(source, dtype=np.int32)
        src = np.broadcast_to(source[:, None], slots.shape[::2])  # [M, k]
        src_node = np.broadcast_to((source // g)[:, None], src.shape)
        for layer in range(self.num_layers):
            dest = fabric.rank_of_slot(slots[:, layer])  # [M, k]
            valid = dest >= 0
            self.rank_tokens[layer] += np.bincount(src[valid] * r + dest[valid], minlength=r * r).reshape(r, r)
            node = np.sort(np.where(valid, dest // g, n), axis=1)  # invalid sorts last
            first = (node < n) & np.concatenate([np.ones_like(node[:, :1], bool), node[:, 1:] != node[:, :-1]], axis=1)
            self.node_reach[layer] += np.bincount(src_node[first] * n + node[first], minlength=n * n).reshape(n, n)
            distinct = first.sum(axis=1)
            local = (first & (node == src_node)).sum(axis=1)
            self.nodes_per_token[layer] += np.bincount(distinct, minlength=n + 1)
            self.remote_nodes_per_token[layer] += np.bincount(distinct - local, minlength=n + 1)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The traffic of a run over the selected layers.

    Attributes:
        layers: model layer ids ``[L]``.
        fabric: ranks, GPUs per node and slots.
        sources: EP ranks whose routing was read (one per token group for an exact matrix).
        counter: the accumulated matrices (:class:`TrafficCounter`).
        hidden_size, dtype_bytes: ``H`` and ``b`` for the bytes (``None``: unknown, no bytes).
        plan: whether the routes were re-projected onto another placement.
        token_groups: groups of ranks that route their own tokens in the run's layout (every EP rank under
            DP attention; one a TP group under TP attention, whose lowest rank is counted).
    """

    layers: np.ndarray
    fabric: Fabric
    sources: tuple[int, ...]
    counter: TrafficCounter
    hidden_size: int | None
    dtype_bytes: int | None
    plan: bool = False
    token_groups: int | None = None

    @property
    def complete(self) -> bool:
        """Whether every token group's routing was read (the matrix holds every routed copy)."""
        return len(self.sources) == (self.fabric.ranks if self.token_groups is None else self.token_groups)

    @property
    def rank_tokens(self) -> np.ndarray:
        """``[L, R, R]`` copies from source to destination rank."""
        return self.counter.rank_tokens

    @property
    def node_tokens(self) -> np.ndarray:
        """``[L, N, N]`` copies from source to destination node."""
        return node_matrix(self.counter.rank_tokens, self.fabric.gpus_per_node)

    def _bytes(self, copies: float) -> float | None:
        if not self.hidden_size or not self.dtype_bytes:
            return None
        return _number(exchanged_bytes(copies, self.hidden_size, self.dtype_bytes))  # type: ignore[arg-type]

    def _figures(self, rank_tokens: np.ndarray, reach: np.ndarray | None, nodes: np.ndarray | None, remote: np.ndarray | None) -> dict[str, object]:
        """The JSON figures of one ``[R, R]`` matrix (a layer's or the sum) and its token-row figures."""
        node_tokens = node_matrix(rank_tokens, self.fabric.gpus_per_node)
        total, local_rank = float(rank_tokens.sum()), float(np.trace(rank_tokens))
        inter = total - float(np.trace(node_tokens))
        rdma_dedup = None if reach is None else float(reach.sum() - np.trace(reach))
        return {
            "rank_tokens": _numbers(rank_tokens),
            "node_tokens": _numbers(node_tokens),
            "copies": _number(total),
            "inter_node_share": inter_node_share(node_tokens),
            "node_dedup_tokens": None if reach is None else reach.tolist(),
            "nodes_per_token": None if nodes is None else nodes.tolist(),
            "remote_nodes_per_token": None if remote is None else remote.tolist(),
            "bytes": {
                "all_copies": self._bytes(total),
                "remote_rank": self._bytes(total - local_rank),
                "nvlink": self._bytes(total - local_rank - inter),
                "inter_node": self._bytes(inter),
                "rdma_node_dedup": None if rdma_dedup is None else self._bytes(rdma_dedup),
            },
            "hottest_node_links": hottest_links(node_tokens),
            "hottest_rank_links": hottest_links(rank_tokens),
        }

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: the summed figures at top level, ``layers`` the same per layer (``docs/traffic.md``)."""
        c = self.counter
        rows = c.token_rows
        top = self._figures(c.rank_tokens.sum(axis=0), c.node_reach.sum(axis=0) if rows else None,
                            c.nodes_per_token.sum(axis=0) if rows else None, c.remote_nodes_per_token.sum(axis=0) if rows else None)
        per_layer = []
        for i, layer in enumerate(self.layers):
            figures = self._figures(c.rank_tokens[i], c.node_reach[i] if rows else None,
                                    c.nodes_per_token[i] if rows else None, c.remote_nodes_per_token[i] if rows else None)
            per_layer.append({"layer": int(layer), **figures})
        f = self.fabric
        head = {"ranks": f.ranks, "gpus_per_node": f.gpus_per_node, "nodes": f.nodes, "slots": f.num_slots,
                "sources": list(self.sources), "complete": self.complete, "plan": self.plan,
                "hidden_size": self.hidden_size, "dtype_bytes": self.dtype_bytes}
        return {**head, **top, "layers": per_layer}


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every trace of the run must agree on, from the first one."""

    layers: np.ndarray
    layer_index: np.ndarray
    mode: str
    fabric: Fabric
    physical_to_logical: np.ndarray
    attrs: dict[str, object]
    token_groups: int | None


def _row_sources(trace: Trace) -> list[tuple[int, int, bool]]:
    """``(row, EP rank, counted)`` of each ``/stat`` rank row (a row without a layout: its ``rank`` attribute,
    or its row index in a merged trace)."""
    counted = trace.counted().assignments
    if trace.layouts:
        return [(i, layout.ep_rank, bool(keep)) for i, (layout, keep) in enumerate(zip(trace.layouts, counted, strict=True))]
    if len(counted) == 1:
        return [(0, int(trace.attrs.get(Attr.RANK, 0)), True)]  # type: ignore[call-overload]
    return [(i, i, True) for i in range(len(counted))]


def _check_same(run: _Run, trace: Trace, layer_index: np.ndarray) -> None:
    ours = (trace.mode, trace.ep_size, trace.num_physical_experts, [int(x) for x in trace.layers[layer_index]])
    theirs = (run.mode, run.fabric.ranks, run.fabric.num_slots, [int(x) for x in run.layers])
    if ours != theirs:
        raise TraceError(f"{trace.path}: mode, EP size, slots and layers {ours} differ from the first trace's {theirs}; "
                         "give the per-rank files of one run")
    if trace.run_id != run.attrs.get(Attr.RUN_ID):
        raise TraceError(f"{trace.path}: run_id {trace.run_id} differs from the first trace's {run.attrs.get(Attr.RUN_ID)}; give the traces of one run")


def _slot_counts(trace: Trace, run: _Run, plan: np.ndarray | None, phase: int | None, row: int) -> np.ndarray:
    """Rank row ``row``'s copies per slot ``[L, P]`` (re-projected onto ``plan`` when given)."""
    if phase is None:
        counts = trace.physical_count(per_rank=True)[row][run.layer_index]
    else:
        if trace.physical_count(per_rank=True).shape[0] != 1:
            raise TraceError(f"{trace.path}: --phase needs per-rank files (this trace merges several rank rows); pass the per-rank files")
        counts = sum((block.physical_count.sum(axis=0) for block in iter_pass_blocks(trace, run.layer_index, phase=phase)),
                     np.zeros((len(run.layer_index), trace.num_physical_experts), dtype=np.int64))
    if plan is None:
        return counts
    return replica_load(to_logical(counts, run.physical_to_logical), plan)


def _add_token_rows(trace: Trace, run: _Run, counter: TrafficCounter, plan: np.ndarray | None, phase: int | None) -> set[int]:
    """Stream a ``per_token`` trace's rows into ``counter``; the EP ranks they came from."""
    sources = {layout.rank: layout.ep_rank for layout in trace.layouts}
    own = _row_sources(trace)[0][1]
    cells = max(1, trace.num_layers * trace.top_k)
    seen: set[int] = set()
    for chunk in trace.iter_tokens(chunk=max(64, TOKEN_CHUNK_CELLS // cells), counted_only=True, phase=phase):
        ids = chunk.topk_ids[:, run.layer_index, :].astype(np.int32)
        ids = np.where(ids < run.fabric.num_slots, ids, -1)  # out-of-range ids (-2) are not copies
        if chunk.rank is None:
            source = np.full(len(ids), own, dtype=np.int32)
        else:
            source = np.array([sources.get(int(r), int(r)) for r in chunk.rank], dtype=np.int32)
        if plan is not None:
            ids = sglang_slots(_logical_ids(ids, run.physical_to_logical), chunk.position, plan)
        counter.add_token_slots(source, ids)
        seen.update(np.unique(source).tolist())
    return seen


def _logical_ids(ids: np.ndarray, physical_to_logical: np.ndarray) -> np.ndarray:
    """Physical ids ``[M, L, k]`` -> logical ids (``-1`` stays ``-1``) through ``physical_to_logical [L, P]``."""
    layer = np.arange(ids.shape[1])[None, :, None]
    return np.where(ids >= 0, physical_to_logical[layer, np.maximum(ids, 0)], -1)


def _replica_files(paths: Sequence[Path | str]) -> set[int]:
    """Indices of the per-rank files whose rank routes the same tokens as another given file's lower rank (TP attention:
    that rank's file is the one counted), from their layouts alone; none unless every file holds one rank row."""
    layouts: list[RankLayout] = []
    for path in paths:
        with open_trace(path) as trace:
            rows = trace.layouts
        if len(rows) != 1:
            return set()
        twice = [i for i, x in enumerate(layouts) if x.rank == rows[0].rank]
        if twice:
            raise TraceError(f"{path}: rank {rows[0].rank}'s routing is also in {paths[twice[0]]}; give each rank's trace once")
        layouts.append(rows[0])
    counted = counted_rows([x.token_group for x in layouts], [x.rank for x in layouts], [x.pp_rank for x in layouts])
    return {i for i, keep in enumerate(counted.assignments) if not keep}


def _open_run(trace: Trace, gpus_per_node: int, layers: Sequence[int] | None, plan: np.ndarray | None) -> _Run:
    index = select_layers(trace, layers)
    slots = trace.num_physical_experts if plan is None else int(plan.shape[1])
    if plan is not None and plan.shape[0] != len(index):
        raise ValueError(f"the plan has {plan.shape[0]} layer rows for the {len(index)} selected layers")
    try:
        fabric = Fabric(trace.ep_size, gpus_per_node, slots)
    except ValueError as exc:
        raise TraceError(f"{trace.path}: {exc}") from None
    groups = None
    if trace.layouts:
        first = trace.layouts[0]
        replicas = first.dp_size if first.attention == "tp" else 1
        groups = replicas * first.tp_size // int(first.router_tp_size or 1)
    return _Run(trace.layers[index], index, trace.mode, fabric, trace.physical_to_logical[index], trace.attrs, groups)


def trace_traffic(
    paths: Sequence[Path | str],
    gpus_per_node: int,
    plan: np.ndarray | None = None,
    layers: Sequence[int] | None = None,
    phase: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    token_rows: bool = True,
) -> Traffic:
    """The traffic of one run's traces (per-rank files, or merged ones), read one rank row or token chunk at a time.

    Args:
        paths: the run's traces, every EP rank's routing among them for an exact matrix.
        gpus_per_node: ``G``; must divide the EP size.
        plan: ``phy2log [L_sel, N]`` of another placement to re-project the routes onto (``None``: as recorded).
        layers: model layer ids (default: all).
        phase: only the passes of this pass phase (``prefill``, ``decode``, ...; per-rank files).
        progress: called ``(files done, files)``.
        token_rows: read ``per_token`` traces row by row (nodes per token; a plan's replica picked per row as SGLang
            does); ``False``: from their per-slot counts like the other modes (faster; a plan's replicas share evenly).

    Raises:
        TraceError: unreadable or mismatched traces, a rank given twice, sizes that do not fit (names the file and fix).
    """
    if not paths:
        raise ValueError("no traces given")
    counter: TrafficCounter | None = None
    run: _Run | None = None
    seen: dict[int, Path] = {}
    replicas = _replica_files(paths) if len(paths) > 1 else set()
    for done, path in enumerate(paths):
        if done in replicas:  # its routing is a lower rank's, counted from that rank's file
            if progress is not None:
                progress(done + 1, len(paths))
            continue
        with open_trace(path) as trace:
            if run is None:
                run = _open_run(trace, gpus_per_node, layers, plan)
                counter = TrafficCounter(run.fabric, len(run.layer_index))
            _check_same(run, trace, select_layers(trace, layers))
            assert counter is not None
            code = None if phase is None else phase_of(trace, phase)
            if trace.mode == "per_token" and token_rows:
                ranks = _add_token_rows(trace, run, counter, plan, code)
            else:
                ranks = set()
                for row, source, counted in _row_sources(trace):
                    if counted:
                        counter.add_slot_counts(source, _slot_counts(trace, run, plan, code, row))
                        ranks.add(source)
            for rank in ranks:
                if rank in seen:
                    raise TraceError(f"{trace.path}: EP rank {rank}'s routing is also in {seen[rank]}; give each rank's trace once")
                seen[rank] = Path(path)
        if progress is not None:
            progress(done + 1, len(paths))
    assert run is not None and counter is not None
    hidden, width = (int(run.attrs.get(key) or 0) or None for key in (Attr.HIDDEN_SIZE, Attr.DTYPE_BYTES))  # type: ignore[call-overload]
    return Traffic(run.layers, run.fabric, tuple(sorted(seen)), counter, hidden, width, plan is not None, run.token_groups)


def plan_inter_node_share(paths: Sequence[Path | str], layer_ids: Sequence[int], phy2log: np.ndarray, num_gpus: int,
                          num_nodes: int) -> dict[str, float | str | None] | None:
    """The inter-node share of the run's routes as recorded (``current``) and on ``phy2log [L, N]`` (``plan``), for
    ``moetrace placement``: a plan that balances load but sends more across nodes shows it before it is deployed.

    Read from the per-slot counts (a plan's replicas share an expert's copies evenly, as the planner predicts).
    ``None`` when there is nothing to compare: one node, or a plan for another GPU count than the traces' EP size.
    When the traces cannot give the matrix (e.g. one rank's segments given twice) the figures are ``None`` and
    ``note`` says why.
    """
    if num_nodes <= 1:
        return None
    with open_trace(paths[0]) as first:
        if first.ep_size != num_gpus:
            return None
    try:
        current = trace_traffic(paths, num_gpus // num_nodes, layers=layer_ids, token_rows=False)
        planned = trace_traffic(paths, num_gpus // num_nodes, plan=phy2log, layers=layer_ids, token_rows=False)
    except TraceError as exc:
        return {"current": None, "plan": None, "note": str(exc)}
    return {"current": inter_node_share(current.node_tokens.sum(axis=0)), "plan": inter_node_share(planned.node_tokens.sum(axis=0)),
            "note": None if current.complete else f"only EP ranks {list(current.sources)} of {num_gpus} were read"}
