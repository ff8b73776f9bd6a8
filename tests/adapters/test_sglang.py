"""The SGLang adapter's mechanics against a stand-in of SGLang's recorder and select_experts."""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import transformers as tf
from moetrace.adapters import UnsupportedVersionError
from moetrace.adapters import sglang as sgl_adapter

import moetrace
from moetrace.testing import assert_no_host_sync
from moetrace.trace.reader import open_trace

from .sglang_standin import ExpertLocationMetadata, ServerArgs, model_forward, standin_sglang

NUM_LAYERS, NUM_LOGICAL, TOP_K = 3, 8, 2
MOE_LAYERS = (1, 2)  # layer 0 is dense
# 10 physical slots: experts 0..7 plus replicas of experts 3 and 5.
PHYS_TO_LOG = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 3, 5]).repeat(NUM_LAYERS, 1)
# select_experts maps logical -> physical: expert 3 -> slot 8, expert 5 -> slot 9 (the replicas).
DISPATCH = torch.tensor([0, 1, 2, 8, 4, 9, 6, 7])


@pytest.fixture
def sgl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("MOETRACE_OUTPUT_DIR", str(tmp_path))
    monkeypatch.delenv("MOETRACE_TOP_K", raising=False)
    monkeypatch.setattr(sgl_adapter, "_PLUGIN_HANDLE", None)
    with standin_sglang() as stand_in:
        yield stand_in
    handle = sgl_adapter._PLUGIN_HANDLE
    if handle is not None:
        handle.uninstrument()


@pytest.fixture
def server_args(tmp_path: Path) -> ServerArgs:
    model_dir = tmp_path / "model"
    tf.MixtralConfig(num_local_experts=NUM_LOGICAL, num_experts_per_tok=TOP_K, num_hidden_layers=NUM_LAYERS).save_pretrained(model_dir)
    return ServerArgs(model_path=str(model_dir), expert_distribution_recorder_mode="stat")


def _start_model_runner(sgl, server_args: ServerArgs):
    """What SGLang's ModelRunner does at start-up."""
    metadata = ExpertLocationMetadata(PHYS_TO_LOG.clone())
    sgl.dist.set_global_expert_distribution_recorder(sgl.dist.ExpertDistributionRecorder.init_new(server_args, metadata, 0))
    return sgl.dist.get_global_expert_distribution_recorder()


def _logits(seed: int, tokens: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(tokens, NUM_LOGICAL, generator=gen) for layer in MOE_LAYERS}


