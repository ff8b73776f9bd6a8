"""A fault injected at each step of the vLLM plugin, on one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

The engine starts with ``MOETRACE_ENABLED=1`` (the plugin instruments it in this
process) and serves throughout. For each step, a fresh plugin session runs the
step as vLLM would call it (``register()``, the patched loader's wrapper with the
engine's own model and config, the patched warm-up, the dump at exit, a forward)
with that step made to raise: the step returns, vLLM's generate gives the tokens it
gives without moetrace, moetrace is off, and there is one warning. The negative
controls run the same faults with the fail-safe's trip raising again: each load-time
step then fails, as it did before the fail-safe (a forward's fault is shown on the
tap alone, so that the shared engine is never broken). The same faults on a
multi-process engine: ``test_plugin_faults.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from moetrace.adapters import vllm as vllm_adapter
from moetrace.adapters.failsafe import FailSafe
from moetrace.adapters.vllm import find_moe_layers, plugin

from moetrace.recorder import ExpertDistributionRecorder

from ..engines import environment
from .checkpoints import build_checkpoint
from .engine import PROMPTS, sampling_params, start_llm, stop_llm

pytestmark = pytest.mark.vllm


class Injected(RuntimeError):
    """The fault a test injects."""


def _raise(*args: Any, **kwargs: Any) -> None:
    raise Injected("injected fault")


@dataclass
class Engine:
    llm: Any
    model: torch.nn.Module
    vllm_config: Any
    worker: Any
    out: Path
    with_plugin: list[list[int]]  # tokens while the plugin recorded, before any fault
    plain: list[list[int]]  # tokens once the plugin's hooks were removed


def _generate(llm: Any) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, sampling_params(), use_tqdm=False)]


def _worker(worker: Any) -> Any:
    return getattr(worker, "worker", worker)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    out = tmp_path_factory.mktemp("plugin-steps")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MOETRACE_ENABLED": "1", "MOETRACE_OUTPUT_DIR": str(out), "MOETRACE_DUMP_ON_EXIT": "0"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plugin, "_session", None)
        with environment(env):
            plugin.register()  # vLLM loads its plugins once per process: an earlier engine here may have done it
        llm = start_llm(build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral")), env)
        try:
            session = plugin.current_session()
            assert session is not None and session.handle is not None and session.handle.recorder.recording
            with_plugin = _generate(llm)
            session.handle.recorder.stop_record()
            session.handle.recorder.reset()  # nothing of it is left for the exit
            session.handle.uninstrument()
            plain = _generate(llm)
            model = llm.apply_model(lambda m: m)[0]
            worker = _worker(llm.collective_rpc(lambda w: w)[0])
            yield Engine(llm, model, llm.llm_engine.vllm_config, worker, out, with_plugin, plain)
        finally:
            stop_llm(llm)


@pytest.fixture
def fresh(engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """A process without a plugin session yet (``MOETRACE_ENABLED=1``); whatever the test's session instruments is removed after."""
    monkeypatch.setattr(plugin, "_session", None)
    for name, value in (("MOETRACE_ENABLED", "1"), ("MOETRACE_OUTPUT_DIR", str(engine.out)), ("MOETRACE_DUMP_ON_EXIT", "0")):
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="moetrace"):
        yield caplog
    session = plugin.current_session()
    if session is not None and session.handle is not None:
        if session.handle.recorder.recording:
            session.handle.recorder.stop_record()
        session.handle.recorder.reset()  # nothing of the test's recording is left for the exit
        session.handle.uninstrument()
        session.on_exit()


def _load(engine: Engine) -> None:
    """vLLM's model load as the plugin sees it: the patched loader's wrapper around a loader giving the engine's model."""
    plugin.register()
    load_model = plugin._wrap_load(lambda self, **kwargs: engine.model, plugin._on_model_loaded)
    assert load_model(None, vllm_config=engine.vllm_config, model_config=engine.vllm_config.model_config) is engine.model


def _load_and_warm_up(engine: Engine) -> None:
    _load(engine)
    engine.worker.compile_or_warm_up_model()  # vLLM's own warm-up, patched by the plugin


def _exit(engine: Engine) -> None:
    _load_and_warm_up(engine)
    _generate(engine.llm)
    session = plugin.current_session()
    assert session is not None and session.handle is not None and session.handle.recorder.recording
    session.settings = dataclasses.replace(session.settings, dump_on_exit=True)
    session.on_exit()


