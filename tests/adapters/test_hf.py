"""The transformers adapter on tiny random-weight models of ten MoE families."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from moetrace.adapters import (
    AlreadyInstrumentedError,
    NoMoELayersError,
    UnsupportedVersionError,
    hf,
)
from moetrace.adapters.base import HookRegistry
from moetrace.adapters.hf.families import (
    EXPLICIT_SITES,
    UNSUPPORTED,
    VIA_OTHER_FAMILY,
    moe_family_coverage,
)

import moetrace
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.testing import assert_no_host_sync
from moetrace.trace.reader import open_trace
from moetrace.trace.token_routes import request_routes

from .hf_models import FAMILIES, VOCAB, capture_routers, hook_counts

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
NAMES = list(FAMILIES)


def _inputs(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model: torch.nn.Module, ids: torch.Tensor, new: int = 3, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        mask = torch.ones_like(ids) if mask is None else mask
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", NAMES)
def test_generate_counts_equal_router_outputs(name: str) -> None:
    family = FAMILIES[name]
    model = family.build()
    handle = hf.instrument(model)
    assert moetrace.get_recorder() is handle.recorder
    assert list(handle.layer_ids) == family.layer_ids
    assert set(handle.details["sites"].values()) == {family.kind}
    assert handle.details["top_k"] == family.top_k
    handle.recorder.start_record()
    ids = _inputs()
    with capture_routers(model, family) as routed:
        _generate(model, ids, new=3)
    snap = handle.recorder.snapshot()
    # prefill + 2 decode steps (the third token comes from the last forward)
    assert len(routed.passes) == 3 and snap.num_passes == 3
    assert snap.num_tokens == ids.numel() + 2 * ids.shape[0]
    expected = routed.counts(len(family.layer_ids), family.num_experts).numpy()
    np.testing.assert_array_equal(snap.physical_count, expected)
    assert snap.physical_count.sum() == snap.num_tokens * family.top_k * len(family.layer_ids)
    handle.uninstrument()


@pytest.mark.parametrize("name", NAMES)
def test_per_token_trace_holds_each_tokens_experts(name: str, tmp_path) -> None:
    family = FAMILIES[name]
    model = family.build()
    handle = hf.instrument(model, mode="per_token", output_dir=tmp_path)
    handle.recorder.start_record()
    handle.name_requests(["alpha", "beta"])  # batch row = request; row 0 is left padded by one token
    mask = torch.ones(2, 4, dtype=torch.int64)
    mask[0, 0] = 0
    with capture_routers(model, family) as routed:
        _generate(model, _inputs(batch=2, length=4), new=2, mask=mask)
    path = handle.recorder.dump_record(tmp_path / "tokens.h5")
    handle.uninstrument()
    with open_trace(path) as trace:
        np.testing.assert_array_equal(trace.layers, family.layer_ids)
        chunks = list(trace.iter_tokens())
        table = trace.request_table()
    topk = np.concatenate([c.topk_ids for c in chunks])
    pass_id = np.concatenate([c.pass_id for c in chunks])
    position = np.concatenate([c.position for c in chunks])
    request = np.concatenate([c.request for c in chunks])
    named = [table[r] if r >= 0 else None for r in request.tolist()]
    request_position = np.concatenate([c.request_position for c in chunks]).tolist()
    assert len(np.unique(pass_id)) == len(routed.passes) == 2
    # prefill rows b*4+s: the pad row of alpha is no request's; decode rows: one per request, next position
    assert named == [None, "alpha", "alpha", "alpha", "beta", "beta", "beta", "beta", "alpha", "beta"]
    assert request_position == [-1, 0, 1, 2, 0, 1, 2, 3, 3, 4]
    for p, layers in zip(np.unique(pass_id), routed.passes, strict=True):
        rows = pass_id == p
        assert (position[rows] == np.arange(rows.sum())).all()
        for layer, mask in enumerate(layers):
            recorded = np.zeros_like(mask.numpy())
            np.put_along_axis(recorded, topk[rows][:, layer].astype(np.int64), True, axis=1)
            np.testing.assert_array_equal(recorded, mask.numpy(), err_msg=f"pass {p} layer {layer}")
    # every request's routes from the trace alone: the independent router re-run's choice at each of its positions
    routes = request_routes(path)
    rows_of = {"alpha": [(0, 1), (0, 2), (0, 3), (1, 0)], "beta": [(0, 4), (0, 5), (0, 6), (0, 7), (1, 1)]}
    for rid, where in rows_of.items():
        assert routes[rid].shape == (len(where), len(family.layer_ids), family.top_k)
        for pos, (p, token) in enumerate(where):
            for layer, chosen in enumerate(routed.passes[p]):
                assert set(routes[rid][pos, layer].tolist()) == set(np.flatnonzero(chosen[token].numpy()).tolist()), (rid, pos, layer)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "llama4", "dbrx"])
def test_capturer_gives_each_sequences_experts(name: str) -> None:
    family = FAMILIES[name]
    model = family.build()
    num_model_layers = model.config.get_text_config().num_hidden_layers if name != "dbrx" else model.config.n_layers
    capturer = RoutedExpertsCapturer(num_model_layers, family.top_k, max_tokens_per_pass=64, num_kv_slots=2 * 16)
    handle = hf.instrument(model, capturer=capturer, capture_seq_len=16)
    handle.recorder.start_record()
    batch, prompt, new = 2, 4, 3
    with capture_routers(model, family) as routed:
        _generate(model, _inputs(batch=batch, length=prompt), new=new)
    assert handle.recorder.snapshot().num_passes == new
    dense = [i for i in range(num_model_layers) if i not in family.layer_ids]
    for row in range(batch):
        got = handle.routed_experts(row, seq_len=prompt + new - 1, batch_size=batch)
        assert got.shape == (prompt + new - 1, num_model_layers, family.top_k)
        assert (got[:, dense] == -1).all()
        # pass 0 holds rows (b, 0..prompt-1) batch-major; each decode pass one token per row
        for position in range(prompt + new - 1):
            p, token = (0, row * prompt + position) if position < prompt else (position - prompt + 1, row)
            for compact, model_layer in enumerate(family.layer_ids):
                mask = np.zeros(family.num_experts, dtype=bool)
                mask[got[position, model_layer].astype(np.int64)] = True
                np.testing.assert_array_equal(mask, routed.passes[p][compact][token].numpy())
    with pytest.raises(moetrace.adapters.AlreadyInstrumentedError, match="capturer"):
        hf.instrument(model, capturer=RoutedExpertsCapturer(num_model_layers, family.top_k, 64, 32))
    handle.uninstrument()


def test_capturer_that_does_not_fit_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    model = FAMILIES["deepseek_v3"].build()
    with pytest.raises(ValueError, match=r"num_layers > 2"):
        hf.instrument(model, capturer=RoutedExpertsCapturer(2, 2, 64, 32))
    ids = _inputs(batch=3, length=4)
    with torch.no_grad():
        plain = model(ids).logits
    handle = hf.instrument(model, capturer=RoutedExpertsCapturer(3, 2, 64, 32), capture_seq_len=16)
    # Inside the model's forward the refusal is a warning (an observer never stops the forward) and moetrace is off.
    with caplog.at_level("WARNING", logger="moetrace.adapters"), torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "capture_seq_len" in caplog.records[0].getMessage()
    assert not handle.failsafe.on and "capture_seq_len" in str(handle.failsafe.error)
    handle.uninstrument()
    assert hook_counts(model) == 0


@pytest.mark.parametrize("name", NAMES)
def test_uninstrument_restores_logits_and_removes_every_hook(name: str) -> None:
    model = FAMILIES[name].build()
    ids = _inputs()
    baseline_hooks = hook_counts(model)
    with torch.no_grad():
        before = model(ids).logits
    handle = hf.instrument(model)
    handle.recorder.start_record()
    assert hook_counts(model) == baseline_hooks + handle.num_hooks > baseline_hooks
    with torch.no_grad():
        during = model(ids).logits
    assert handle.uninstrument() == []
    assert hook_counts(model) == baseline_hooks and "forward" not in model.__dict__
    assert not handle.active and handle.num_hooks == 0
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert handle.recorder.snapshot().num_passes == 1  # nothing counted once removed
    assert handle.uninstrument() == []  # idempotent


def test_instrument_twice_is_harmless() -> None:
    family = FAMILIES["mixtral"]
    model = family.build()
    baseline = hook_counts(model)
    first = hf.instrument(model)
    hooks = hook_counts(model)
    assert hf.instrument(model) is first
    assert hf.instrument(model, recorder=first.recorder) is first
    assert hook_counts(model) == hooks
    first.recorder.start_record()
    with capture_routers(model, family) as routed, torch.no_grad():
        model(_inputs())
    np.testing.assert_array_equal(first.recorder.snapshot().physical_count, routed.counts(2, 8).numpy())
    moetrace.adapters.uninstrument(model)
    assert not first.active and hook_counts(model) == baseline


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_every_experts_implementation_is_observed(implementation: str) -> None:
    family = FAMILIES["qwen3_moe"]
    model = family.build()
    model.set_experts_implementation(implementation)
    handle = hf.instrument(model)
    handle.recorder.start_record()
    with capture_routers(model, family) as routed, torch.no_grad():
        model(_inputs(batch=3, length=5))
    np.testing.assert_array_equal(handle.recorder.snapshot().physical_count, routed.counts(2, 8).numpy())
    handle.uninstrument()


def test_built_recorder_follows_the_model_and_a_given_one_is_used() -> None:
    model = FAMILIES["deepseek_v3"].build()
    handle = hf.instrument(model, mode="per_pass", window=8)
    cfg = handle.recorder.config
    assert (cfg.num_layers, cfg.num_physical_experts, cfg.top_k, cfg.layer_ids) == (2, 8, 2, (1, 2))
    assert (cfg.mode, cfg.engine, cfg.hidden_size) == ("per_pass", "hf", 32)
    handle.uninstrument()
    configured = moetrace.configure(num_layers=2, num_physical_experts=8, top_k=2, layer_ids=(1, 2))
    handle = hf.instrument(model, recorder=moetrace.get_recorder())
    assert handle.recorder is configured and moetrace.get_recorder() is configured
    handle.uninstrument()


@pytest.mark.parametrize("name", ["mixtral", "llama4"])
def test_hooks_never_sync_host_and_device(name: str) -> None:
    """Run each installed hook by hand, inside a pass, under the no-host-sync mode."""
    model = FAMILIES[name].build()
    handle = hf.instrument(model)
    rec = handle.recorder
    rec.start_record()
    calls = []
    for site in handle.sites:
        module = site.module
        if site.kind == "router-topk":
            hidden = torch.randn(5, 32)
            output = module(hidden)
            calls += [lambda h=h, m=module, x=hidden, o=output: h(m, (x,), o) for h in module._forward_hooks.values()]
        else:
            args = (torch.randn(5, 32), torch.randint(0, 8, (5, 2)), torch.rand(5, 2))
            calls += [lambda h=h, m=module, a=args: h(m, a, {}) for h in module._forward_pre_hooks.values()]
    assert calls
    with rec.with_forward_pass(), assert_no_host_sync():
        for call in calls:
            call()
    assert rec.snapshot().physical_count.sum() == 5 * 2 * len(calls)
    handle.uninstrument()


# ---------------------------------------------------------------------------- bad input


def _tiny_llama() -> torch.nn.Module:
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return tf.LlamaForCausalLM(config).eval()


def test_model_without_moe_layers_is_refused_untouched() -> None:
    model = _tiny_llama()
    previous = moetrace.get_recorder()
    with pytest.raises(NoMoELayersError, match="no MoE layer"):
        hf.instrument(model)
    assert hook_counts(model) == 0 and moetrace.get_recorder() is previous


def test_unsupported_family_is_named() -> None:
    class Switch(torch.nn.Module):
        config = tf.PretrainedConfig()
        config.model_type = "switch_transformers"

    with pytest.raises(NoMoELayersError, match=r"switch_transformers.*not supported"):
        hf.instrument(Switch())


def test_old_transformers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = FAMILIES["mixtral"].build()
    monkeypatch.setattr(hf, "installed_version", lambda: "4.46.3")
    with pytest.raises(UnsupportedVersionError, match=r"4\.46\.3"):
        hf.instrument(model)
    assert hook_counts(model) == 0


def test_another_recorder_is_refused_and_the_first_keeps_working() -> None:
    family = FAMILIES["mixtral"]
    model = family.build()
    first = hf.instrument(model)
    hooks = hook_counts(model)
    other = moetrace.ExpertDistributionRecorder(moetrace.RecorderConfig(num_layers=2, num_physical_experts=8, top_k=2))
    with pytest.raises(AlreadyInstrumentedError, match="uninstrument"):
        hf.instrument(model, recorder=other)
    assert hook_counts(model) == hooks and first.active
    first.uninstrument()
    second = hf.instrument(model, recorder=other)
    assert second.recorder is other
    second.uninstrument()


def test_recorder_that_does_not_fit_is_refused() -> None:
    model = FAMILIES["qwen2_moe"].build()
    wrong = moetrace.ExpertDistributionRecorder(moetrace.RecorderConfig(num_layers=3, num_physical_experts=8, top_k=4))
    with pytest.raises(ValueError, match=r"num_layers=3 but the model has 2 MoE layers.*top_k=4"):
        hf.instrument(model, recorder=wrong)
    with pytest.raises(moetrace.adapters.AdapterError, match="no-op"):
        hf.instrument(model, recorder=moetrace.NoOpRecorder())
    assert hook_counts(model) == 0


def test_failure_half_way_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    model = FAMILIES["olmoe"].build()
    previous = moetrace.get_recorder()

    def broken(self, module, wrapper):
        raise RuntimeError("simulated failure while wrapping forward")

    monkeypatch.setattr(HookRegistry, "wrap_forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        hf.instrument(model)
    assert hook_counts(model) == 0
    assert moetrace.get_recorder() is previous
    assert moetrace.adapters.live_instrumentation(model) is None


# ---------------------------------------------------------------------------- coverage


def test_every_moe_family_in_transformers_is_classified() -> None:
    coverage = moe_family_coverage()
    unknown = sorted(f for f, how in coverage.items() if how == "unknown")
    assert not unknown, (
        f"transformers {tf.__version__} has MoE families moetrace has not classified: {unknown}. Add them to "
        "EXPLICIT_SITES, VIA_OTHER_FAMILY or UNSUPPORTED in adapters/hf/families.py"
    )
    listed = {s.family for s in EXPLICIT_SITES} | set(UNSUPPORTED) | set(VIA_OTHER_FAMILY)
    assert listed <= set(coverage), f"stale entries: {sorted(listed - set(coverage))}"
    assert sum(how == "experts" for how in coverage.values()) >= 50
    for family in FAMILIES.values():  # a configuration-only family is built with another's modules
        expected = "via-other-family" if family.name in VIA_OTHER_FAMILY else family.kind
        assert coverage[family.name] == expected

