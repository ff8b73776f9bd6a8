"""Request identity on every per_token row (issue 35 item 1): the batch contract, the rows, the table.

A synthetic engine runs a continuous-batching schedule (chunked prefill, prefix-cache hits,
a preempted and recomputed request, decode, padding rows, idle passes) whose expert ids are a
known function of (request, position, layer), so every row's expected request and position,
and every request's expected routes, are known without moetrace. Recorded with tiny hand-offs
and segments (the request table crosses both), dumped twice, merged over two replicated
ranks: the rows and :func:`moetrace.trace.token_routes.request_routes` must equal the schedule.
"""

from __future__ import annotations

import dataclasses
import shutil

import h5py
import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.batch import BatchError, PassBatch
from moetrace.layout import RankLayout
from moetrace.trace import TraceError, open_trace
from moetrace.trace.integrity import reseal
from moetrace.trace.join import concat_segments
from moetrace.trace.merge import merge_traces
from moetrace.trace.schema import Data, TraceDamageError
from moetrace.trace.token_routes import request_routes

LAYERS, EXPERTS, TOP_K = 3, 16, 2


def expert_ids(request: np.ndarray, position: np.ndarray) -> np.ndarray:
    """``[n, L, k]`` the synthetic router: distinct ids per row, a function of (request, position, layer)."""
    base = (request[:, None] * 7 + position[:, None] * 3 + np.arange(LAYERS)[None, :] * 5) % EXPERTS
    return (base[:, :, None] + np.arange(TOP_K)[None, None, :]) % EXPERTS


@dataclasses.dataclass
class Pass:
    batch: PassBatch | None
    ids: np.ndarray  # [num_rows, L, k] what the hooks see (-1 rows: static-batch padding)
    request: np.ndarray  # [num_rows] expected request number (-1: none)
    position: np.ndarray  # [num_rows] expected position in it (-1: none)


