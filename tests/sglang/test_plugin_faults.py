"""A fault at each step of moetrace's SGLang plugin, on a live SGLang engine (``sglang.Engine``, CPU): SGLang serves on.

One plain engine (no moetrace) gives the reference tokens; then one engine per fault
(module scope, one at a time), with ``MOETRACE_ENABLED=1``:

- ``plugin start-up``: ``instrument()`` raises when SGLang loads the plugin (in each
  SGLang process that loads plugins);
- ``bridging the recorder``: building moetrace's recorder raises when SGLang's model
  runner builds its own expert distribution recorder (``init_new``);
- ``bridge in forward``: moetrace's recorder raises inside every MoE layer's
  ``on_select_experts`` once recording was started through SGLang's own API.

SGLang spawns its scheduler and detokenizer processes, so the fault is injected there at
interpreter start (:mod:`tests.faults.injection`), which also writes moetrace's warnings
to a file. Each engine must start and answer with the plain engine's tokens, and each
process that met the fault must have warned once, naming the step. The negative
controls (without the fail-safe, each fault escapes into SGLang's call) run against
SGLang's real recorder classes in ``test_bridge.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..faults.injection import fault_environment, warning_records
from .checkpoint import build_checkpoint
from .engine import GENERATION, PROMPTS, engine

pytestmark = pytest.mark.slow

# fault -> (what raises, only while recording, the step the warning names)
FAULTS: dict[str, tuple[str, bool, str]] = {
    "plugin start-up": ("moetrace.adapters.sglang:instrument", False, "moetrace's SGLang plugin start-up"),
    "bridging the recorder": ("moetrace.adapters.sglang:_moetrace_recorder", False, "bridging the recorder SGLang built"),
    "bridge in forward": ("moetrace.recorder:ExpertDistributionRecorder.on_select_experts", True, "the bridge's on_select_experts"),
}


@dataclass
class Served:
    fault: str
    tokens: list[list[int]]
    records: list[str]


def _tokens(llm: Any) -> list[list[int]]:
    return [answer["output_ids"] for answer in llm.generate(input_ids=PROMPTS, sampling_params=GENERATION)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> list[list[int]]:
    with engine(str(checkpoint), {"MOETRACE_ENABLED": "0"}) as llm:
        return _tokens(llm)


@pytest.fixture(scope="module", params=list(FAULTS))
def served(request: pytest.FixtureRequest, checkpoint: Path, plain: list[list[int]], tmp_path_factory: pytest.TempPathFactory) -> Served:
    fault = request.param
    target, while_recording, _ = FAULTS[fault]
    out = tmp_path_factory.mktemp("faults")
    log = out / "moetrace.log"
    env = {"MOETRACE_ENABLED": "1", "MOETRACE_OUTPUT_DIR": str(out), **fault_environment(target, log, while_recording=while_recording)}
    with engine(str(checkpoint), env) as llm:  # it starts: SGLang's start-up went on
        if while_recording:
            llm.start_expert_distribution_record()  # SGLang's API, which the bridge forwards to moetrace's recorder
        tokens = _tokens(llm)
    return Served(fault, tokens, warning_records(log))


def test_sglang_serves_the_plain_engines_tokens(served: Served, plain: list[list[int]]) -> None:
    assert served.tokens == plain and all(len(t) == GENERATION["max_new_tokens"] for t in plain)


def test_each_process_that_met_the_fault_warned_once(served: Served) -> None:
    _, _, step = FAULTS[served.fault]
    assert served.records, "no process met the injected fault"
    assert all(" WARNING moetrace.adapters: " in r and step in r and "(RuntimeError: injected fault" in r for r in served.records), served.records
    assert all("moetrace is off for this SGLang engine" in r for r in served.records)
    per_process = Counter(r.split()[1] for r in served.records)
    assert set(per_process.values()) == {1}, served.records
    if served.fault != "plugin start-up":  # only the scheduler builds a recorder and runs forwards
        assert len(per_process) == 1
