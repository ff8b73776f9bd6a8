"""``MOETRACE_*`` variables are honoured by every adapter or refused in one line, never ignored.

Issue 52: ``MOETRACE_MODE=per_token`` with ``hf.instrument`` recorded ``stat`` without a word.
Here the Hugging Face adapter (in this virtualenv) records what the variable says, checked
against the routers' own selections; an argument or a recorder that says otherwise, and a
variable the adapter does not read, are refused with one line naming the variable and the fix.
The vLLM and SGLang plugin paths are tested in their own virtualenvs (tests/vllm/test_errors.py,
tests/sglang); the rules themselves live in :mod:`moetrace.adapters.settings` (checked here without an engine).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from moetrace.adapters import hf
from moetrace.adapters.failsafe import FailSafe
from moetrace.adapters.settings import READ_BY, SettingsError, recorder_options

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace.reader import open_trace

from .hf_models import FAMILIES, VOCAB, capture_routers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(model: torch.nn.Module, **options: object) -> tuple[hf.HFInstrumentation, torch.Tensor]:
    handle = hf.instrument(model, **options)
    handle.recorder.start_record()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids)
    return handle, ids


def test_hf_records_in_the_mode_the_variable_names(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MOETRACE_MODE", "per_token")
    monkeypatch.setenv("MOETRACE_OUTPUT_DIR", str(tmp_path))
    family = FAMILIES["mixtral"]
    model = family.build()
    with capture_routers(model, family) as routers:
        handle, ids = _run(model)
    try:
        assert handle.recorder.config.mode == "per_token" and handle.recorder.config.output_dir == tmp_path
        trace = handle.recorder.dump_record()  # into MOETRACE_OUTPUT_DIR
        assert trace.parent == tmp_path
        with open_trace(trace) as tr:
            assert tr.mode == "per_token"
            rows = np.concatenate([chunk.topk_ids for chunk in tr.iter_tokens()])
        # Independent count: every token of the batch, each layer's router selection ([T, E] mask), in the per-token rows.
        (selected,) = routers.passes
        expected = np.stack([[np.flatnonzero(token) for token in mask.reshape(ids.numel(), -1).numpy()] for mask in selected], axis=1)
        assert rows.shape == expected.shape and (np.sort(rows, axis=2) == expected).all()
    finally:
        handle.uninstrument()


def test_negative_control_without_the_variable_the_mode_is_stat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOETRACE_MODE", raising=False)
    handle, _ = _run(FAMILIES["mixtral"].build())
    try:
        assert handle.recorder.config.mode == "stat"
    finally:
        handle.uninstrument()


def test_an_argument_that_disagrees_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETRACE_MODE", "per_token")
    with pytest.raises(SettingsError, match=r"^MOETRACE_MODE='per_token' and the argument mode='stat' disagree; drop one of them$"):
        hf.instrument(FAMILIES["mixtral"].build(), mode="stat")


def test_a_recorder_configured_otherwise_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    family = FAMILIES["mixtral"]
    recorder = ExpertDistributionRecorder(RecorderConfig(num_layers=len(family.layer_ids), num_physical_experts=family.num_experts,
                                                         top_k=family.top_k, layer_ids=family.layer_ids, mode="stat"))
    monkeypatch.setenv("MOETRACE_WINDOW", "50")
    with pytest.raises(SettingsError, match=r"MOETRACE_WINDOW='50', but the recorder given to instrument\(\) has window=1000; configure"):
        hf.instrument(family.build(), recorder)


@pytest.mark.parametrize("variable", ["MOETRACE_CONTROL_PORT", "MOETRACE_AUTOSTART", "MOETRACE_TOP_K", "MOETRACE_ENABLED"])
def test_a_variable_hf_does_not_read_is_refused(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "1")
    with pytest.raises(SettingsError, match=rf"^{variable}='1' is set, but the hf adapter does not read it \(it is .+\); unset it$"):
        hf.instrument(FAMILIES["mixtral"].build())


def test_every_adapter_reads_or_refuses_every_variable() -> None:
    """The table is whole: for each adapter, each variable of the table is either read or refused (none falls through)."""
    table = ["MOETRACE_ENABLED", "MOETRACE_MODE", "MOETRACE_OUTPUT_DIR", "MOETRACE_WINDOW", "MOETRACE_AUTOSTART", "MOETRACE_DUMP_ON_EXIT",
             "MOETRACE_CONTROL_PORT", "MOETRACE_CONTROL_HOST", "MOETRACE_TOP_K", "MOETRACE_TIMING"]
    values = {"MOETRACE_MODE": "per_pass", "MOETRACE_OUTPUT_DIR": "/tmp/x", "MOETRACE_WINDOW": "9", "MOETRACE_CONTROL_HOST": "127.0.0.1"}
    for adapter in READ_BY:
        for variable in table:
            env = {variable: values.get(variable, "1")}
            try:
                options = recorder_options(adapter, {}, env)
            except SettingsError:
                assert variable not in READ_BY[adapter]
                continue
            assert options or variable in READ_BY[adapter], (adapter, variable)


def test_a_bad_setting_under_a_plugin_is_one_line_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """What an engine's plugin logs when its start-up meets a bad setting (FailSafe, as the vLLM and SGLang plugins use it)."""
    failsafe = FailSafe("this vLLM engine")
    with caplog.at_level(logging.WARNING), failsafe.guarding("moetrace's vLLM plugin start-up"):
        recorder_options("vllm", {}, {"MOETRACE_WINDOW": "lots"})
    (record,) = caplog.records
    assert record.exc_info is None and "\n" not in record.getMessage()
    assert record.getMessage() == ("moetrace: moetrace's vLLM plugin start-up: MOETRACE_WINDOW='lots' is not an integer; "
                                   "moetrace is off for this vLLM engine, which goes on without it")


def test_negative_control_another_error_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    failsafe = FailSafe("this vLLM engine")
    with caplog.at_level(logging.WARNING), failsafe.guarding("a step"):
        raise RuntimeError("a bug")
    (record,) = caplog.records
    assert record.exc_info is not None
