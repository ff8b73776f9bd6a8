"""The engine plugins' one settings reader (moetrace.adapters.settings): values, defaults, errors that name the variable."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from moetrace.adapters import sglang as sgl_adapter
from moetrace.adapters.failsafe import FailSafe
from moetrace.adapters.settings import PluginSettings, env_flag, env_int


def test_every_variable_is_read() -> None:
    settings = PluginSettings.from_env({
        "MOETRACE_ENABLED": "TRUE", "MOETRACE_MODE": "per_pass", "MOETRACE_OUTPUT_DIR": "/tmp/y", "MOETRACE_WINDOW": "7",
        "MOETRACE_AUTOSTART": "off", "MOETRACE_DUMP_ON_EXIT": "Yes", "MOETRACE_CONTROL_PORT": "0",
        "MOETRACE_CONTROL_HOST": "::1", "MOETRACE_TOP_K": "4",
    })
    assert settings == PluginSettings(enabled=True, mode="per_pass", output_dir=Path("/tmp/y"), window=7, autostart=False,
                                      dump_on_exit=True, control_port=0, control_host="::1", top_k=4)


def test_off_gives_the_defaults_unless_forced() -> None:
    env = {"MOETRACE_MODE": "per_token", "MOETRACE_WINDOW": "5"}
    assert PluginSettings.from_env(env) == PluginSettings()
    forced = PluginSettings.from_env(env, force=True)  # an explicit instrument() reads the options
    assert (forced.enabled, forced.mode, forced.window) == (False, "per_token", 5)
    assert PluginSettings.from_env({}, force=True) == PluginSettings()


@pytest.mark.parametrize(("name", "value", "message"), [
    ("MOETRACE_MODE", "tokens", "MOETRACE_MODE='tokens' is not one of"),
    ("MOETRACE_WINDOW", "1e3", "MOETRACE_WINDOW='1e3' is not an integer"),
    ("MOETRACE_TOP_K", "0", "MOETRACE_TOP_K=0 must be >= 1"),
    ("MOETRACE_DUMP_ON_EXIT", "sometimes", "MOETRACE_DUMP_ON_EXIT='sometimes' is not a boolean"),
])
def test_a_bad_value_names_its_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PluginSettings.from_env({name: value}, force=True)


def test_readers() -> None:
    assert env_flag({}, "X", True) is True and env_flag({"X": ""}, "X", False) is False and env_flag({"X": "ON"}, "X", False) is True
    assert env_int({}, "N", None, 0) is None and env_int({"N": "3"}, "N", None, 0) == 3


def test_sglang_plugin_with_a_bad_switch_logs_and_stays_off(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MOETRACE_ENABLED", "maybe")
    monkeypatch.setattr(sgl_adapter, "_PLUGIN_HANDLE", None)
    monkeypatch.setattr(sgl_adapter, "_PLUGIN_FAILSAFE", FailSafe("this SGLang engine"))
    with caplog.at_level(logging.WARNING):
        sgl_adapter.plugin()  # never raises into SGLang's start-up
        sgl_adapter.plugin()  # SGLang loads plugins again: off, no second warning
    assert sgl_adapter._PLUGIN_HANDLE is None and not sgl_adapter._PLUGIN_FAILSAFE.on
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "MOETRACE_ENABLED='maybe' is not a boolean" in record.getMessage()
