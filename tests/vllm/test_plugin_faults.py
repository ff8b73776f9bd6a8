"""A fault in the vLLM plugin on a live multi-process engine (engine core + worker process): vLLM loads and serves on.

Two faults, one engine each (module scope, one at a time):

- ``warm-up patch``: the plugin's patch of the worker's warm-up raises ``ImportError``
  while vLLM loads the model, as the import of ``CPUWorker`` did on vLLM 0.34
  without Triton (it used to abort vLLM's load);
- ``routing tap``: the recorder raises inside every MoE layer's routing tap once it
  records, i.e. inside the forward passes of the first ``generate``.

vLLM's CPU platform spawns its engine-core process, so the fault is injected there
at interpreter start (:mod:`tests.faults.injection`), which also writes moetrace's
warnings to a file. The engine must start, ``generate`` must give the same tokens as
after the plugin's hooks are removed, moetrace must be off in the worker, naming
the fault, and the worker must have warned once. The same faults with their
negative controls (without the fail-safe the warm-up fault escapes vLLM's model
load): ``test_plugin_steps.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from ..faults.injection import fault_environment, warning_records
from . import probes
from .checkpoints import build_checkpoint
from .engine import PROMPTS, sampling_params, start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# fault -> (what raises, its error, only while recording, the step the worker's fail-safe names)
FAULTS: dict[str, tuple[str, str, bool, str]] = {
    "warm-up patch": ("moetrace.adapters.vllm.plugin:_patch_worker_warm_up", "ImportError", False, "instrumenting the model vLLM loaded"),
    "routing tap": ("moetrace.recorder:ExpertDistributionRecorder.on_select_experts", "RuntimeError", True, "the routing tap"),
}


@dataclass
class Served:
    fault: str
    faulted: list[list[int]]  # tokens with the fault injected
    plain: list[list[int]]  # tokens once the plugin's hooks were removed from the worker
    state: dict[str, Any]
    records: list[str]


def _generate(llm: Any) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, sampling_params(), use_tqdm=False)]


@pytest.fixture(scope="module", params=list(FAULTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    fault = request.param
    target, error, while_recording, _ = FAULTS[fault]
    out = tmp_path_factory.mktemp("faults")
    log = out / "moetrace.log"
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "MOETRACE_ENABLED": "1", "MOETRACE_OUTPUT_DIR": str(out),
        **fault_environment(target, log, error, while_recording),
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships the probes
        llm = start_llm(build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral")), env)  # it starts: the load went on
        try:
            faulted = _generate(llm)
            state = llm.apply_model(probes.failsafe_state)[0]
            assert llm.apply_model(probes.uninstrument) == [True]
            plain = _generate(llm)
        finally:
            stop_llm(llm, timeout=30)
    return Served(fault, faulted, plain, state, warning_records(log))


def test_vllm_serves_the_same_tokens(served: Served) -> None:
    assert served.faulted == served.plain and len(served.plain) == len(PROMPTS)


def test_moetrace_is_off_in_the_worker_naming_the_fault(served: Served) -> None:
    _, error, _, step = FAULTS[served.fault]
    assert not served.state["on"]
    assert served.state["error"].startswith(step) and f"{error}: injected fault" in served.state["error"]
    assert served.state["hooked"]  # nothing uninstalled behind vLLM's back: uninstrument() removed the hooks after


def test_the_worker_warned_once(served: Served) -> None:
    (record,) = served.records
    _, error, _, step = FAULTS[served.fault]
    assert " WARNING moetrace.adapters: " in record and step in record and f"({error}: injected fault" in record
    assert "moetrace is off for this vLLM engine" in record
    assert int(record.split()[1]) != os.getpid()  # written by vLLM's engine-core process
