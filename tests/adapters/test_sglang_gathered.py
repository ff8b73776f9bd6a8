"""Request rows under SGLang's DP attention with the MoE input gathered over the TP group (no engine, no SGLang).

Two DP-attention ranks (``tp_size=2``, ``attn_tp_size=1``, no all-to-all backend): each runs its own
requests through attention, then SGLang gathers both ranks' rows into one MoE input, rank 0's
first, each rank's padded to ``global_num_tokens_cpu[r]`` (set by ``prepare_mlp_sync_batch`` inside
the pass). Each rank's :class:`~moetrace.adapters.sglang.bridge.RecorderBridge` sees the gathered
rows and its own ``ForwardBatch`` (host fields as SGLang fills them); its trace must tie the rows of
its own requests, at their offset in the gathered input, to their ids and positions, and leave the
other rank's rows and the padding without a request. Together the two traces give every request's
routes (each from its own rank; :func:`moetrace.trace.token_routes.request_routes`). A pass replayed
as a CUDA graph leaves the gather sizes unset: its rows carry no request. The hooks do not sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from moetrace.adapters.sglang.bridge import RecorderBridge
from moetrace.adapters.sglang.layout import sglang_layout

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.testing import assert_no_host_sync
from moetrace.trace import open_trace
from moetrace.trace.merge import merge_traces
from moetrace.trace.token_routes import request_routes

LAYERS, EXPERTS, TOP_K = 2, 8, 2


class _SGLangNoop:
    """What SGLang's no-op recorder answers (its recorder is not what is tested here)."""

    @contextlib.contextmanager
    def with_forward_pass(self, forward_pass_id: int, forward_batch: Any) -> Iterator[dict]:
        yield {}

    @contextlib.contextmanager
    def with_current_layer(self, layer_idx: int) -> Iterator[None]:
        yield

    def on_select_experts(self, topk_ids: torch.Tensor) -> None:
        return None


def _mode(name: str) -> SimpleNamespace:
    """A ``ForwardMode`` as the bridge reads it: its name and ``is_*`` checks."""
    return SimpleNamespace(name=name, **{f"is_{m}": (lambda m=m: name.lower() == m) for m in ("idle", "decode", "mixed", "extend")})


def _ids(request: int, position: int) -> np.ndarray:
    """``[L, k]`` the router's choice for one row (distinct per request and position)."""
    base = (request * 5 + position * 3 + np.arange(LAYERS)[:, None] * 2) % EXPERTS
    return np.concatenate([base, (base + 1) % EXPERTS], axis=1)


# Three passes of two DP ranks: per rank (mode, [(request, start, count)]); request r's rows compute
# positions start .. start + count - 1. Rank 0 serves requests 0 and 1 (1 has 2 prefix-cached
# positions), rank 1 serves request 2. Gather sizes: SUM_LEN [6, 4]; MAX_LEN [2, 2] (rank 1 padded);
# then rank 0 idle (one padding row), rank 1 decoding.
PASSES = [
    ({0: ("EXTEND", [(0, 0, 5), (1, 2, 1)]), 1: ("EXTEND", [(2, 0, 4)])}, [6, 4]),
    ({0: ("DECODE", [(0, 5, 1), (1, 3, 1)]), 1: ("DECODE", [(2, 4, 1)])}, [2, 2]),
    ({0: ("IDLE", []), 1: ("DECODE", [(2, 5, 1)])}, [1, 1]),
]
PADDING = 7  # the expert a padded row's zero hidden state routes to


def _forward_batch(mode: str, requests: list[tuple[int, int, int]]) -> SimpleNamespace:
    """This rank's ``ForwardBatch`` at the pass start (before SGLang sizes the gather)."""
    rows = sum(c for _, _, c in requests)
    batch = SimpleNamespace(forward_mode=_mode(mode), batch_size=len(requests), rids=[f"req-{r}" for r, _, _ in requests],
                            input_ids=torch.zeros(rows, dtype=torch.int64), global_num_tokens_cpu=None, global_dp_buffer_len=None)
    if mode == "EXTEND":
        batch.extend_prefix_lens_cpu = [s for _, s, _ in requests]
        batch.extend_seq_lens_cpu = [c for _, _, c in requests]
    elif mode == "DECODE":
        batch.seq_lens_cpu = torch.tensor([s + 1 for _, s, _ in requests])
    return batch


def _gathered_ids(ranks: dict[int, tuple[str, list[tuple[int, int, int]]]], sizes: list[int]) -> np.ndarray:
    """``[sum(sizes), L, k]`` the gathered MoE input's routing: each rank's rows, padded to its size."""
    rows = []
    for rank, size in enumerate(sizes):
        own = [_ids(r, p) for r, s, c in ranks[rank][1] for p in range(s, s + c)]
        rows += own + [np.full((LAYERS, TOP_K), PADDING)] * (size - len(own))
    return np.stack(rows)


