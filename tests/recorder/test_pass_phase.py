"""The pass phase of every pass (prefill, decode, mixed, idle): counted per phase, exactly, in every mode.

The reference model's routers add a per-pass-phase bias (``ModelConfig.phase_router_bias``), so that
prefill and decode route to different hot experts by construction. The hand count is independent of
the recorder: a torch forward hook on each router keeps the ids it returned, labelled with the phase
the test ran, and numpy counts them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.pass_phase import PASS_PHASES, pass_phase_code
from moetrace.reference.gate import TopKRouter
from moetrace.reference.model import ModelConfig, ReferenceMoEModel
from moetrace.testing import HostSyncError, assert_no_host_sync
from moetrace.trace import open_trace
from moetrace.trace.pass_phases import has_pass_phases, pass_phase_counts, pass_phase_physical_count
from moetrace.trace.schema import Data
from tests.recorder.helpers import captured_hooks, numpy_counts

EXPERTS, TOP_K, HOT = 8, 2, 4.0
PREFILL, DECODE, IDLE = (pass_phase_code(p) for p in ("prefill", "decode", "idle"))


def biased_model() -> ReferenceMoEModel:
    """Prefill routes mostly to experts 0 and 1, decode to experts 6 and 7 (a logit bias of +4)."""
    prefill = tuple(HOT if e in (0, 1) else 0.0 for e in range(EXPERTS))
    decode = tuple(HOT if e in (6, 7) else 0.0 for e in range(EXPERTS))
    config = ModelConfig(num_layers=3, num_experts=EXPERTS, top_k=TOP_K, phase_router_bias=(("prefill", prefill), ("decode", decode)), seed=3)
    return ReferenceMoEModel(config)


class RouteLog:
    """What each router returned, per pass phase (a torch forward hook: independent of moetrace)."""

    def __init__(self, model: ReferenceMoEModel) -> None:
        self.phase = "unknown"
        self.ids: dict[str, list[list[np.ndarray]]] = {}
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(lambda _m, _x, out, layer=layer: self._keep(layer, out[0]))

    def _keep(self, layer: int, ids: torch.Tensor) -> None:
        passes = self.ids.setdefault(self.phase, [])
        if layer == 0:
            passes.append([])
        passes[-1].append(ids.numpy().copy())

    def counts(self, phase: str) -> np.ndarray:
        """``[L, E]`` the hand count of one pass phase."""
        passes = self.ids.get(phase, [])
        return numpy_counts(passes, EXPERTS)[0] if passes else np.zeros((len(self.routers), EXPERTS), np.int64)


def run(tmp_path, mode: str) -> tuple[ExpertDistributionRecorder, RouteLog, dict[str, int]]:
    """Two prefill passes ([2, 6] prompts), six decode passes ([2, 1]), one idle pass (no MoE work)."""
    model = biased_model()
    rec = ExpertDistributionRecorder(model.recorder_config(mode=mode, output_dir=tmp_path, max_tokens_per_pass=16, window=16,
                                                            stream_chunk_passes=3, stream_chunk_tokens=16, segment_seconds=0))
    log = RouteLog(model)
    gen = torch.Generator().manual_seed(0)
    rec.start_record()
    requests = {"prefill": 0, "decode": 0, "idle": 0}
    schedule = ["prefill", "prefill", *["decode"] * 6, "idle"]
    with torch.inference_mode():
        for phase in schedule:
            log.phase = phase
            model.set_pass_phase(phase)
            if phase == "idle":
                rec.set_pass_phase(phase, num_requests=0)
                with rec.with_forward_pass():
                    pass
                continue
            length = 6 if phase == "prefill" else 1
            rec.set_pass_phase(phase, num_requests=2)
            requests[phase] += 2
            model(torch.randint(0, 256, (2, length), generator=gen), recorder=rec)
    return rec, log, requests


def hot(counts: np.ndarray, n: int = 2) -> list[list[int]]:
    """The ``n`` hottest experts of each layer ``[L, E]``, hottest first (ties by id)."""
    return [sorted(np.argsort(-row, kind="stable")[:n].tolist()) for row in counts]


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_per_phase_hot_experts_equal_a_hand_count(tmp_path, mode):
    rec, log, requests = run(tmp_path, mode)
    prefill, decode = log.counts("prefill"), log.counts("decode")
    assert hot(prefill) == [[0, 1]] * 3 and hot(decode) == [[6, 7]] * 3  # the construction: phases route apart

    snap = rec.snapshot()
    np.testing.assert_array_equal(snap.pass_phase_physical_count[PREFILL], prefill)
    np.testing.assert_array_equal(snap.pass_phase_physical_count[DECODE], decode)
    np.testing.assert_array_equal(snap.pass_phase_physical_count.sum(axis=0), snap.physical_count)
    assert snap.pass_phase_num_passes.tolist() == [0, 2, 6, 0, 1]
    assert snap.pass_phase_num_tokens.tolist() == [0, 24, 12, 0, 0]
    assert snap.pass_phase_num_requests[[PREFILL, DECODE, IDLE]].tolist() == [requests["prefill"], requests["decode"], 0]

    with open_trace(rec.dump_record(tmp_path / f"{mode}.h5")) as trace:
        assert has_pass_phases(trace)
        by_phase = pass_phase_physical_count(trace)  # [Q, L, P] over the counted rank rows
        np.testing.assert_array_equal(by_phase[PREFILL], prefill)
        np.testing.assert_array_equal(by_phase[DECODE], decode)
        assert hot(by_phase[PREFILL]) == hot(prefill) and hot(by_phase[DECODE]) == hot(decode)
        passes, tokens, reqs = pass_phase_counts(trace)
        assert passes.tolist() == [0, 2, 6, 0, 1] and tokens.tolist() == [0, 24, 12, 0, 0] and reqs[DECODE] == requests["decode"]
        if mode == "stat":
            assert trace.window().pass_phase[0].tolist() == [PREFILL] * 2 + [DECODE] * 6 + [IDLE]
        elif mode == "per_pass":
            phases = np.concatenate([c.pass_phase for c in trace.iter_passes()])
            assert phases.tolist() == [PREFILL] * 2 + [DECODE] * 6 + [IDLE]
            assert trace._read(Data.PASSES_NUM_REQUESTS).tolist() == [2] * 8 + [0]
            kept = sum(c.physical_count.sum(axis=0) for c in trace.iter_passes(phase=DECODE))
            np.testing.assert_array_equal(kept, decode)
        else:
            chunks = list(trace.iter_tokens(phase=PREFILL))
            ids = np.concatenate([c.topk_ids for c in chunks])  # [M, L, k]
            assert len(ids) == 24 and all((c.pass_phase == PREFILL).all() for c in chunks)
            np.testing.assert_array_equal(np.stack([np.bincount(ids[:, layer].ravel(), minlength=EXPERTS) for layer in range(3)]), prefill)


def test_a_pass_nobody_names_is_unknown_and_bad_names_are_refused(tmp_path):
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, output_dir=tmp_path))
    rec.start_record()
    rec.set_pass_phase("decode", num_requests=1)
    for _ in range(2):  # the phase holds for one pass only
        with rec.with_forward_pass(), rec.with_current_layer(0):
            rec.on_select_experts(torch.tensor([[1]]))
    snap = rec.snapshot()
    assert snap.pass_phase_num_passes.tolist() == [1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="unknown pass phase 'extend'"):
        rec.set_pass_phase("extend")
    with pytest.raises(ValueError, match="outside"):
        rec.set_pass_phase(len(PASS_PHASES))
    with pytest.raises(ValueError, match="phase_bias"):
        TopKRouter(8, 4, 1, phase_bias={"extend": torch.zeros(4)})


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_graph_replays_count_into_the_phase_each_pass_end_names(tmp_path, mode):
    """Capture the hooks once (recording off), then replay with a phase set on the host before each
    pass: every replay counts into its own phase, and nothing syncs (pass ends included)."""
    layers, batch = 2, 4
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path,
                                                    max_tokens_per_pass=batch, stream_chunk_passes=3, stream_chunk_tokens=16, segment_seconds=0))
    ids = torch.full((layers, batch, TOP_K), -1, dtype=torch.int64)
    graph = captured_hooks(rec, ids)
    rec.start_record()
    rng = np.random.default_rng(1)
    expected = np.zeros((len(PASS_PHASES), layers, EXPERTS), np.int64)
    with assert_no_host_sync():
        for i in range(12):
            phase = (PREFILL, DECODE, pass_phase_code("mixed"))[i % 3]
            real = np.stack([[rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(1 + i % batch)] for _ in range(layers)])
            ids.fill_(-1)
            ids[:, : real.shape[1]] = torch.as_tensor(real)
            expected[phase] += numpy_counts([list(real)], EXPERTS)[0]
            rec.set_pass_phase(phase, num_requests=real.shape[1])
            with rec.with_forward_pass():
                graph.replay()
    np.testing.assert_array_equal(rec.snapshot().pass_phase_physical_count, expected)


class _PhaseFromDevice(ExpertDistributionRecorder):
    """Negative control: a recorder that keeps the phase on the device and reads it back at pass end."""

    def set_pass_phase(self, phase, num_requests=-1):
        self._device_phase = torch.tensor(pass_phase_code(phase))

    def _end_pass(self, pass_id):
        self._pass_phase = int(self._device_phase)  # a host read of a device value: a sync
        super()._end_pass(pass_id)


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_hooks_with_pass_phases_have_no_host_sync_and_the_check_can_fail(tmp_path, mode):
    config = RecorderConfig(num_layers=3, num_physical_experts=16, top_k=4, ep_size=2, mode=mode, output_dir=tmp_path, window=4,
                            stream_chunk_passes=3, stream_chunk_tokens=64, max_tokens_per_pass=32)
    ids, send = torch.randint(-1, 20, (32, 4)), torch.tensor([3, 5])
    for recorder, fails in ((ExpertDistributionRecorder(config), False), (_PhaseFromDevice(config.replace(output_dir=tmp_path / "neg")), True)):
        recorder.start_record()
        try:
            with assert_no_host_sync():
                for i in range(10):  # wraps the window and hands chunks to the writer
                    recorder.set_pass_phase(PASS_PHASES[1 + i % 4], num_requests=0 if i % 4 == 3 else i + 1)  # idle: none
                    with recorder.with_forward_pass():
                        for layer in range(3):
                            with recorder.with_current_layer(layer):
                                recorder.on_select_experts(ids)
                                recorder.on_dispatch(send, send)
        except HostSyncError:
            assert fails, "the real recorder synchronised"
        else:
            assert not fails, "the negative control's device read went unnoticed"
            assert recorder.snapshot().pass_phase_num_passes.tolist() == [0, 3, 3, 2, 2]
        recorder.stop_record()


def test_analyze_and_placement_split_by_phase(tmp_path):
    """``moetrace analyze --phase`` and ``moetrace placement --phase`` read only that pass phase's passes."""
    from moetrace.cli.app import app
    from typer.testing import CliRunner

    rec, log, _ = run(tmp_path, "per_pass")
    path = rec.dump_record(tmp_path / "phases.h5")
    runner = CliRunner()
    for phase in ("prefill", "decode"):
        result = runner.invoke(app, ["analyze", str(path), "--phase", phase, "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        counts = log.counts(phase)
        assert report["pass_phase"] == phase and report["totals"]["assignments"] == int(counts.sum())
        assert report["totals"]["passes"] == (2 if phase == "prefill" else 6)
        assert [sorted(e["expert"] for e in layer["hottest"][:2]) for layer in report["per_layer"]] == hot(counts)
        result = runner.invoke(app, ["placement", str(path), "--gpus", "2", "--phase", phase, "--json"])
        assert result.exit_code == 0, result.output
        plan = json.loads(result.output)
        assert plan["pass_phase"] == phase and sum(map(sum, plan["gpu_load"])) == pytest.approx(counts.sum())
    result = runner.invoke(app, ["analyze", str(path), "--phase", "extend"])
    assert result.exit_code == 2 and "--phase 'extend'" in result.output


def test_the_report_reads_one_phase_on_request(tmp_path):
    pytest.importorskip("plotly")
    from moetrace.report.evidence import gather_evidence

    rec, log, _ = run(tmp_path, "per_token")
    path = rec.dump_record(tmp_path / "phases.h5")
    for phase in ("prefill", "decode"):
        evidence = gather_evidence([path], phase=phase)
        assert evidence.expert is not None and evidence.expert.report.pass_phase == phase
        np.testing.assert_array_equal(evidence.expert.report.logical_count, log.counts(phase))
        assert evidence.expert.series is not None and int(evidence.expert.series.passes.sum()) == (2 if phase == "prefill" else 6)


@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_verify_adds_each_phase_rows_up_and_catches_a_relabelled_pass(tmp_path, mode):
    """``moetrace verify`` sums each pass phase's streamed rows against ``/stat``; a pass whose phase was
    rewritten (the negative control, written back with fresh checksums) is named."""
    import h5py

    from moetrace.trace.integrity import reseal
    from moetrace.trace.invariants import check_rows_against_stat
    from moetrace.trace.schema import TraceDamageError

    rec, _, _ = run(tmp_path, mode)
    path = rec.dump_record(tmp_path / "phases.h5")
    with open_trace(path) as trace:
        check_rows_against_stat(trace)
    column = Data.PASSES_PASS_PHASE if mode == "per_pass" else Data.TOKENS_PASS_PHASE
    with h5py.File(path, "r+") as f:
        values = f[column][()]
        values[0] = DECODE  # the first prefill pass (or token) relabelled as decode
        f[column][...] = values
    reseal(path)
    with open_trace(path) as trace, pytest.raises(TraceDamageError, match="pass phase prefill"):
        check_rows_against_stat(trace)
