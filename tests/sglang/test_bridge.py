"""The bridge against SGLang's real recorder classes in this process (no engine): what the live tests cannot provoke.

SGLang's runtime context is published from a real ``ServerArgs`` (as its
scheduler does), the ``ExpertLocationMetadata`` is built with SGLang's own
constructor (10 physical slots: experts 0..7 plus replicas of 3 and 5), and
SGLang's model runner is played by calling ``ExpertDistributionRecorder.init_new``
and the recorder's context managers in the order ``model_runner.forward`` does.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moetrace.adapters import UnsupportedVersionError
from moetrace.adapters import sglang as adapter
from moetrace.adapters.failsafe import FailSafe

from moetrace.recorder import ExpertDistributionRecorder
from moetrace.testing import assert_no_host_sync
from moetrace.trace.reader import open_trace

from ..engines import environment
from .checkpoint import NUM_EXPERTS, NUM_LAYERS, TOP_K, build_checkpoint
from .engine import CPU_ENV

REPLICAS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 3, 5])
PHYSICAL = len(REPLICAS)


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))
    with environment(CPU_ENV):  # before SGLang's modules load: they read it at import
        from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
        from sglang.srt.server_args import ServerArgs

        reset_context()
        publish(ServerArgs(model_path=str(checkpoint), device="cpu", expert_distribution_recorder_mode="stat"), role="test", ranks=SpawnRanks(world_rank=0))
        try:
            yield
        finally:
            reset_context()


@pytest.fixture
def out(context: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOETRACE_OUTPUT_DIR", str(tmp_path))
    return tmp_path


def _metadata(physical_to_logical: torch.Tensor) -> Any:
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        _compute_logical_to_all_physical_map,
    )

    mapping = physical_to_logical.repeat(NUM_LAYERS, 1)
    return ExpertLocationMetadata._init_raw(
        ep_size=1, physical_to_logical_map=mapping, moe_ep_rank=0,
        logical_to_all_physical_map=_compute_logical_to_all_physical_map(mapping, NUM_EXPERTS, 1, 0),
    )


def _module() -> Any:
    from sglang.srt.eplb import expert_distribution

    return expert_distribution


def _pass(recorder: Any, pass_id: int, ids_of_layer: dict[int, torch.Tensor]) -> Any:
    """One forward pass as SGLang's model runner and decoder layers drive the global recorder."""
    with recorder.with_forward_pass(pass_id, None) as outputs:
        for layer, ids in ids_of_layer.items():
            with recorder.with_current_layer(layer):
                recorder.on_select_experts(topk_ids=ids)
    return outputs


@pytest.fixture
def bridged(out: Path) -> Iterator[tuple[Any, Any]]:
    handle = adapter.instrument()
    module = _module()
    metadata = _metadata(REPLICAS)
    module.set_global_expert_distribution_recorder(module.ExpertDistributionRecorder.init_new(metadata, 0))
    yield handle, metadata
    handle.uninstrument()


def test_bridge_counts_physical_ids_and_yields_sglangs_outputs(bridged: tuple[Any, Any], out: Path) -> None:
    handle, _ = bridged
    bridge = _module().get_global_expert_distribution_recorder()
    assert isinstance(bridge, adapter.RecorderBridge) and bridge is handle.bridge
    cfg = handle.recorder.config
    assert (cfg.num_layers, cfg.num_physical_experts, cfg.top_k, cfg.engine) == (NUM_LAYERS, PHYSICAL, TOP_K, "sglang")
    bridge.start_record()
    outputs = _pass(bridge, 0, {1: torch.tensor([[0, 8], [9, -1]])})  # -1: a padded row's slot
    assert outputs == {}  # SGLang's own dict (the model runner reads .get("metrics"))
    counts = handle.recorder.snapshot().physical_count
    assert counts[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 1, 1] and counts.sum() == 3
    np.testing.assert_array_equal(handle.recorder.snapshot().logical_count[1], [1, 0, 0, 1, 0, 1, 0, 0])


