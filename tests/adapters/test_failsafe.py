"""An observer never stops what it observes: the fail-safe, and a fault injected in each transformers hook.

Each fault is injected by making one real step of moetrace raise (monkeypatched);
the forward must return exactly what the uninstrumented model returns, with one
warning, and moetrace stays off afterwards. The negative control runs the same
fault with the fail-safe's trip turned into a re-raise: the forward then fails.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from moetrace.adapters import hf
from moetrace.adapters.failsafe import FailSafe

from moetrace.recorder import ExpertDistributionRecorder
from moetrace.testing import HostSyncError, assert_no_host_sync

from .hf_models import FAMILIES, VOCAB

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Injected(RuntimeError):
    """The fault a test injects."""


def _raise(*args: object, **kwargs: object) -> None:
    raise Injected("injected fault")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moetrace.adapters" and r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------- the switch


def test_guard_trips_once_and_then_passes_through(caplog: pytest.LogCaptureFixture) -> None:
    failsafe, calls = FailSafe("this test engine"), []

    def hook(x: int) -> int:
        calls.append(x)
        if x == 2:
            raise Injected("bad value 2")
        return x * 10

    guarded = failsafe.guard(hook, "the test hook")
    with caplog.at_level(logging.WARNING, logger="moetrace.adapters"):
        assert guarded(1) == 10 and failsafe.on
        assert guarded(2) is None and guarded(3) is None
    assert calls == [1, 2]  # off: the hook is not called any more
    assert not failsafe.on and failsafe.error == "the test hook: Injected: bad value 2"
    (warning,) = _warnings(caplog)
    assert "the test hook failed (Injected: bad value 2)" in warning and "off for this test engine" in warning


def test_around_keeps_the_engines_call_and_its_errors(caplog: pytest.LogCaptureFixture) -> None:
    failsafe, seen = FailSafe("this test engine"), []

    @contextlib.contextmanager
    def scope(*args: object, **kwargs: object) -> Iterator[None]:
        seen.append("enter")
        try:
            yield
        except ValueError:
            seen.append("left with the engine's error")
            raise

    def engine_call(x: int) -> int:
        if x < 0:
            raise ValueError("the engine's own error")
        return x + 1

    call = failsafe.around(engine_call, scope, "the test scope")
    assert call(1) == 2
    with pytest.raises(ValueError, match="the engine's own error"):
        call(-1)  # the engine's error is the engine's: it propagates, the switch stays on
    assert failsafe.on and seen == ["enter", "enter", "left with the engine's error"]

    @contextlib.contextmanager
    def broken_exit(*args: object, **kwargs: object) -> Iterator[None]:
        yield
        raise Injected("on the way out")

    with caplog.at_level(logging.WARNING, logger="moetrace.adapters"):
        assert failsafe.around(engine_call, broken_exit, "the exit")(4) == 5
        assert failsafe.around(engine_call, _raise, "the entry")(6) == 7  # off already: no second warning
    assert len(_warnings(caplog)) == 1 and failsafe.error == "the exit: Injected: on the way out"

    entering = FailSafe("another engine")
    calls: list[int] = []

    def counted(x: int) -> int:
        calls.append(x)
        return x

    assert entering.around(counted, _raise, "the entry")(8) == 8 and calls == [8]  # the engine's call runs once
    assert not entering.on


def test_hot_path_checks_pass_the_guard() -> None:
    failsafe = FailSafe("this test engine")
    reads_a_value = failsafe.guard(lambda ids: ids.sum().item(), "a syncing hook")
    with pytest.raises(HostSyncError), assert_no_host_sync():
        reads_a_value(torch.ones(3, 2))
    assert failsafe.on  # a test's check is not a fault of the engine
    assert failsafe.guard(lambda ids: ids.sum().item(), "a syncing hook")(torch.ones(3, 2)) == 6.0  # outside the check: fine


# ---------------------------------------------------------------------------- transformers hooks


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))


# (family, what raises, recorder options): each kind of hook the transformers adapter installs.
FAULTS = {
    "experts pre-hook": ("mixtral", "on_select_experts", {}),
    "router forward hook": ("llama4", "on_select_experts", {}),
    "forward-pass wrapper": ("mixtral", "with_forward_pass", {}),
    "expert phase timing": ("qwen3_moe", "with_phase", {"timing": True}),
}


def _forward_with_fault(name: str, monkeypatch: pytest.MonkeyPatch, out: Path) -> tuple[torch.Tensor, torch.Tensor, hf.HFInstrumentation]:
    family, step, options = FAULTS[name]
    model = FAMILIES[family].build()
    with torch.no_grad():
        plain = model(_ids()).logits
    monkeypatch.setattr(ExpertDistributionRecorder, step, _raise)  # before instrument(): hooks bind the recorder's methods
    handle = hf.instrument(model, output_dir=out, **options)
    handle.recorder.start_record()
    with torch.no_grad():
        return plain, model(_ids()).logits, handle


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_fault_in_a_hook_leaves_the_forward_as_without_moetrace(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    with caplog.at_level(logging.WARNING, logger="moetrace.adapters"):
        plain, logits, handle = _forward_with_fault(name, monkeypatch, tmp_path)
        with torch.no_grad():
            again = handle.target(_ids()).logits  # off: the hooks pass through, no second warning
    assert torch.equal(logits, plain) and torch.equal(again, plain)
    (warning,) = _warnings(caplog)
    assert "Injected: injected fault" in warning and "off for this transformers model" in warning
    assert not handle.failsafe.on and handle.active  # nothing was uninstalled from inside the forward
    assert handle.uninstrument() == [] and "forward" not in handle.target.__dict__


@pytest.mark.parametrize("name", list(FAULTS))
def test_without_the_failsafe_the_fault_stops_the_forward(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Negative control: the same fault, with the fail-safe's trip raising again, fails the forward."""

    def reraise(self: FailSafe, exc: BaseException, where: str) -> None:
        raise exc

    monkeypatch.setattr(FailSafe, "trip", reraise)
    with pytest.raises(Injected, match="injected fault"):
        _forward_with_fault(name, monkeypatch, tmp_path)