def _record(tmp_path: Path, rank: int, graph_pass: bool) -> Path:
    layout = sglang_layout(1, 0, SimpleNamespace(tp_size=2, tp_rank=rank, pp_size=1, pp_rank=0, attn_dp_enabled=True, attn_tp_size=1),
                           all_to_all=False)
    assert layout.router_tp_size == 2 and layout.dp_rank == rank  # the MoE input is gathered over the TP group
    recorder = ExpertDistributionRecorder(RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode="per_token",
                                                         output_dir=tmp_path / f"r{rank}", layout=layout, run_id="gathered", engine="sglang"))
    bridge = RecorderBridge(_SGLangNoop(), recorder, sglang_is_real=False)
    bridge.start_record()
    for pass_id, (ranks, sizes) in enumerate(PASSES):
        forward_batch = _forward_batch(*ranks[rank])
        ids = torch.from_numpy(_gathered_ids(ranks, sizes))
        with bridge.with_forward_pass(pass_id, forward_batch):
            forward_batch.global_num_tokens_cpu, forward_batch.global_dp_buffer_len = list(sizes), sum(sizes)  # prepare_mlp_sync_batch
            for layer in range(LAYERS):
                with bridge.with_current_layer(layer), assert_no_host_sync():
                    bridge.on_select_experts(ids[:, layer])
    if graph_pass:  # a decode replayed as a CUDA graph: the runner pads inside, the gather sizes stay unset
        forward_batch = _forward_batch("DECODE", [(0, 6, 1), (1, 4, 1)] if rank == 0 else [(2, 6, 1)])
        with bridge.with_forward_pass(len(PASSES), forward_batch):
            for layer in range(LAYERS):
                with bridge.with_current_layer(layer):
                    bridge.on_select_experts(torch.from_numpy(np.stack([_ids(9, 9)] * 4)[:, layer]))
    bridge.stop_record()
    assert bridge.error is None
    return recorder.dump_record(tmp_path / "run.h5")


def _expected() -> dict[str, np.ndarray]:
    positions: dict[int, list[int]] = {}
    for ranks, _ in PASSES:
        for _, requests in ranks.values():
            for r, s, c in requests:
                positions.setdefault(r, []).extend(range(s, s + c))
    out = {}
    for r, where in positions.items():
        routes = np.full((max(where) + 1, LAYERS, TOP_K), -1, dtype=np.int64)
        for p in where:
            routes[p] = _ids(r, p)
        out[f"req-{r}"] = routes
    return out


def test_each_rank_ties_its_own_requests_rows_in_the_gathered_input(tmp_path: Path) -> None:
    paths = [_record(tmp_path, rank, graph_pass=True) for rank in range(2)]
    for rank, path in enumerate(paths):
        with open_trace(path) as trace:
            table = trace.request_table()
            chunks = list(trace.iter_tokens())
        request = np.concatenate([c.request for c in chunks])
        pass_id, row = np.concatenate([c.pass_id for c in chunks]), np.concatenate([c.position for c in chunks])
        position = np.concatenate([c.request_position for c in chunks])
        for p, (ranks, sizes) in enumerate(PASSES):
            offset = sum(sizes[:rank])
            want_request = np.full(sum(sizes), None, dtype=object)
            want_position = np.full(sum(sizes), -1)
            at = offset
            for r, s, c in ranks[rank][1]:
                want_request[at : at + c], want_position[at : at + c] = f"req-{r}", np.arange(s, s + c)
                at += c
            mine = pass_id == p
            np.testing.assert_array_equal(row[mine], np.arange(sum(sizes)))
            got = np.where(request[mine] >= 0, table[np.maximum(request[mine], 0)], None)
            assert got.tolist() == want_request.tolist(), (rank, p)
            np.testing.assert_array_equal(position[mine], want_position, err_msg=f"rank {rank} pass {p}")
        graph = pass_id == len(PASSES)
        assert graph.sum() == 4 and (request[graph] == -1).all()  # the graph replay's rows: no request
    expected = _expected()
    merged = merge_traces(paths, tmp_path / "merged.h5")
    for given in (paths, merged):
        routes = request_routes(given)
        assert sorted(routes) == sorted(expected)
        for rid, want in expected.items():
            np.testing.assert_array_equal(routes[rid], want, err_msg=rid)
    assert sorted(request_routes(paths[1])) == ["req-2"]  # rank 1 labels its own request only


def test_without_the_offset_the_rows_would_be_another_ranks(tmp_path: Path) -> None:
    """Negative control: rank 1's requests placed at row 0 (no offset) would be bound to rank 0's rows."""
    from moetrace.adapters.sglang.batches import gathered_pass_batch, sglang_pass_batch

    ranks, sizes = PASSES[0]
    forward_batch = _forward_batch(*ranks[1])
    local = sglang_pass_batch(forward_batch)
    assert local is not None and gathered_pass_batch(local, forward_batch, 1) is None  # before SGLang sized the gather
    forward_batch.global_num_tokens_cpu, forward_batch.global_dp_buffer_len = sizes, sum(sizes)
    placed = gathered_pass_batch(local, forward_batch, 1)
    assert placed is not None and placed.row.tolist() == [6] and placed.num_rows == 10
    ids = _gathered_ids(ranks, sizes)
    owner, _ = placed.row_requests()
    np.testing.assert_array_equal(ids[owner >= 0], np.stack([_ids(2, p) for p in range(4)]))
    owner, _ = local.row_requests(rows=10)
    assert not np.array_equal(ids[owner >= 0], np.stack([_ids(2, p) for p in range(4)]))
    forward_batch.global_dp_buffer_len = 11  # sizes that do not add up to the buffer: not placed
    assert gathered_pass_batch(local, forward_batch, 1) is None
