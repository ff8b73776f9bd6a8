"""moetrace.adapters.megatron.replay on real Megatron-Core MoE layers at EP=2 over gloo, with the replay audit.

One launch (tests/megatron/ranks.py ``replay_checks``, ``hidden_state_checks``). "Used exactly" is read where
Megatron's experts receive their tokens (a test-side hook), independently of the audit,
which itself reads the routing map each dispatcher dispatches by.
"""

from __future__ import annotations

import pytest

from moetrace.reference.launcher import launch

from . import ranks

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def results():
    return [r["replay_checks"] | r["hidden_state_checks"] for r in launch(ranks.run, 2, [("replay_checks", ()), ("hidden_state_checks", ())])]


@pytest.mark.parametrize("mechanism", [False, True], ids=["moetrace-hook", "megatron-router-replay"])
def test_forced_routes_are_used_exactly_and_the_audit_says_100(results, mechanism):
    for r in results:
        forced = r[f"forced_{mechanism}"]
        assert forced["mechanism"] == ("router_replay" if mechanism else "moetrace")
        assert forced["received"] == forced["expected"]  # Megatron's experts got what the routes ask
        assert forced["audit"]["ok"] and forced["audit"]["share"] == 1.0 and forced["audit"]["forwards"] == 1
        assert all(layer["requested"] == 12 for layer in forced["audit"]["layers"])
        assert all(norm > 0 for norm in forced["router_grad_norms"])  # gradients reach the router


def test_replaying_a_runs_own_routes_reproduces_loss_and_router_gradients(results):
    for r in results:
        own = r["own"]
        assert own["same_weights_same_run"]
        assert own["logits_equal"] and own["router_grads_equal"] and own["max_grad_diff"] == 0.0
        assert own["audit"]["ok"] and own["router_replay_mechanism"] == "router_replay"


def test_a_router_the_replay_cannot_reach_fails_loudly(results):
    for r in results:
        skipped, custom = r["unreached"]["skipped_layer"], r["unreached"]["own_topk_router"]
        assert "never reached the router of ['layers.1']" in skipped["raised"]
        assert skipped["audit"]["unreached"] == ["layers.1"] and not skipped["audit"]["ok"]
        assert "never reached the router of ['layers.0']" in custom["raised"]
        assert custom["audit"]["unreached"] == ["layers.0"] and custom["audit"]["layers"][0]["matched"] < 12


def test_the_audit_sees_copies_dropped_over_capacity(results):
    for r in results:
        audit = r["capacity_audit"]  # negative control: the audit can say less than 100%
        assert not audit["ok"] and audit["share"] < 1.0 and not audit["unreached"]


def test_routes_files_and_partial_routes(results):
    for r in results:
        assert r["file"]["audit"]["ok"] and r["file"]["received"] == r["file"]["expected"]  # its weight version, given
        assert "weight version 'step-5' but 'step-6' was expected" in r["other_weight_version"]
        partial = r["partial"]
        assert partial["mechanism"] == "moetrace"  # -1 rows: Megatron's RouterReplay cannot leave rows to the router
        assert partial["audit"]["ok"] and all(layer["requested"] == 10 for layer in partial["audit"]["layers"])


@pytest.mark.parametrize("mechanism", [False, True], ids=["moetrace-hook", "megatron-router-replay"])
def test_a_stack_called_with_hidden_states_replays_and_a_token_mismatch_is_refused_at_the_router(results, mechanism):
    for r in results:
        hidden = r[f"hidden_{mechanism}"]
        assert hidden["mechanism"] == ("router_replay" if mechanism else "moetrace")
        assert hidden["hidden_numel"] != 12  # [S, B, H] = [6, 2, 16]: its numel is no token count
        assert hidden["received"] == hidden["expected"]  # forced routes used exactly
        assert hidden["audit"]["ok"] and hidden["audit"]["share"] == 1.0 and hidden["audit"]["forwards"] == 1
        assert "layers.0 routes 10 tokens but the routes hold 12" in hidden["refused"]
