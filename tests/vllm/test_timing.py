"""Phase timing on a real in-process vLLM engine (CPU, tiny Mixtral): route and expert are bracketed.

One engine; a generate instrumented with timing on, then one with timing off:
identical counts and tokens, and the route/expert phases timed in every layer.
"""

from __future__ import annotations

import numpy as np
import pytest
from moetrace.adapters.vllm import instrument

from ..phase_ticks import TICK_S, counting_clock
from .checkpoints import MODELS, build_checkpoint
from .engine import PROMPTS, sampling_params, start_llm, stop_llm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    engine = start_llm(build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral")), {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    yield engine
    stop_llm(engine)


def _generate(llm, tmp_path, timing: bool):
    with counting_clock():  # phase durations in ticks (tests/phase_ticks.py)
        handle = instrument(llm, mode="stat", output_dir=tmp_path, timing=timing)
    handle.recorder.start_record()
    outputs = llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
    handle.recorder.stop_record()
    snap = handle.recorder.snapshot()
    handle.uninstrument()
    return snap, [list(out.outputs[0].token_ids) for out in outputs]


def test_route_and_expert_are_timed_and_counts_unchanged(llm, tmp_path):
    timed, timed_tokens = _generate(llm, tmp_path, timing=True)
    plain, plain_tokens = _generate(llm, tmp_path, timing=False)
    layers = len(MODELS["mixtral"]["layer_ids"])
    timing = timed.timing
    assert timing is not None and plain.timing is None
    assert timing["step_count"] == timed.num_passes > 0
    # route and expert in every layer of every pass; dispatch and combine are not bracketed in vLLM.
    assert timing["phase_count"].shape == (layers, 4)
    assert (timing["phase_count"][:, [0, 2]] == timed.num_passes).all()
    assert (timing["phase_count"][:, [1, 3]] == 0).all()
    # one bracket per layer-pass, nothing read inside it: one tick each (was > 0 seconds of the machine's clock)
    np.testing.assert_allclose(timing["phase_seconds_sum"], timing["phase_count"] * TICK_S)
    np.testing.assert_array_equal(timed.physical_count, plain.physical_count)
    assert timed_tokens == plain_tokens
