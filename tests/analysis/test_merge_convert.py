"""merge (real 2-rank gloo dumps) and convert (SGLang .pt dumps, JSON-lines logs)."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.analysis import analyze_trace
from moetrace.reference import free_port
from moetrace.trace import TraceError, open_trace
from moetrace.trace.convert import convert, convert_jsonl, convert_sglang
from moetrace.trace.merge import merge_traces

from .helpers import oracle_counts, replay_pass, write_stat_trace

PASS_IDS = {0: [0, 1, 2, 3, 4, 5], 1: [0, 1, 3, 4, 5, 6]}  # rank 1 skips pass 2, adds 6


def rank_routing(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.integers(0, 8, size=(3 + rank + i % 2, 2, 2)) for i in range(6)]


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mode in ("per_pass", "per_token"):
            cfg = RecorderConfig(num_layers=2, num_physical_experts=8, top_k=2, ep_size=world, ep_rank=rank, mode=mode, output_dir=out, max_tokens_per_pass=16, stream_chunk_tokens=16, stream_chunk_passes=2)
            rec = ExpertDistributionRecorder(cfg)
            rec.start_record()
            for pass_id, ids in zip(PASS_IDS[rank], rank_routing(rank), strict=True):
                replay_pass(rec, ids, pass_id)
            rec.stop_record()
            rec.dump_record(os.path.join(out, f"{mode}.h5"))
    finally:
        dist.destroy_process_group()


def _datasets(file: h5py.File) -> list[str]:
    names: list[str] = []
    file.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


@pytest.mark.slow
def test_merge_two_gloo_ranks(tmp_path):
    mp.start_processes(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    expected = [oracle_counts(rank_routing(r), 8) for r in range(2)]
    for mode, group in (("per_pass", "passes"), ("per_token", "tokens")):
        ranks = [tmp_path / f"{mode}-rank{r}.h5" for r in range(2)]
        merged = merge_traces(list(reversed(ranks)), tmp_path / f"{mode}-merged.h5", chunk_rows=3)
        with open_trace(merged) as trace:
            assert trace.attrs["rank"] == -1 and trace.attrs["world_size"] == 2
            assert json.loads(trace.attrs["merged_from"]) == [p.name for p in ranks]
            with open_trace(ranks[0]) as first:
                assert trace.run_id == first.run_id
            per_rank = trace.physical_count(per_rank=True)
            for r in range(2):
                np.testing.assert_array_equal(per_rank[r], expected[r])
        with h5py.File(merged, "r") as f:
            pid, rank = f[f"{group}/pass_id"][()], f[f"{group}/rank"][()]
        # Rows ordered by (pass id, rank); every row of every rank present.
        key = pid * 2 + rank
        assert (np.diff(key) >= 0).all()
        if mode == "per_pass":
            assert list(zip(pid.tolist(), rank.tolist(), strict=True)) == sorted((p, r) for r in range(2) for p in PASS_IDS[r])
        else:
            assert len(pid) == sum(len(x) for r in range(2) for x in rank_routing(r))
        report = analyze_trace(merged, window=1)
        np.testing.assert_array_equal(report.physical_count, expected[0] + expected[1])
        assert report.to_dict()["drift"]["num_windows"] == 7  # distinct passes 0..6
        # Streamed with one row per input in flight: the same file as reading every input whole.
        whole = merge_traces(ranks, tmp_path / f"{mode}-whole.h5", memory_bytes=1 << 40)
        streamed = merge_traces(ranks, tmp_path / f"{mode}-streamed.h5", memory_bytes=1)
        with h5py.File(whole, "r") as a, h5py.File(streamed, "r") as b:
            names = _datasets(a)
            assert names and names == _datasets(b) and all(np.array_equal(a[n][()], b[n][()]) for n in names)
        assert not [n for n in report.notes if "add up" in n]


def test_merge_refuses_mismatched_inputs(tmp_path):
    counts = np.arange(16).reshape(2, 8)
    a = write_stat_trace(tmp_path / "a.h5", counts, 2, 2, [0, 1], run_id="run1", rank=0, world_size=2)
    b = write_stat_trace(tmp_path / "b.h5", counts, 2, 2, [0, 1], run_id="run1", rank=1, world_size=2)
    other_run = write_stat_trace(tmp_path / "c.h5", counts, 2, 2, [0, 1], run_id="run2", rank=1, world_size=2)
    other_shape = write_stat_trace(tmp_path / "d.h5", np.ones((2, 4), np.int64), 2, 2, [0, 1], run_id="run1", rank=1, world_size=2)
    out = tmp_path / "out.h5"
    with pytest.raises(TraceError, match="different runs"):
        merge_traces([a, other_run], out)
    with pytest.raises(TraceError, match="num_logical_experts"):
        merge_traces([a, other_shape], out)
    with pytest.raises(TraceError, match=r"ranks 0\.\.1 exactly once"):
        merge_traces([a, a], out)
    with pytest.raises(TraceError, match=r"ranks 0\.\.1"):
        merge_traces([b], out)
    assert not out.exists()
    merged = merge_traces([b, a], out)
    with open_trace(merged) as trace:
        np.testing.assert_array_equal(trace.physical_count(), 2 * counts)
    with pytest.raises(TraceError, match="already holds every rank"):
        merge_traces([merged], tmp_path / "again.h5")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


# --------------------------------------------------------------------------- SGLang dumps
def sglang_records(per_token: bool, rng: np.random.Generator, mapping: np.ndarray) -> tuple[dict, list[np.ndarray]]:
    """Dumps shaped like SGLang's _DetailAccumulator output (one rank)."""
    records, all_ids = [], []
    for pass_id in (3, 4, 5, 7):
        tokens = int(rng.integers(1, 6))
        ids = rng.integers(0, mapping.shape[1], size=(2, tokens, 2))
        count = np.zeros(mapping.shape, np.int64)
        for layer in range(2):
            count[layer] = np.bincount(ids[layer].ravel(), minlength=mapping.shape[1])
        record = {"forward_pass_id": pass_id, "rank": 1, "gatherer_key": "primary", "global_physical_count": torch.as_tensor(count)}
        if per_token:
            padded = np.full((2, tokens, 8), -1)
            padded[:, :, :2] = ids
            record.update(input_ids=list(range(tokens)), positions=list(range(tokens)), extend_seq_lens=[tokens], forward_mode=1, misc_objects=[], topk_ids_of_layer=torch.as_tensor(padded, dtype=torch.int32))
        records.append(record)
        all_ids.append(ids.transpose(1, 0, 2))  # [T, L, k]
    return {"records": records, "last_physical_to_logical_map": torch.as_tensor(mapping)}, all_ids


