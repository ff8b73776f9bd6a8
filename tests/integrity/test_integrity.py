"""Checksums, invariants and the error boundary on targeted damage (the fuzz test covers random damage)."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.trace import open_trace
from moetrace.trace.convert import convert_sglang
from moetrace.trace.integrity import check_seal, unsealed
from moetrace.trace.merge import merge_traces
from moetrace.trace.recover import recover
from moetrace.trace.schema import (
    MERGED_DAMAGED_ATTR,
    MERGED_RANKS_ATTR,
    TraceDamageError,
    TraceError,
    TraceHeader,
)
from moetrace.trace.verify import verify_trace
from moetrace.trace.writer import TraceWriter
from tests.analysis.helpers import files_written_here, record

from .traces import dumped, per_rank_pair, run_directory

runner = CliRunner()
TOKENS, LAYERS, TOP_K, EXPERTS = 62, 4, 4, 8


def qwen_like_stat(tmp_path, name="stat.h5"):
    """The issue's shape: 62 tokens, 4 layers, top-4 (992 assignments), through the real recorder."""
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((TOKENS, LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K]
    return record(tmp_path, "stat", [ids[:31], ids[31:]], EXPERTS, name=name)


def flip_in(path, dataset, bit=4, element=0):
    """Flip one bit of ``dataset``'s first element on disk (where its chunk is stored)."""
    with h5py.File(path, "r") as f:
        dset = f[dataset]
        start = dset.id.get_offset() if dset.chunks is None else dset.id.get_chunk_info(0).byte_offset
        offset = start + element * dset.dtype.itemsize
    data = bytearray(path.read_bytes())
    data[offset + bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def test_flipped_logical_count_bit_is_detected(tmp_path):
    path = qwen_like_stat(tmp_path)
    with open_trace(path) as trace:
        assert trace.verified and int(trace.logical_count().sum()) == 992
    flip_in(path, "stat/logical_count")  # +16 on one expert, the 1,008
    result = runner.invoke(app, ["analyze", str(path)])
    assert result.exit_code == 2, result.output
    assert "/stat/logical_count is damaged" in result.output and "moetrace verify" in result.output
    report = verify_trace(path)
    assert report.damaged == ["/stat/logical_count"] and not report.intact
    assert all(d.status == "intact" for d in report.datasets if d.name != "/stat/logical_count")


def test_without_checksums_the_invariants_catch_the_flip(tmp_path):
    """An older trace (no checksums) stays readable, is flagged unverified, and the count invariant still refuses the flip."""
    with unsealed(), files_written_here():  # unsealed() reaches this process only
        path = qwen_like_stat(tmp_path, "old.h5")
    with open_trace(path) as trace:
        assert not trace.verified and int(trace.logical_count().sum()) == 992
    result = runner.invoke(app, ["verify", str(path)])
    assert result.exit_code == 2 and "unverified" in result.output
    assert runner.invoke(app, ["verify", str(path), "--allow-unverified"]).exit_code == 0
    flip_in(path, "stat/logical_count")
    result = runner.invoke(app, ["analyze", str(path)])
    assert result.exit_code == 2, result.output
    assert "/stat/logical_count violates the trace's invariants" in result.output and "through /physical_to_logical sums to" in result.output
    flip_in(path, "stat/logical_count")  # back as it was
    flip_in(path, "stat/physical_count", bit=8)  # +256: more assignments than 62 x 4 allow
    result = runner.invoke(app, ["analyze", str(path)])
    assert result.exit_code == 2 and "/stat/logical_count" in result.output  # physical no longer sums to logical


def test_assignment_bound_names_the_figures(tmp_path):
    with unsealed(), files_written_here():  # unsealed() reaches this process only
        path = qwen_like_stat(tmp_path, "old.h5")
    with h5py.File(path, "a") as f:  # a consistent rewrite: physical and logical both +8, beyond tokens x top_k
        for name in ("stat/physical_count", "stat/logical_count"):
            data = f[name][()]
            data[0, 0, 0] += 8
            f[name][...] = data
    with open_trace(path) as trace, pytest.raises(TraceDamageError, match=r"layer 0: 256 assignments \+ 0 invalid ids = 256, more than /stat/num_tokens 62 x top_k 4 = 248"):
        trace.physical_count()


def test_chunk_order_digest_catches_a_swap_that_fletcher_passes(tmp_path):
    out = tmp_path / "chunky.h5"
    header = TraceHeader(mode="per_token", id_space="logical", num_layers=1, num_physical_experts=4, top_k=1, ep_size=1,
                         layer_ids=np.arange(1), physical_to_logical=np.arange(4)[None])
    with TraceWriter(out, header, compression={}) as writer:
        for start in range(0, 3 * 4096, 4096):  # uncompressed chunks of 4096 rows: three of equal size
            writer.append("tokens/pass_id", np.arange(start, start + 4096, dtype=np.int64))
        writer.commit()
    with h5py.File(out, "r") as f:
        infos = []
        f["tokens/pass_id"].id.chunk_iter(lambda info: infos.append((info.byte_offset, info.size)))
    assert len(infos) == 3
    (a, size), (b, size_b) = infos[0], infos[1]
    assert size == size_b
    data = bytearray(out.read_bytes())
    data[a : a + size], data[b : b + size] = data[b : b + size], data[a : a + size]
    out.write_bytes(bytes(data))
    with h5py.File(out, "r") as f:
        np.asarray(f["tokens/pass_id"][()])  # HDF5 reads it without complaint: each chunk's own Fletcher-32 holds
        assert "/tokens/pass_id" in check_seal(f, out)
    with pytest.raises(TraceDamageError, match=r"/tokens/pass_id is damaged: checksum mismatch"):
        open_trace(out)


def test_verify_json_and_exit_codes(tmp_path):
    good = dumped(tmp_path, "per_pass")
    bad = tmp_path / "bad.h5"
    shutil.copy(good, bad)
    flip_in(bad, "passes/physical_count", element=5)
    result = runner.invoke(app, ["verify", str(good), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["intact"] is True
    result = runner.invoke(app, ["verify", str(good), str(bad), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 2 and doc["intact"] is False
    assert [t["intact"] for t in doc["traces"]] == [True, False]
    damaged = [d for d in doc["traces"][1]["datasets"] if d["status"] == "damaged"]
    assert [d["name"] for d in damaged] == ["/passes/physical_count"] and "checksum" in damaged[0]["detail"]
    truncated = tmp_path / "cut.h5"
    truncated.write_bytes(good.read_bytes()[:3000])
    result = runner.invoke(app, ["verify", str(truncated)])
    assert result.exit_code == 2 and "cannot be opened" in result.output


def test_recover_keeps_the_intact_segments_and_names_the_damaged_one(tmp_path):
    run = run_directory(tmp_path, "per_token")
    (whole,) = recover(run, tmp_path / "whole.h5", force=True)
    (segment,) = [p for p in run.iterdir() if p.name.endswith("-seg000001.h5")]
    flip_in(segment, "tokens/topk_ids", element=3)
    out = tmp_path / "partial.h5"
    result = runner.invoke(app, ["recover", str(run), "-o", str(out), "--force"])
    assert result.exit_code == 2, result.output
    assert "seg000001.h5" in result.output and "left out" in result.output and "/tokens/topk_ids" in result.output
    with open_trace(out) as partial, open_trace(whole.path) as full:
        assert json.loads(str(partial.attrs["recovered_damaged"]))[0].startswith(segment.name)
        assert partial.num_rows("tokens/topk_ids") < full.num_rows("tokens/topk_ids")
        assert int(partial.attrs["recovered_segments"]) == int(full.attrs["recovered_segments"]) - 1
    assert verify_trace(out).intact


def test_merge_keeps_the_intact_ranks_and_names_the_damaged_one(tmp_path):
    rank0, rank1 = per_rank_pair(tmp_path)
    flip_in(rank1, "tokens/topk_ids", element=2)
    out = tmp_path / "merged.h5"
    result = runner.invoke(app, ["merge", str(rank0), str(rank1), "-o", str(out)])
    assert result.exit_code == 2 and "rank1.h5" in result.output and "left out" in result.output
    with open_trace(out) as merged, open_trace(rank0) as alone:
        assert json.loads(str(merged.attrs[MERGED_RANKS_ATTR])) == [0]
        assert "rank1.h5" in json.loads(str(merged.attrs[MERGED_DAMAGED_ATTR]))[0]
        np.testing.assert_array_equal(merged.read_tokens("topk_ids"), alone.read_tokens("topk_ids"))
        np.testing.assert_array_equal(merged.physical_count(), alone.physical_count())
    assert verify_trace(out).intact
    flip_in(rank0, "tokens/topk_ids", element=2)
    with pytest.raises(TraceDamageError, match="every input is damaged"):
        merge_traces([rank0, rank1], tmp_path / "none.h5")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"logical_count": torch.zeros(2, 3, dtype=torch.float32)}, "logical_count has dtype float32"),
        ({"logical_count": torch.full((2, 3), -1)}, "negative"),
        ({"records": [{"forward_pass_id": 0, "topk_ids_of_layer": torch.zeros(2, 3)}], "last_physical_to_logical_map": torch.zeros(2, 4, dtype=torch.int64)}, "topk_ids_of_layer has dtype float32"),
        ({"records": [{"forward_pass_id": 0, "topk_ids_of_layer": torch.zeros(3, 5, 8, dtype=torch.int32)}], "last_physical_to_logical_map": torch.zeros(2, 4, dtype=torch.int64)}, r"topk_ids_of_layer has shape \[3, 5, 8\], expected \[2, \*, \*\]"),
        ({"records": [], "last_physical_to_logical_map": torch.full((2, 4), 9)}, "last_physical_to_logical_map"),
        ({"records": [{"forward_pass_id": "x", "global_physical_count": torch.zeros(2, 4, dtype=torch.int64)}], "last_physical_to_logical_map": torch.zeros(2, 4, dtype=torch.int64)}, "forward_pass_id"),
    ],
)
def test_sglang_reader_checks_shapes_and_dtypes(tmp_path, data, message):
    src = tmp_path / "dump.pt"
    torch.save(data, src)
    with pytest.raises(TraceError, match=message):
        convert_sglang(src, tmp_path / "out.h5", top_k=2)
    result = runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "out.h5"), "--top-k", "2"])
    assert result.exit_code == 2 and "moetrace: error:" in result.output
    assert not (tmp_path / "out.h5").exists()


class Custom:
    """Any class: a weights-only load must not unpickle it."""


def test_sglang_reader_refuses_pickled_objects(tmp_path):
    src = tmp_path / "evil.pt"
    torch.save({"logical_count": torch.zeros(2, 3, dtype=torch.int64), "extra": Custom()}, src)
    with pytest.raises(TraceError, match="weights-only"):
        convert_sglang(src, tmp_path / "out.h5", top_k=2)
    src.write_bytes(src.read_bytes()[:40])
    with pytest.raises(TraceError, match="cannot load"):
        convert_sglang(src, tmp_path / "out.h5", top_k=2)
