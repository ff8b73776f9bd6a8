"""Bad input for the vLLM adapter and its plugin: clear errors, nothing half-instrumented."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm
from moetrace.adapters import AdapterError, NoMoELayersError, UnsupportedVersionError
from moetrace.adapters.settings import PluginSettings
from moetrace.adapters.vllm import check_vllm_version, instrument, instrument_model
from vllm.config import CompilationMode

pytestmark = pytest.mark.vllm


def test_model_without_moe_layers() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(NoMoELayersError, match="not a Mixture-of-Experts model"):
        instrument(model)
    assert "forward" not in model.__dict__


def test_neither_llm_nor_model() -> None:
    with pytest.raises(TypeError, match=r"vllm\.LLM or its torch model"):
        instrument("Mixtral")


def test_capturer_is_refused_with_the_alternative() -> None:
    with pytest.raises(AdapterError, match="enable_return_routed_experts"):
        instrument(torch.nn.Linear(2, 2), capturer=object())


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0"])
def test_unsupported_vllm_version(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv("MOETRACE_VLLM_ALLOW_UNTESTED", raising=False)
    with pytest.raises(UnsupportedVersionError, match=rf"found vLLM {version}.*MOETRACE_VLLM_ALLOW_UNTESTED=1"):
        instrument(torch.nn.Linear(2, 2))
    monkeypatch.setenv("MOETRACE_VLLM_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match="continuing"):
        assert check_vllm_version()[:2] == tuple(int(p) for p in version.split(".")[:2])


def test_supported_version_passes() -> None:
    assert check_vllm_version()[:2] == (0, 32)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0", "0.34.2"])
def test_every_version_with_evidence_passes(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv("MOETRACE_VLLM_ALLOW_UNTESTED", raising=False)
    assert check_vllm_version() == tuple(int(p) for p in version.split("."))


def test_compiled_cpu_engine_is_refused() -> None:
    config = SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.VLLM_COMPILE))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(AdapterError, match="enforce_eager=True"):
        instrument_model(model, config)
    assert "forward" not in model.__dict__


def test_plugin_settings_default_off() -> None:
    assert PluginSettings.from_env({}) == PluginSettings(enabled=False)
    assert not PluginSettings.from_env({"MOETRACE_ENABLED": "0", "MOETRACE_MODE": "bogus"}).enabled


def test_plugin_settings_from_env() -> None:
    settings = PluginSettings.from_env({
        "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "per_token", "MOETRACE_OUTPUT_DIR": "/tmp/x",
        "MOETRACE_WINDOW": "50", "MOETRACE_AUTOSTART": "0", "MOETRACE_DUMP_ON_EXIT": "no",
        "MOETRACE_CONTROL_PORT": "9401", "MOETRACE_CONTROL_HOST": "0.0.0.0",
    })
    assert settings == PluginSettings(
        enabled=True, mode="per_token", output_dir=Path("/tmp/x"), window=50, autostart=False,
        dump_on_exit=False, control_port=9401, control_host="0.0.0.0",
    )


@pytest.mark.parametrize(("name", "value", "message"), [
    ("MOETRACE_MODE", "perpass", "MOETRACE_MODE='perpass' is not one of"),
    ("MOETRACE_WINDOW", "ten", "MOETRACE_WINDOW='ten' is not an integer"),
    ("MOETRACE_WINDOW", "0", "MOETRACE_WINDOW=0 must be >= 1"),
    ("MOETRACE_CONTROL_PORT", "-1", "MOETRACE_CONTROL_PORT=-1 must be >= 0"),
    ("MOETRACE_AUTOSTART", "maybe", "MOETRACE_AUTOSTART='maybe' is not a boolean"),
])
def test_plugin_settings_name_the_bad_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PluginSettings.from_env({"MOETRACE_ENABLED": "1", name: value})


@pytest.mark.parametrize(("name", "value", "says"), [
    ("MOETRACE_MODE", "tokens", "MOETRACE_MODE='tokens' is not one of stat, per_pass, per_token"),
    ("MOETRACE_WINDOW", "many", "MOETRACE_WINDOW='many' is not an integer"),
    ("MOETRACE_TOP_K", "2", "MOETRACE_TOP_K='2' is set, but the vllm adapter does not read it"),
])
def test_plugin_bad_setting_is_one_line_without_a_traceback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                           name: str, value: str, says: str) -> None:
    """Issue 52: a bad MOETRACE_MODE or MOETRACE_WINDOW under the vLLM plugin ended in a full traceback."""
    import logging

    from moetrace.adapters.vllm import plugin

    monkeypatch.setenv("MOETRACE_ENABLED", "1")
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(plugin, "_session", None)
    with caplog.at_level(logging.WARNING):
        plugin.register()  # never raises into vLLM
    (record,) = [r for r in caplog.records if r.name.startswith("moetrace")]
    assert says in record.getMessage() and record.exc_info is None and "\n" not in record.getMessage()
    session = plugin.current_session()
    assert session is not None and not session.failsafe.on