@pytest.mark.parametrize("per_token", [False, True])
def test_convert_sglang_records(tmp_path, per_token):
    mapping = np.tile(np.array([0, 1, 2, 3, 4, 5, 0, 1]), (2, 1))
    dump, ids = sglang_records(per_token, np.random.default_rng(1), mapping)
    src = tmp_path / "expert_distribution_recorder_1.0_1.pt"
    torch.save(dump, src)
    if not per_token:
        with pytest.raises(TraceError, match="pass --top-k"):
            convert_sglang(src, tmp_path / "x.h5")
    out = convert(src, tmp_path / "sg.h5", top_k=2, ep_size=2, world_size=2, run_id="r1")
    with open_trace(out) as trace:
        assert trace.mode == ("per_token" if per_token else "per_pass")
        assert trace.id_space == "physical" and trace.num_logical_experts == 6
        assert trace.attrs["rank"] == 1 and trace.attrs["world_size"] == 2 and trace.run_id == "r1"
        assert trace.attrs["engine"] == "sglang"
    report = analyze_trace(out, window=1)
    physical = oracle_counts(ids, 8)
    np.testing.assert_array_equal(report.physical_count, physical)
    assert [w["first_pass"] for w in report.to_dict()["drift"]["windows"]] == [3, 4, 5, 7]
    assert report.to_dict()["totals"]["tokens"] == sum(len(x) for x in ids)