def test_plugin_does_nothing_unless_enabled(sgl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOETRACE_ENABLED", raising=False)
    original = vars(sgl.dist.ExpertDistributionRecorder)["init_new"]
    sgl_adapter.plugin()
    assert vars(sgl.dist.ExpertDistributionRecorder)["init_new"] is original
    assert sgl_adapter._PLUGIN_HANDLE is None


def test_counts_match_sglang_and_the_routes(sgl, server_args, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOETRACE_ENABLED", "1")
    sgl_adapter.plugin()
    sgl_adapter.plugin()  # SGLang loads plugins in every process; twice is harmless
    handle = sgl_adapter._PLUGIN_HANDLE
    assert handle is not None and handle.recorder is None  # built with the model runner
    bridge = _start_model_runner(sgl, server_args)
    assert isinstance(bridge, sgl_adapter.RecorderBridge) and handle.bridge is bridge
    rec = handle.recorder
    assert moetrace.get_recorder() is rec
    cfg = rec.config
    assert (cfg.num_layers, cfg.num_physical_experts, cfg.top_k, cfg.engine) == (NUM_LAYERS, 10, TOP_K, "sglang")
    assert cfg.num_logical_experts == NUM_LOGICAL and rec.id_space == "physical"

    bridge.start_record()  # what POST /start_expert_distribution_record does
    expected = torch.zeros(NUM_LAYERS, 10, dtype=torch.int64)
    for pass_id, (tokens, non_padded) in enumerate([(12, None), (4, 3), (4, 4), (8, 5)]):
        chosen = model_forward(sgl, pass_id, _logits(pass_id, tokens), TOP_K, NUM_LAYERS, DISPATCH, non_padded)
        for layer, ids in chosen.items():
            valid = ids[ids >= 0]
            expected[layer] += torch.bincount(valid, minlength=10)
    snap = rec.snapshot()
    assert snap.num_passes == 4
    np.testing.assert_array_equal(snap.physical_count, expected.numpy())
    np.testing.assert_array_equal(snap.physical_count, bridge.sglang.counts.numpy())  # SGLang's own recorder saw the same
    assert snap.physical_count[0].sum() == 0  # the dense layer
    logical = snap.logical_count
    assert logical[:, 3].sum() == expected[:, [3, 8]].sum() and logical.shape == (NUM_LAYERS, NUM_LOGICAL)

    assert bridge.dump_record("object")["logical_count"].sum() == expected.sum()
    assert not list(tmp_path.glob("moetrace-*.h5"))  # EPLB's object dumps write no moetrace file
    bridge.dump_record("file")
    assert bridge.sglang.dumps == ["object", "file"]
    (path,) = tmp_path.glob("moetrace-*.h5")
    with open_trace(path) as trace:
        assert trace.attrs["engine"] == "sglang"
        np.testing.assert_array_equal(trace.physical_count(), expected.numpy())
    bridge.stop_record()
    assert not rec.recording and not bridge.sglang.recording


def test_uninstrument_restores_sglang_exactly(sgl, server_args, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = sgl.dist.ExpertDistributionRecorder
    original = vars(cls)["init_new"]
    handle = sgl_adapter.instrument()
    assert sgl_adapter.instrument() is handle
    assert isinstance(vars(cls)["init_new"], staticmethod) and vars(cls)["init_new"] is not original
    bridge = _start_model_runner(sgl, server_args)
    inner = bridge.sglang
    assert handle.uninstrument() == []
    assert vars(cls)["init_new"] is original
    assert sgl.dist.get_global_expert_distribution_recorder() is inner
    assert isinstance(cls.init_new(server_args, ExpertLocationMetadata(PHYS_TO_LOG), 0), sgl.dist._ExpertDistributionRecorderReal)


def test_late_plugin_bridges_the_existing_recorder(sgl, server_args) -> None:
    inner = _start_model_runner(sgl, server_args)
    handle = sgl_adapter.instrument(mode="per_pass")
    bridge = sgl.dist.get_global_expert_distribution_recorder()
    assert bridge is handle.bridge and bridge.sglang is inner and handle.recorder.mode == "per_pass"
    handle.uninstrument()
    assert sgl.dist.get_global_expert_distribution_recorder() is inner


def test_sglang_noop_recorder_keeps_its_lifecycle_and_moetrace_records(sgl, server_args) -> None:
    server_args.expert_distribution_recorder_mode = None
    handle = sgl_adapter.instrument()
    bridge = _start_model_runner(sgl, server_args)
    assert isinstance(bridge.sglang, sgl.dist._ExpertDistributionRecorderNoop)
    bridge.start_record()  # SGLang's no-op would raise; the bridge starts moetrace only
    model_forward(sgl, 0, _logits(0, 5), TOP_K, NUM_LAYERS)
    assert handle.recorder.snapshot().physical_count.sum() == 5 * TOP_K * len(MOE_LAYERS)
    assert bridge.recording
    handle.uninstrument()


def test_a_moetrace_error_never_reaches_sglang(sgl, server_args, caplog: pytest.LogCaptureFixture) -> None:
    handle = sgl_adapter.instrument()
    bridge = _start_model_runner(sgl, server_args)
    bridge.start_record()
    with caplog.at_level(logging.ERROR):
        # e.g. fused shared experts append a column: 3 ids per token where moetrace expects top_k=2
        model_forward(sgl, 0, _logits(0, 4), 3, NUM_LAYERS)
    assert bridge.error is not None and "top_k=2" in bridge.error
    assert "recording disabled" in caplog.text
    assert bridge.sglang.counts.sum() == 4 * 3 * len(MOE_LAYERS)  # SGLang's recorder unaffected
    model_forward(sgl, 1, _logits(1, 4), TOP_K, NUM_LAYERS)  # and later passes still run
    handle.uninstrument()


def test_bridge_hooks_never_sync_host_and_device(sgl, server_args) -> None:
    handle = sgl_adapter.instrument()
    bridge = _start_model_runner(sgl, server_args)
    bridge.start_record()
    ids = torch.randint(0, 10, (6, TOP_K))
    with bridge.with_forward_pass(0, None), bridge.with_current_layer(1), assert_no_host_sync():
        handle.recorder.on_select_experts(ids, layer=1)
        bridge.moetrace.on_select_experts(ids, layer=2)
    assert handle.recorder.snapshot().physical_count.sum() == 2 * 6 * TOP_K
    handle.uninstrument()


def test_unsupported_sglang_versions_are_refused(sgl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang.srt.eplb.expert_distribution", None)
    with pytest.raises(UnsupportedVersionError, match=r"0\.5\.0 has no sglang\.srt\.eplb"):
        sgl_adapter.instrument()
    monkeypatch.undo()

    def init_new(server_args, metadata):  # an incompatible signature
        return None

    with standin_sglang() as other:
        other.dist.ExpertDistributionRecorder.init_new = staticmethod(init_new)
        with pytest.raises(UnsupportedVersionError, match="init_new takes"):
            sgl_adapter.instrument()
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        sgl_adapter.instrument()


def test_capturer_is_refused_with_a_reason(sgl) -> None:
    with pytest.raises(moetrace.adapters.AdapterError, match="enable-return-routed-experts"):
        sgl_adapter.instrument(capturer=object())


def test_entry_point_is_declared() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["sglang.srt.plugins"]["moetrace"]
    module, _, func = target.partition(":")
    assert module == "moetrace.adapters.sglang" and func == "plugin"
    assert inspect.isfunction(sgl_adapter.plugin)
