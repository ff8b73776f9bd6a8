"""One single-rank launch: feature-detection refusals, and rollout-to-training divergence before and after replay.

Divergence on one set of weights: the routes of a bf16 eval forward (the rollout) against
the fp32 training forward, per layer, then the rollout's routes replayed into the
training forward (docs/integrations/megatron.md records the figures).
"""

from __future__ import annotations

import pytest

from moetrace.reference.launcher import launch

from . import ranks

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def results():
    return launch(ranks.run, 1, [("refusal_checks", ()), ("rollout_divergence", ())])[0]


def test_refusals_name_the_version_and_the_fix(results):
    messages = results["refusal_checks"]
    assert "holds no megatron.core MoE layer" in messages["no_moe"]
    assert "megatron-core 0.16.1" in messages["no_router_replay"] and "router_replay" in messages["no_router_replay"]
    assert "token dispatcher is not supported" in messages["flex"] and "moe_token_dispatcher_type" in messages["flex"]


def test_bf16_rollout_diverges_from_fp32_training_and_replay_removes_it(results):
    d = results["rollout_divergence"]
    assert d["before"]["router_agreement"] < 1.0 and d["affected_tokens"] > 0  # there is divergence to remove
    assert d["after"]["router_agreement"] == 1.0 and d["after"]["tokens_any_differ"] == 0.0
    assert d["audit"]["ok"] and d["audit"]["share"] == 1.0
    # on the positions whose routes differed, replay brings the log-prob gap down (bf16 noise remains)
    assert d["logprob_gap_affected_after"] < d["logprob_gap_affected_before"]