def test_convert_sglang_stat_and_unsafe_files(tmp_path):
    counts = np.random.default_rng(2).integers(0, 50, size=(5, 3, 16))
    counts[3:] = 0  # unused ring-buffer rows
    src = tmp_path / "stat.pt"
    torch.save({"rank": 0, "logical_count": torch.as_tensor(counts), "average_utilization_rate_over_window": None}, src)
    out = convert_sglang(src, tmp_path / "stat.h5", top_k=4, ep_size=4)
    with open_trace(out) as trace:
        assert trace.mode == "stat"
        np.testing.assert_array_equal(trace.logical_count(), counts.sum(axis=0))
        assert trace.num_passes()[0] == 3
    # A pickle with an arbitrary object is refused, never executed.
    evil = tmp_path / "evil.pt"
    torch.save({"records": [Exploding()], "last_physical_to_logical_map": torch.zeros(1, 2)}, evil)
    Exploding.loaded = False
    with pytest.raises(TraceError, match="weights-only"):
        convert_sglang(evil, tmp_path / "evil.h5")
    assert not Exploding.loaded
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(TraceError, match="cannot load"):
        convert_sglang(text, tmp_path / "t.h5")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(TraceError, match="expected a dict"):
        convert_sglang(tmp_path / "list.pt", tmp_path / "l.h5")


class Exploding:
    loaded = False

    def __reduce__(self):
        return (Exploding._mark, ())

    @staticmethod
    def _mark():
        Exploding.loaded = True
        return Exploding()


# --------------------------------------------------------------------------- JSON lines
@pytest.mark.parametrize("with_position", [False, True])
def test_convert_jsonl_layer_major_log(tmp_path, with_position):
    rng = np.random.default_rng(4)
    layers = [3, 9]
    passes = [rng.integers(0, 10, size=(int(rng.integers(2, 7)), 2, 3)) for _ in range(5)]
    lines = []
    for pass_id, ids in enumerate(passes):
        for li, layer in enumerate(layers):  # the log lists a pass layer by layer
            for t in range(len(ids)):
                obj = {"layer": layer, "topk_ids": ids[t, li].tolist(), "pass_id": pass_id}
                if with_position:
                    obj["position"] = t
                lines.append(json.dumps(obj))
    src = tmp_path / "routing.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = convert_jsonl(src, tmp_path / "log.h5", chunk=4)
    with open_trace(out) as trace:
        assert trace.mode == "per_token" and list(trace.layers) == layers and trace.top_k == 3
        rows = np.concatenate([c.topk_ids for c in trace.iter_tokens()])
        np.testing.assert_array_equal(rows, np.concatenate(passes))
    report = analyze_trace(out)
    np.testing.assert_array_equal(report.logical_count, oracle_counts(passes, 10))


def test_convert_jsonl_errors_name_the_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"layer": 0, "topk_ids": [1, 2]}\nnot json\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: not valid JSON"):
        convert_jsonl(src, tmp_path / "o.h5")
    src.write_text('{"layer": 0, "topk_ids": [1, 2], "position": 0}\n{"layer": 0, "topk_ids": [3, 4], "position": 0}\n')
    with pytest.raises(TraceError, match="two records for layer 0"):
        convert_jsonl(src, tmp_path / "o.h5")
    assert not (tmp_path / "o.h5").exists()
    src.write_text('{"topk_ids": [1]}\n')
    with pytest.raises(TraceError, match='"layer"'):
        convert_jsonl(src, tmp_path / "o.h5")