def test_hooks_never_sync_host_and_device(bridged: tuple[Any, Any]) -> None:
    handle, _ = bridged
    bridge = handle.bridge
    bridge.start_record()
    ids = torch.randint(0, PHYSICAL, (6, TOP_K))
    with bridge.with_forward_pass(0, None), bridge.with_current_layer(2), assert_no_host_sync():
        bridge.on_select_experts(topk_ids=ids)
    assert handle.recorder.snapshot().physical_count.sum() == 6 * TOP_K


def test_each_pass_counts_into_the_phase_of_sglangs_forward_mode(bridged: tuple[Any, Any]) -> None:
    """The bridge names each pass's phase from SGLang's own ForwardMode enum (host fields only)."""
    from types import SimpleNamespace

    from moetrace.adapters.sglang.bridge import SGLANG_PASS_PHASES
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    handle, _ = bridged
    bridge = handle.bridge
    bridge.start_record()
    ids = torch.randint(0, PHYSICAL, (3, TOP_K))
    for mode, requests in ((ForwardMode.EXTEND, 2), (ForwardMode.DECODE, 3), (ForwardMode.DECODE, 3), (ForwardMode.MIXED, 4), (ForwardMode.IDLE, 0)):
        with bridge.with_forward_pass(0, SimpleNamespace(forward_mode=mode, batch_size=requests)), bridge.with_current_layer(1), assert_no_host_sync():
            bridge.on_select_experts(topk_ids=ids)
    _pass(bridge, 1, {1: ids})  # no forward batch: unknown
    snap = handle.recorder.snapshot()
    assert snap.pass_phase_num_passes.tolist() == [1, 1, 2, 1, 1]  # unknown, prefill, decode, mixed, idle
    assert snap.pass_phase_num_requests.tolist() == [0, 2, 6, 4, 0]
    assert {m.name for m in ForwardMode} <= set(SGLANG_PASS_PHASES), "a ForwardMode of this SGLang has no pass phase"


def test_a_moetrace_error_is_logged_once_and_never_reaches_sglang(bridged: tuple[Any, Any], caplog: pytest.LogCaptureFixture) -> None:
    handle, _ = bridged
    bridge = handle.bridge
    bridge.start_record()
    gatherer = bridge.sglang._single_pass_gatherers["primary"]
    with caplog.at_level(logging.WARNING):
        # e.g. fused shared experts append a column: 3 ids per token where moetrace expects top_k=2
        _pass(bridge, 0, {0: torch.tensor([[1, 2, 3]]), 1: torch.tensor([[1, 2, 3]])})
    assert bridge.error is not None and "top_k=2" in bridge.error and bridge.failsafe is handle.failsafe
    assert caplog.text.count("moetrace is off for this SGLang engine") == 1
    assert int(gatherer._data.sum()) == 6  # SGLang's recorder counted every id of both layers
    _pass(bridge, 1, {0: torch.tensor([[1, 2]])})  # later passes run, moetrace stays off
    assert handle.recorder.snapshot().physical_count.sum() == 0


def test_fused_count_buffer_is_declined_while_moetrace_records(bridged: tuple[Any, Any]) -> None:
    handle, _ = bridged
    bridge = handle.bridge
    bridge.start_record()
    with bridge.with_forward_pass(0, None):
        assert bridge.get_current_pass_count_buffer(0) is None  # SGLang takes its unfused path: on_select_experts
    bridge.stop_record()
    bridge.sglang.start_record()  # SGLang recording alone: its own buffer
    with bridge.with_forward_pass(1, None):
        theirs = bridge.sglang.get_current_pass_count_buffer(0)
        assert theirs is not None and bridge.get_current_pass_count_buffer(0).data_ptr() == theirs.data_ptr()


