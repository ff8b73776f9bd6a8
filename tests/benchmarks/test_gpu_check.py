"""The CPU-side parts of ``make gpu-check`` (benchmarks/gpu_check.py), so the script cannot rot."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from moetrace.reference.moe import MoELayer
from moetrace.testing import assert_no_host_sync

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCH))


def test_without_cuda_it_skips_and_exits_zero(gpu_check, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: GPU checks skipped"


def test_arguments(gpu_check):
    args = gpu_check.parse_args([])
    assert (args.sizes, args.rounds, args.no_docs) == ("dsv3", 20, False)
    assert gpu_check.parse_args(["--quick"]).rounds == 5
    assert gpu_check.parse_args(["--sizes", "tiny", "--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sizes", "huge"])



@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_tiny_workload_builds_runs_and_matches_the_oracle(gpu_check, mode, tmp_path):
    sizes = gpu_check.SIZES["tiny"]
    layer = gpu_check.build_layer(sizes, "cpu", torch.float32, max_tokens=sizes.prefill_tokens)
    oracle = MoELayer(layer.router, layer.experts, capacity_factor=sizes.capacity_factor)
    rec = gpu_check.make_recorder(mode, sizes, "cpu", tmp_path, sizes.prefill_tokens, timing=True)
    x = torch.randn(sizes.prefill_tokens, sizes.hidden)
    with torch.no_grad(), assert_no_host_sync(), rec.with_forward_pass():
        got = layer(x, rec)
    with torch.no_grad():
        want = oracle(x, gpu_check.NoOpRecorder())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rec.num_passes == 1
    counts = rec.snapshot().physical_count
    assert counts.shape == (1, sizes.experts) and counts.sum() == sizes.prefill_tokens * sizes.top_k
    rec.stop_record()
    rec.reset()


def test_random_ids_have_padding(gpu_check):
    ids = gpu_check._random_ids(16, gpu_check.SIZES["tiny"], "cpu", seed=0)
    assert ids.shape == (16, 4) and (ids[:, -1] == -1).sum() == 2 and ids.max() < 16


def test_table_fits_80_columns(gpu_check):
    rows = [
        gpu_check.CheckResult("sync-debug", "stat hooks, 50 passes", True, "no synchronising call"),
        gpu_check.CheckResult("cuda-graph", "EP padded layer, stat mode, on/off/on " * 3, False, "AssertionError: " + "x" * 200),
        gpu_check.CheckResult("overhead", "prefill (8192 tok): stat / plain", None, "1.004 (12.345 ms)"),
    ]
    table = gpu_check.format_table(rows)
    lines = table.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert [line.split()[0] for line in lines[2:]] == ["sync-debug", "cuda-graph", "overhead"]
    assert "PASS" in lines[2] and "FAIL" in lines[3] and " - " in lines[4]


def test_docs_section_is_replaced_between_markers(gpu_check, tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n{gpu_check.START}\nold\n{gpu_check.END}\n\n## after\n")
    monkeypatch.setattr(gpu_check, "DOCS", docs)
    gpu_check.write_docs_section("TABLE", "NVIDIA H200", "python benchmarks/gpu_check.py")
    text = docs.read_text()
    assert "old" not in text and "TABLE" in text and "NVIDIA H200" in text and text.endswith("## after\n")


def test_dsv3_sizes_are_deepseek_v3(gpu_check):
    s = gpu_check.SIZES["dsv3"]
    assert (s.hidden, s.intermediate, s.experts, s.top_k, s.prefill_tokens, s.decode_tokens) == (7168, 2048, 256, 8, 8192, 64)
