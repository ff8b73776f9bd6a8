"""HF adapter: with timing on, each experts module's forward is the ``expert`` phase of its layer."""

from __future__ import annotations

import numpy as np
import torch
from moetrace.adapters import hf

from moetrace import ExpertDistributionRecorder, RecorderConfig

from ..adapters.hf_models import FAMILIES, VOCAB
from ..phase_ticks import TICK_S, counting_clock


def _run(timing: bool) -> tuple[ExpertDistributionRecorder, torch.Tensor]:
    family = FAMILIES["mixtral"]
    model = family.build()
    layers = len(family.layer_ids)
    with counting_clock():  # durations in ticks (tests/phase_ticks.py)
        recorder = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=family.num_experts, top_k=family.top_k,
                                                             layer_ids=tuple(family.layer_ids), timing=timing))
    handle = hf.instrument(model, recorder)
    recorder.start_record()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(3):
            logits = model(ids).logits
    handle.uninstrument()
    assert "forward" not in vars(handle.sites[0].module)  # the timing wrapper is gone too
    return recorder, logits


def test_experts_forward_is_the_expert_phase():
    timed, timed_logits = _run(timing=True)
    plain, plain_logits = _run(timing=False)
    timing = timed.snapshot().timing
    assert timing["step_count"] == 3
    assert (timing["phase_count"][:, 2] == 3).all()  # expert, every layer, every pass
    assert (timing["phase_count"][:, [0, 1, 3]] == 0).all()  # route/dispatch/combine: not bracketed in HF
    np.testing.assert_allclose(timing["phase_seconds_sum"][:, 2], 3 * TICK_S)  # one bracket per pass, nothing read inside it
    np.testing.assert_array_equal(timed.snapshot().physical_count, plain.snapshot().physical_count)
    torch.testing.assert_close(timed_logits, plain_logits)
    assert plain.snapshot().timing is None