def test_eplb_rebalance_dumps_under_the_old_map_then_remaps(bridged: tuple[Any, Any], out: Path) -> None:
    handle, metadata = bridged
    bridge = handle.bridge
    bridge.start_record()
    _pass(bridge, 0, {0: torch.tensor([[8, 9]])})  # replicas of 3 and 5
    rebalanced = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1, 2])
    metadata.update(_metadata(rebalanced), update_layer_ids=list(range(NUM_LAYERS)))  # what EPLB's updater calls
    (before,) = out.glob("moetrace-*.h5")
    with open_trace(before) as trace:
        assert trace.logical_count()[0].tolist() == [0, 0, 0, 1, 0, 1, 0, 0]
    np.testing.assert_array_equal(handle.recorder.config.physical_to_logical[0], rebalanced.numpy())
    _pass(bridge, 1, {0: torch.tensor([[8, 9]])})  # the same slots now hold experts 1 and 2
    assert handle.recorder.snapshot().logical_count[0].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]  # only the new map's pass
    metadata.update(_metadata(rebalanced), update_layer_ids=[0])  # no change: no dump
    assert len(list(out.glob("moetrace-*.h5"))) == 1


def test_late_plugin_bridges_the_existing_recorder_and_uninstrument_restores(out: Path) -> None:
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    module = _module()
    factory, update = vars(module.ExpertDistributionRecorder)["init_new"], ExpertLocationMetadata.update
    inner = module.ExpertDistributionRecorder.init_new(_metadata(REPLICAS), 0)
    module.set_global_expert_distribution_recorder(inner)
    handle = adapter.instrument(mode="per_pass")
    bridge = module.get_global_expert_distribution_recorder()
    assert bridge is handle.bridge and bridge.sglang is inner and handle.recorder.mode == "per_pass"
    assert adapter.instrument() is handle  # idempotent
    assert handle.uninstrument() == []
    assert module.get_global_expert_distribution_recorder() is inner
    assert vars(module.ExpertDistributionRecorder)["init_new"] is factory and ExpertLocationMetadata.update is update


