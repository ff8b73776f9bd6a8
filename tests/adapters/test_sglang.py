"""The SGLang adapter where SGLang is not installed (the main .venv); live-engine tests are in tests/sglang."""

from __future__ import annotations

import base64
import importlib.util
import inspect
from pathlib import Path

import numpy as np
import pytest
import tomllib
from moetrace.adapters import AdapterError, UnsupportedVersionError
from moetrace.adapters import sglang as sgl_adapter
from moetrace.adapters.failsafe import FailSafe


def test_entry_point_is_declared() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["sglang.srt.plugins"]["moetrace"]
    module, _, func = target.partition(":")
    assert module == "moetrace.adapters.sglang" and func == "plugin"
    assert inspect.isfunction(sgl_adapter.plugin)
    assert "moetrace.adapters.sglang" in pyproject["tool"]["setuptools"]["packages"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_missing_sglang_is_refused_and_the_plugin_stays_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        sgl_adapter.instrument()
    monkeypatch.setenv("MOETRACE_ENABLED", "1")
    monkeypatch.setattr(sgl_adapter, "_PLUGIN_HANDLE", None)
    monkeypatch.setattr(sgl_adapter, "_PLUGIN_FAILSAFE", FailSafe("this SGLang engine"))
    sgl_adapter.plugin()  # warns, never raises into SGLang's start-up
    assert sgl_adapter._PLUGIN_HANDLE is None and "not installed" in str(sgl_adapter._PLUGIN_FAILSAFE.error)


def test_capturer_is_refused_with_a_reason() -> None:
    with pytest.raises(AdapterError, match="enable-return-routed-experts"):
        sgl_adapter.instrument(capturer=object())


def test_read_routed_experts_checks_what_it_reads() -> None:
    ids = np.arange(2 * 3 * 2, dtype="<i4").reshape(2, 3, 2)
    encoded = base64.b64encode(ids.tobytes()).decode()
    np.testing.assert_array_equal(sgl_adapter.read_routed_experts({"meta_info": {"routed_experts": encoded}}, 3, 2), ids)
    with pytest.raises(AdapterError, match="enable-return-routed-experts"):
        sgl_adapter.read_routed_experts({"meta_info": {}}, 3, 2)
    with pytest.raises(AdapterError, match=r"not a multiple of L\*k"):
        sgl_adapter.read_routed_experts(encoded, 5, 2)
    with pytest.raises(AdapterError, match="not base64"):
        sgl_adapter.read_routed_experts("not base64!", 3, 2)