def _control_file_is_a_folder(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETRACE_CONTROL_PORT", "0")
    (engine.out / f"moetrace-control-{os.getpid()}.json").mkdir(exist_ok=True)


# step -> (inject the fault, drive the step as vLLM does, the step named in the warning)
Inject = Callable[[Engine, pytest.MonkeyPatch], None]
STEPS: dict[str, tuple[Inject, Callable[[Engine], None], str]] = {
    "settings": (lambda e, m: m.setenv("MOETRACE_MODE", "bogus"), lambda e: plugin.register(), "start-up"),
    "version check": (lambda e, m: m.setattr(plugin, "check_vllm_version", _raise), lambda e: plugin.register(), "start-up"),
    "loader patch": (lambda e, m: m.setattr(plugin, "_patch_loaders", _raise), lambda e: plugin.register(), "start-up"),
    "instrument": (lambda e, m: m.setattr(vllm_adapter, "instrument_model", _raise), _load, "instrumenting the model"),
    "warm-up patch": (lambda e, m: m.setattr(plugin, "_patch_worker_warm_up", _raise), _load, "instrumenting the model"),
    "control endpoint": (_control_file_is_a_folder, _load, "instrumenting the model"),
    "start recording": (lambda e, m: m.setattr(ExpertDistributionRecorder, "start_record", _raise), _load_and_warm_up, "warm-up"),
    "dump on exit": (lambda e, m: m.setattr(ExpertDistributionRecorder, "dump_record", _raise), _exit, "dump on exit"),
    "routing tap": (lambda e, m: m.setattr(ExpertDistributionRecorder, "on_select_experts", _raise), _load_and_warm_up, "routing tap"),
    "forward pass": (lambda e, m: m.setattr(ExpertDistributionRecorder, "with_forward_pass", _raise), _load_and_warm_up, "forward-pass wrapper"),
}


def test_the_plugin_changes_no_output(engine: Engine) -> None:
    assert engine.with_plugin == engine.plain


@pytest.mark.parametrize("step", list(STEPS))
def test_a_fault_at_each_step_leaves_vllm_serving(step: str, engine: Engine, fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    inject, drive, named = STEPS[step]
    inject(engine, monkeypatch)
    drive(engine)  # returns: vLLM's load, warm-up or exit goes on
    assert _generate(engine.llm) == engine.plain
    session = plugin.current_session()
    assert session is not None and not session.failsafe.on and named in str(session.failsafe.error)
    warnings = [r for r in fresh.records if r.name.startswith("moetrace") and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "moetrace is off for this vLLM engine" in warnings[0].getMessage()
    assert session.control is None  # a control endpoint served before the fault is closed


def test_a_fault_in_following_the_steps_keeps_recording_without_requests(engine: Engine, fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Following the model runner is the one step whose failure moetrace can do without: passes lose their requests only."""
    _load(engine)
    session = plugin.current_session()
    assert session is not None and session.handle is not None
    monkeypatch.setattr(session.handle.details["batches"], "attach", _raise)
    engine.worker.compile_or_warm_up_model()
    assert _generate(engine.llm) == engine.plain
    # moetrace still records: one pass for the prompts' prefill, one per decode step
    assert session.failsafe.on and session.handle.recorder.num_passes == sampling_params().max_tokens
    (warning,) = [r for r in fresh.records if r.name.startswith("moetrace")]
    assert "without their requests" in warning.getMessage() and warning.levelname == "WARNING"


def test_a_fault_in_the_phase_timing_leaves_vllm_serving(engine: Engine, fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrappers ``instrument(timing=True)`` puts around the router's and the experts' calls (in-process use)."""
    monkeypatch.setattr(ExpertDistributionRecorder, "with_phase", _raise)
    handle = vllm_adapter.instrument_model(engine.model, engine.vllm_config, timing=True, output_dir=engine.out)
    try:
        handle.recorder.start_record()
        assert _generate(engine.llm) == engine.plain
    finally:
        handle.recorder.stop_record()
        handle.uninstrument()
    assert not handle.failsafe.on and "phase timing of" in str(handle.failsafe.error)
    (warning,) = [r for r in fresh.records if r.name.startswith("moetrace")]
    assert "Injected: injected fault" in warning.getMessage()


@pytest.mark.parametrize("step", [s for s in STEPS if STEPS[s][1] is not _load_and_warm_up or s == "start recording"])
def test_without_the_failsafe_each_fault_stops_the_step(step: str, engine: Engine, fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the same fault with the fail-safe's trip raising again escapes into vLLM's call."""

    def reraise(self: FailSafe, exc: BaseException, where: str) -> None:
        raise exc

    inject, drive, _ = STEPS[step]
    inject(engine, monkeypatch)
    monkeypatch.setattr(FailSafe, "trip", reraise)
    with pytest.raises((Injected, ValueError, OSError)):
        drive(engine)


def test_without_the_failsafe_the_tap_raises_into_the_forward(engine: Engine, fresh: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the forward's hooks, on the tap alone (a fault in a real forward would stop the shared engine)."""
    def reraise(self: FailSafe, exc: BaseException, where: str) -> None:
        raise exc

    monkeypatch.setattr(ExpertDistributionRecorder, "on_select_experts", _raise)  # before the load: the tap binds it
    _load(engine)
    tap = find_moe_layers(engine.model)[0].runner.router.capture_fn
    monkeypatch.setattr(FailSafe, "trip", reraise)
    with pytest.raises(Injected):
        tap(torch.tensor([[0, 1]], dtype=torch.int64))