def test_other_init_new_signatures_are_refused(context: None, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module()
    assert list(inspect.signature(module.ExpertDistributionRecorder.init_new).parameters) == ["expert_location_metadata", "rank"]

    def init_new(metadata: Any) -> Any:
        return None

    monkeypatch.setattr(module.ExpertDistributionRecorder, "init_new", staticmethod(init_new))
    with pytest.raises(UnsupportedVersionError, match=r"0\.5\.23: ExpertDistributionRecorder.init_new takes \['metadata'\]"):
        adapter.instrument()


# ---------------------------------------------------------------------------- a fault at each step


class Injected(RuntimeError):
    """The fault a test injects."""


def _raise(*args: Any, **kwargs: Any) -> None:
    raise Injected("injected fault")


def _reraise(self: FailSafe, exc: BaseException, where: str) -> None:
    raise exc


def _forward(bridge: Any) -> None:
    _pass(bridge, 0, {0: torch.tensor([[1, 8]]), 1: torch.tensor([[2, 9]])})


# SGLang's calls into moetrace, each with moetrace's side of it made to raise: (what raises, SGLang's call)
BRIDGE_FAULTS: dict[str, tuple[str, Any]] = {
    "on_select_experts": ("on_select_experts", _forward),
    "layer scope": ("with_current_layer", _forward),
    "pass": ("with_forward_pass", _forward),
    "start_record": ("start_record", lambda bridge: bridge.start_record()),
    "dump_record": ("dump_record", lambda bridge: bridge.dump_record()),  # SGLang's own dump still answers
}


@pytest.mark.parametrize("step", list(BRIDGE_FAULTS))
def test_a_fault_in_each_bridged_call_never_reaches_sglang(
    step: str, bridged: tuple[Any, Any], out: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(out))  # where SGLang's own dump goes
    handle, _ = bridged
    bridge = handle.bridge
    if step != "start_record":
        bridge.start_record()
    method, call = BRIDGE_FAULTS[step]
    monkeypatch.setattr(ExpertDistributionRecorder, method, _raise)
    monkeypatch.setattr(bridge.sglang, "dump_record", lambda output_mode="file": "SGLang's dump")  # needs a process group
    with caplog.at_level(logging.WARNING, logger="moetrace"):
        assert call(bridge) == ("SGLang's dump" if step == "dump_record" else None)  # returns into SGLang
        _forward(bridge)  # later passes run; moetrace stays off
    assert int(bridge.sglang._single_pass_gatherers["primary"]._data.sum()) >= 4  # SGLang's recorder counted its ids
    assert not handle.failsafe.on and "Injected: injected fault" in str(handle.failsafe.error)
    (warning,) = [r for r in caplog.records if r.name.startswith("moetrace")]
    assert "moetrace is off for this SGLang engine" in warning.getMessage()


@pytest.mark.parametrize("step", list(BRIDGE_FAULTS))
def test_without_the_failsafe_each_bridged_fault_reaches_sglang(step: str, bridged: tuple[Any, Any], out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the same faults, with the fail-safe's trip raising again, escape into SGLang's call."""
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(out))
    handle, _ = bridged
    if step != "start_record":
        handle.bridge.start_record()
    method, call = BRIDGE_FAULTS[step]
    monkeypatch.setattr(ExpertDistributionRecorder, method, _raise)
    monkeypatch.setattr(handle.bridge.sglang, "dump_record", lambda output_mode="file": "SGLang's dump")
    monkeypatch.setattr(FailSafe, "trip", _reraise)
    with pytest.raises(Injected):
        call(handle.bridge)


def test_a_fault_bridging_sglangs_recorder_leaves_sglangs_own(out: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's model runner builds its recorder (``init_new``) while moetrace's cannot be built: SGLang gets its own."""
    module = _module()
    previous = module.get_global_expert_distribution_recorder()
    module.set_global_expert_distribution_recorder(module._ExpertDistributionRecorderNoop())  # SGLang has not built one yet
    try:
        _bridging_fails_safely(module, monkeypatch, caplog)
    finally:
        module.set_global_expert_distribution_recorder(previous)


def _bridging_fails_safely(module: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(adapter, "_moetrace_recorder", _raise)
    handle = adapter.instrument()
    with caplog.at_level(logging.WARNING, logger="moetrace"):
        built = module.ExpertDistributionRecorder.init_new(_metadata(REPLICAS), 0)
    handle.uninstrument()
    assert not isinstance(built, adapter.RecorderBridge) and handle.bridge is None
    assert "bridging the recorder SGLang built" in str(handle.failsafe.error)
    assert len([r for r in caplog.records if r.name.startswith("moetrace")]) == 1
    monkeypatch.setattr(FailSafe, "trip", _reraise)  # negative control: the same fault without the fail-safe
    handle = adapter.instrument()
    try:
        with pytest.raises(Injected):
            module.ExpertDistributionRecorder.init_new(_metadata(REPLICAS), 0)
    finally:
        handle.uninstrument()


def test_a_fault_in_the_plugins_start_up_never_reaches_sglang(context: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MOETRACE_ENABLED", "1")
    monkeypatch.setattr(adapter, "_PLUGIN_HANDLE", None)
    monkeypatch.setattr(adapter, "_PLUGIN_FAILSAFE", FailSafe("this SGLang engine"))
    monkeypatch.setattr(adapter, "instrument", _raise)
    with caplog.at_level(logging.WARNING, logger="moetrace"):
        adapter.plugin()
        adapter.plugin()  # SGLang loads its plugins again: no second warning
    (warning,) = [r for r in caplog.records if r.name.startswith("moetrace")]
    assert adapter._PLUGIN_HANDLE is None
    assert "moetrace's SGLang plugin start-up failed (Injected: injected fault)" in warning.getMessage()
    monkeypatch.setattr(adapter, "_PLUGIN_FAILSAFE", FailSafe("this SGLang engine"))
    monkeypatch.setattr(FailSafe, "trip", _reraise)
    with pytest.raises(Injected):  # negative control
        adapter.plugin()