def schedule(seed: int = 3, requests: int = 18) -> tuple[list[Pass], dict[str, np.ndarray]]:
    """A continuous-batching run and each request's expected routes (-1 rows: positions never computed)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 20, size=requests)
    output = rng.integers(1, 6, size=requests)
    cached = np.where(rng.random(requests) < 0.3, rng.integers(1, 3, size=requests), 0)  # prefix-cache hits
    done = cached.copy()  # positions computed so far
    total = prompt + output
    arrival = np.sort(rng.integers(0, 12, size=requests))
    preempt = {int(rng.integers(requests)): False}  # one request is preempted once and recomputed from 0
    passes: list[Pass] = []
    computed: dict[int, set[int]] = {r: set() for r in range(requests)}
    step = 0
    while (done < total).any():
        live = [r for r in range(requests) if arrival[r] <= step and done[r] < total[r]]
        step += 1
        budget = 16  # chunked prefill: at most 16 tokens per pass
        ids, starts, counts, prefill = [], [], [], []
        for r in live:
            if done[r] < prompt[r]:
                n = int(min(prompt[r] - done[r], budget))
                if n == 0:
                    continue
                budget -= n
                prefill.append(True)
            else:
                n = 1
                prefill.append(False)
            ids.append(r)
            starts.append(int(done[r]))
            counts.append(n)
            done[r] += n
        for r in list(preempt):
            if not preempt[r] and done[r] >= total[r] - 1 and done[r] > 2:
                preempt[r] = True
                done[r] = 0  # recomputed from position 0 (no prefix cache kept)
        if not ids:
            passes.append(Pass(PassBatch.idle(), np.zeros((0, LAYERS, TOP_K), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)))
            continue
        left = int(rng.integers(0, 3))  # rows no request owns, routed (an HF batch's left padding)
        pad = int(rng.integers(0, 3))  # static-batch padding rows: all -1, never written
        rows = left + sum(counts)
        batch = PassBatch.of([f"req-{r}" for r in ids], starts, counts, prefill=prefill,
                             row=left + np.cumsum(counts) - np.asarray(counts), num_rows=rows + pad)
        request = np.full(rows + pad, -1)
        position = np.full(rows + pad, -1)
        owner, pos = batch.row_requests()
        request[owner >= 0] = np.asarray(ids)[owner[owner >= 0]]
        position[owner >= 0] = pos[owner >= 0]
        hook_ids = expert_ids(np.maximum(request, 0) + 1000 * (request < 0), np.maximum(position, 0) + np.arange(rows + pad) * (request < 0))
        hook_ids[rows:] = -1
        for r, s, n in zip(ids, starts, counts, strict=True):
            computed[r].update(range(s, s + n))
        passes.append(Pass(batch, hook_ids, request, position))
    expected = {}
    for r in range(requests):
        length = max(computed[r]) + 1
        routes = np.full((length, LAYERS, TOP_K), -1, dtype=np.int64)
        where = np.array(sorted(computed[r]))
        routes[where] = expert_ids(np.full(len(where), r), where)
        expected[f"req-{r}"] = routes
    return passes, expected


def record(recorder: ExpertDistributionRecorder, passes: list[Pass]) -> None:
    for p in passes:
        with recorder.with_forward_pass(batch=p.batch):
            for layer in range(LAYERS):
                with recorder.with_current_layer(layer):
                    recorder.on_select_experts(torch.from_numpy(p.ids[:, layer].copy()))


def make(tmp_path, **changes) -> ExpertDistributionRecorder:
    config = dict(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode="per_token", output_dir=tmp_path,
                  max_tokens_per_pass=24, stream_chunk_tokens=48, segment_bytes=600, segment_seconds=0)
    config.update(changes)
    return ExpertDistributionRecorder(RecorderConfig(**config))


def rows_of(path) -> dict[str, np.ndarray]:
    with open_trace(path) as trace:
        table = trace.request_table()
        chunks = list(trace.iter_tokens(chunk=7))
    request = np.concatenate([c.request for c in chunks])
    return {
        "pass_id": np.concatenate([c.pass_id for c in chunks]),
        "position": np.concatenate([c.position for c in chunks]),
        "request": np.where(request >= 0, table[np.maximum(request, 0)], None),
        "request_position": np.concatenate([c.request_position for c in chunks]),
    }


def expected_rows(passes: list[Pass], first: int = 0) -> dict[str, np.ndarray]:
    """Rows the trace must hold: every row a hook routed (padding rows, all -1, are never written)."""
    out: dict[str, list] = {"pass_id": [], "position": [], "request": [], "request_position": []}
    for pass_id, p in enumerate(passes[first:], start=first):
        real = (p.ids != -1).reshape(len(p.ids), LAYERS * TOP_K).any(axis=1)
        out["pass_id"].append(np.full(int(real.sum()), pass_id))
        out["position"].append(np.flatnonzero(real))
        out["request"].append(np.array([f"req-{r}" if r >= 0 else None for r in p.request[real]], dtype=object))
        out["request_position"].append(p.position[real])
    return {k: np.concatenate(v) for k, v in out.items()}


def assert_rows(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for name in expected:
        assert actual[name].tolist() == expected[name].tolist(), name


def test_row_requests_vectorised_matches_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        b = int(rng.integers(0, 6))
        count = rng.integers(0, 5, size=b)
        gaps = rng.integers(0, 3, size=b)
        row = np.cumsum(gaps + count) - count
        start = rng.integers(0, 50, size=b)
        batch = PassBatch.of([f"r{i}" for i in range(b)], start, count, prefill=rng.random(b) < 0.5, row=row,
                             num_rows=int((row + count).max(initial=0)) + int(rng.integers(0, 3)))
        request, position = batch.row_requests(index=np.arange(b) + 10)
        want_r, want_p = [-1] * batch.num_rows, [-1] * batch.num_rows
        for i in range(b):
            for j in range(int(count[i])):
                want_r[int(row[i]) + j], want_p[int(row[i]) + j] = 10 + i, int(start[i]) + j
        assert request.tolist() == want_r and position.tolist() == want_p
        assert batch.num_tokens == int(count.sum()) and batch.prefill_tokens + batch.decode_tokens == batch.num_tokens


def test_batch_refuses_what_is_not_a_batch():
    with pytest.raises(BatchError, match="overlap"):
        PassBatch.of(["a", "b"], [0, 0], [3, 2], row=[0, 2], phase="prefill")
    with pytest.raises(BatchError, match="one entry per request"):
        PassBatch.of(["a", "b"], [0], [3, 2], phase="prefill")
    with pytest.raises(BatchError, match="rows say 'decode'"):
        PassBatch.of(["a"], [5], [1], prefill=False, phase="prefill")
    with pytest.raises(BatchError, match="num_rows"):
        PassBatch.of(["a"], [0], [4], phase="prefill", num_rows=3)
    with pytest.raises(BatchError, match="give `prefill`"):
        PassBatch.of(["a", "b"], [0, 4], [3, 1], phase="mixed")
    assert PassBatch.of(["a", "b"], [0, 4], [3, 1], prefill=[True, False]).phase == "mixed"
    assert PassBatch.of(["a"], [0], [0]).phase == "idle" and PassBatch.idle(4).num_rows == 4


def test_rows_carry_requests_across_handoffs_segments_dumps_and_ranks(tmp_path):
    passes, expected = schedule()
    half = len(passes) // 2
    rec = make(tmp_path)
    rec.start_record()
    record(rec, passes[:half])
    first = rec.dump_record(tmp_path / "first.h5")
    record(rec, passes[half:])
    rec.stop_record()
    second = rec.dump_record(tmp_path / "second.h5")
    want = expected_rows(passes)
    got = {k: np.concatenate([rows_of(first)[k], rows_of(second)[k]]) for k in want}
    assert_rows(got, want)
    with open_trace(first) as trace:  # several segments were joined: the table repeats ids, never wrongly
        table = trace.request_table()
        assert len(table) > len(set(table))
    routes = request_routes([first, second])
    assert sorted(routes) == sorted(expected)
    for rid, want_routes in expected.items():
        np.testing.assert_array_equal(routes[rid], want_routes, err_msg=rid)
    one = request_routes([first, second], request_id="req-4")
    assert list(one) == ["req-4"]
    np.testing.assert_array_equal(one["req-4"], expected["req-4"])
    with pytest.raises(TraceError, match="no token rows"):
        request_routes(first, request_id="nope")


def test_replicated_ranks_are_read_once(tmp_path):
    """Two TP-attention ranks route the same tokens: their rows carry the same requests and positions,
    and ``request_routes`` reads the counted rank's (rank 0, the one an engine answers from) from the
    merged trace and from the per-rank files given together, in either order. Rank 1 here routes every
    token to the next expert (a replica that disagrees), so reading its rows would show (negative
    control: rank 1's file alone gives its own routes)."""
    passes, expected = schedule(seed=5, requests=16)
    other = [dataclasses.replace(p, ids=np.where(p.ids >= 0, (p.ids + 1) % EXPERTS, -1)) for p in passes]
    paths = []
    for rank, ran in enumerate((passes, other)):
        rec = make(tmp_path / f"r{rank}", run_id="rows-merge", layout=_tp_layout(rank))
        rec.start_record()
        record(rec, ran)
        rec.stop_record()
        paths.append(rec.dump_record(tmp_path / "run.h5"))
    merged = merge_traces(paths, tmp_path / "merged.h5")
    with open_trace(merged) as trace:
        table = trace.request_table()
        rank = trace.read_tokens("rank")
        request = np.where(trace.read_tokens("request") >= 0, table[np.maximum(trace.read_tokens("request"), 0)], None)
        key = list(zip(trace.read_tokens("pass_id").tolist(), trace.read_tokens("position").tolist(), strict=True))
        position = trace.read_tokens("request_position")
    by_rank = [{k: (r, p) for k, r, p, rk in zip(key, request, position, rank, strict=True) if rk == which} for which in (0, 1)]
    assert by_rank[0] == by_rank[1] and len(by_rank[0]) == len(expected_rows(passes)["pass_id"])
    for given in (merged, paths, paths[::-1]):
        routes = request_routes(given)
        assert sorted(routes) == sorted(expected)
        for rid, want_routes in expected.items():
            np.testing.assert_array_equal(routes[rid], want_routes, err_msg=f"{given}: {rid}")
    alone = request_routes(paths[1])
    for rid, want_routes in expected.items():
        np.testing.assert_array_equal(alone[rid], np.where(want_routes >= 0, (want_routes + 1) % EXPERTS, -1), err_msg=rid)


def test_gathered_ranks_each_label_their_own_requests(tmp_path):
    """SGLang's DP attention with the MoE input gathered over the TP group: both ranks route every row
    (replicas, counted once), each labels only the rows of its own requests. Each request's routes come
    from the rank that holds its rows, from the per-rank files and from their merge; each rank's file
    alone gives its own requests only."""
    passes, expected = schedule(seed=8, requests=12)
    paths = []
    for rank in range(2):
        own = []
        for p in passes:
            if p.batch is None or p.batch.num_requests == 0:
                own.append(p)
                continue
            mine = np.array([int(rid.split("-")[1]) % 2 == rank for rid in p.batch.request_ids])
            b = p.batch
            batch = PassBatch.of([r for r, m in zip(b.request_ids, mine, strict=True) if m], b.start[mine], b.count[mine],
                                 prefill=b.prefill[mine], row=b.row[mine], num_rows=b.num_rows)
            own.append(dataclasses.replace(p, batch=batch))
        layout = RankLayout(world_size=2, rank=rank, tp_size=2, tp_rank=rank, dp_size=2, dp_rank=rank, attn_tp_size=1,
                            router_tp_size=2, source="sglang")
        rec = make(tmp_path / f"r{rank}", run_id="rows-gathered", layout=layout)
        rec.start_record()
        record(rec, own)
        rec.stop_record()
        paths.append(rec.dump_record(tmp_path / "run.h5"))
    merged = merge_traces(paths, tmp_path / "merged.h5")
    for given in (merged, paths, paths[::-1]):
        routes = request_routes(given)
        assert sorted(routes) == sorted(expected)
        for rid, want_routes in expected.items():
            np.testing.assert_array_equal(routes[rid], want_routes, err_msg=f"{given}: {rid}")
    for rank, path in enumerate(paths):
        assert sorted(request_routes(path)) == sorted(rid for rid in expected if int(rid.split("-")[1]) % 2 == rank)


def _tp_layout(rank: int) -> RankLayout:
    return RankLayout(world_size=2, rank=rank, tp_size=2, tp_rank=rank, source="reference")


def _recorded(tmp_path, seed: int):
    """A per_token trace of 4 scheduled requests, recorded and dumped to ``tmp_path / "t.h5"``."""
    passes, _ = schedule(seed=seed, requests=4)
    rec = make(tmp_path)
    rec.start_record()
    record(rec, passes)
    rec.stop_record()
    return rec.dump_record(tmp_path / "t.h5")


def test_out_of_range_request_index_is_damage(tmp_path):
    path = _recorded(tmp_path, seed=1)
    assert rows_of(path)["request"].tolist()  # the honest trace reads (negative control)
    with h5py.File(path, "r+") as f:
        column = f[Data.TOKENS_REQUEST]
        column[0] = f[Data.REQUEST_TABLE_ID].shape[0]  # one past the table
    reseal(path)  # checksums redone: only the invariant can catch it
    with pytest.raises(TraceDamageError, match="request_table"):
        rows_of(path)


def test_merge_and_join_refuse_request_rows_their_table_cannot_hold(tmp_path):
    """A chunk of ``-1`` (rows without a request) swapped with a chunk of zeros keeps its Fletcher-32
    checksum (16-bit words summed mod 65535: 0xFFFF and 0x0000 are the same). ``merge`` and the
    segment join move the index column without the reader; they check the rows' rule themselves
    (the command fuzz found ``merge`` answering exit 0 with zeros: segment kind, case 59)."""
    path = _recorded(tmp_path, seed=2)
    other = tmp_path / "other.h5"  # a join of one segment copies it whole: join two
    shutil.copy(path, other)
    merge_traces([path], tmp_path / "honest.h5")  # the honest trace merges and joins (negative control)
    concat_segments([path, other], tmp_path / "honest-join.h5")
    with h5py.File(path, "r+") as f:
        f[Data.TOKENS_REQUEST][0] = f[Data.REQUEST_TABLE_ID].shape[0]  # one past the table
    reseal(path)  # checksums redone: only the rows' rule can catch it
    with pytest.raises(TraceDamageError, match="request_table"):
        merge_traces([path], tmp_path / "merged.h5")
    with pytest.raises(TraceDamageError, match="request_table"):
        concat_segments([path, other], tmp_path / "joined.h5")
