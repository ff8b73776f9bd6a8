"""The CPU-side parts of ``make gpu-check`` (benchmarks/gpu_check.py), so the script cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetrace.reference.moe import MoELayer
from moetrace.testing import assert_no_host_sync

from . import benchmark_module


@pytest.fixture(scope="module")
def gpu_check():
    with benchmark_module("gpu_check") as m:
        yield m


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



def test_the_pass_bound_row_runs_on_cpu(gpu_check, tmp_path):
    """Row 6's figures come from benchmarks/pass_bound.py's cases: one row per mode, with the off / on figures."""
    rows = gpu_check.check_pass_bound(torch.device("cpu"), tmp_path, seconds=0.3)
    assert [r.case.split(":")[0] for r in rows] == ["stat", "per_pass", "per_token"]
    assert all(r.check == "pass-bound" and r.ok is None and "over median+5 ms" in r.detail for r in rows)


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


# ----------------------------------------------------------------------------- the checks' logic on CPU
CPU = torch.device("cpu")


@pytest.mark.parametrize(("mode", "timing"), [("stat", False), ("per_pass", False), ("per_token", False), ("stat", True), ("per_token", True)])
def test_sync_check_passes_and_reaches_every_flush_checkpoint_and_rotation(gpu_check, tmp_path, mode, timing):
    detail = gpu_check.sync_check(CPU, tmp_path, mode, timing)
    counts = dict(part.split(" ", 1)[::-1] for part in detail.split(": ", 1)[1].split(", "))
    assert int(counts["rotations"]) > 0
    assert int(counts["checkpoints" if mode == "stat" else "flushes"]) > 0
    if timing and mode != "stat":
        assert int(counts["timing flushes"]) > 0


def test_sync_check_fails_when_a_path_is_not_reached(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.SHRUNK, "segment_seconds", 3600.0)  # no rotation falls due
    with pytest.raises(AssertionError, match="never reached: rotations"):
        gpu_check.sync_check(CPU, tmp_path, "per_pass")


@pytest.mark.parametrize("sabotage", ["inject_item", "inject_event_synchronize"])
def test_sync_controls_are_caught(gpu_check, tmp_path, sabotage):
    row = gpu_check._control("sync-debug", sabotage, lambda: gpu_check.sync_check(CPU, tmp_path, "per_token", sabotage=getattr(gpu_check, sabotage)))
    assert row.ok is True and "HostSyncError" in row.detail, row
    row = gpu_check._control("sync-debug", sabotage, lambda: gpu_check.capturer_sync_check(CPU, sabotage=getattr(gpu_check, sabotage)))
    assert row.ok is True and "HostSyncError" in row.detail, row
    assert gpu_check.capturer_sync_check(CPU).startswith("60 passes")


def test_tripwire_refuses_event_waits_and_restores_them(gpu_check):
    before = {name: torch.cuda.Event.__dict__.get(name) for name in ("synchronize",)}, torch.cuda.synchronize
    with gpu_check.event_sync_tripwire() as refused:
        with pytest.raises(gpu_check.HostSyncError, match="invisible to sync-debug"):
            gpu_check.inject_event_synchronize(torch.zeros(1))
        with pytest.raises(gpu_check.HostSyncError):
            torch.cuda.synchronize()
    assert refused == ["Event.synchronize", "torch.cuda.synchronize"]
    assert ({name: torch.cuda.Event.__dict__.get(name) for name in ("synchronize",)}, torch.cuda.synchronize) == before


def test_a_control_that_is_not_caught_fails(gpu_check):
    row = gpu_check._control("x", "a check that passes on a broken part", lambda: "looked fine")
    assert row.ok is False and "NOT caught" in row.detail


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_graph_check_on_cpu_graphs(gpu_check, tmp_path, mode):
    detail = gpu_check.graph_check(CPU, tmp_path, mode)
    assert "captured before recording" in detail and "exact" in detail


def test_graph_check_fails_with_a_gate_stuck_on(gpu_check, tmp_path):
    row = gpu_check._control("cuda-graph", "gate stuck on", lambda: gpu_check.graph_check(CPU, tmp_path, "stat", break_gate=True))
    assert row.ok is True and "the gate let them through" in row.detail, row


def test_capturer_check_and_its_control(gpu_check):
    assert "exact" in gpu_check.capturer_check(CPU)
    row = gpu_check._control("capturer", "wrong rows", lambda: gpu_check.capturer_check(CPU, wrong_rows=True))
    assert row.ok is True and "differ" in row.detail, row


def test_table_and_json_are_written_when_a_check_raises(gpu_check, monkeypatch, capsys):
    written = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "stand-in GPU")

    def explode(args, out):
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(gpu_check, "run_checks", explode)
    monkeypatch.setattr(gpu_check, "write_results", lambda name, data: written.update(data) or Path("results.json"))
    assert gpu_check.main(["--no-docs"]) == 1
    out = capsys.readouterr().out
    assert "the script itself" in out and "FAIL" in out
    assert written["results"][0]["detail"] == "RuntimeError: set-up failed" and written["device"] == "stand-in GPU"


def test_window_cut_check_and_its_control(gpu_check, tmp_path):
    assert gpu_check.window_cut_check(CPU, tmp_path).startswith("8-slot window, 6 passes overwrote it")
    row = gpu_check._control("sync-debug", "blind", lambda: gpu_check.window_cut_check(CPU, tmp_path / "blind", blind_pass_ends=True))
    assert row.ok, row.detail
    assert "overwritten before it was copied" in row.detail
