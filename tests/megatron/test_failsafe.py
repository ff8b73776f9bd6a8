"""An observer never stops what it observes: a hook that raises inside a Megatron-Core training step.

One single-rank launch (tests/megatron/faults.py): for each hook kind, the recorder is made
to raise inside the forward; the step's logits and every gradient must equal the
uninstrumented step's, with one warning and moetrace off. Negative control: the same fault
with the fail-safe's trip raising again stops the forward.
"""

from __future__ import annotations

import pytest

from moetrace.reference.launcher import launch

from . import faults

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, object]]:
    return launch(faults.hook_faults, 1)[0]


@pytest.mark.parametrize("fault", list(faults.FAULTS))
def test_a_raising_hook_leaves_the_step_unchanged_with_one_warning(results: dict[str, dict[str, object]], fault: str) -> None:
    r = results[fault]
    assert r["identical"]  # logits and every gradient bit-identical to the uninstrumented step
    (warning,) = r["warnings"]
    assert "Injected: injected fault" in warning and "moetrace is off for this Megatron-Core model" in warning
    assert not r["on"] and "Injected: injected fault" in str(r["error"])


@pytest.mark.parametrize("fault", list(faults.FAULTS))
def test_without_the_failsafe_the_fault_stops_the_step(results: dict[str, dict[str, object]], fault: str) -> None:
    assert results[fault]["stopped_without_failsafe"]
