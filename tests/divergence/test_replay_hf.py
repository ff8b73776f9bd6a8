"""`moetrace.adapters.hf.replay` on tiny random-weight models of ten transformers MoE families."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from moetrace.adapters import hf
from moetrace.adapters.hf.families import REPLAY_REFUSED, REPLAY_TESTED, replay_coverage

from moetrace.analysis.divergence import route_divergence
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.provenance import RouteProvenance
from moetrace.replay import ReplayError
from moetrace.routes import logical_ids, pad_routes
from moetrace.wire import encode_routed_experts
from tests.adapters.hf_models import COMMON, FAMILIES, VOCAB, _lm, hook_counts

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
NAMES = list(FAMILIES)

# More families, replay-only (the adapter's own tests cover the ten above): (config, model, fields).
MORE: dict[str, tuple[type, type, dict[str, object]]] = {
    # GLM-4.5 MoE: sigmoid scores + selection bias, group-limited (2 groups, 1 kept), scaled.
    "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM, dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                                              topk_group=1, moe_intermediate_size=16, first_k_dense_replace=0, head_dim=8, **COMMON)),
    "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM, dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, **COMMON)),
    "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM, dict(num_hidden_layers=2, moe_num_experts=8, moe_k=2, moe_intermediate_size=16,
                                                                            moe_layer_start_index=0, **COMMON)),
    "hunyuan_v1_moe": (tf.HunYuanMoEV1Config, tf.HunYuanMoEV1ForCausalLM, dict(num_hidden_layers=2, num_experts=8, moe_topk=2, head_dim=8, **COMMON)),
    "minimax": (tf.MiniMaxConfig, tf.MiniMaxForCausalLM, dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                                                              layer_types=["full_attention", "full_attention"], **COMMON)),
    # DeepSeek-V2: group-limited greedy routing, MLA attention.
    "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                                                        qk_nope_head_dim=8, v_head_dim=8, **{**COMMON, "num_key_value_heads": 4})),
    "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                     shared_expert_intermediate_size=16, head_dim=8,
                                                                     layer_types=["full_attention", "full_attention"], **COMMON)),
    "dots1": (tf.Dots1Config, tf.Dots1ForCausalLM, dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                        first_k_dense_replace=0, head_dim=8, n_shared_experts=1, routed_scaling_factor=1.0, **COMMON)),
    "flex_olmo": (tf.FlexOlmoConfig, tf.FlexOlmoForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, pad_token_id=0,
                                                                  eos_token_id=1, bos_token_id=2, **COMMON)),
    "lfm2_moe": (tf.Lfm2MoeConfig, tf.Lfm2MoeForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                               num_dense_layers=0, layer_types=["full_attention", "full_attention"], **COMMON)),
    "exaone_moe": (tf.ExaoneMoeConfig, tf.ExaoneMoeForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                     head_dim=8, **COMMON)),
    "solar_open": (tf.SolarOpenConfig, tf.SolarOpenForCausalLM, dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                     head_dim=8, **COMMON)),
    "afmoe": (tf.AfmoeConfig, tf.AfmoeForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                        num_dense_layers=0, head_dim=8, **COMMON)),
    "cohere2_moe": (tf.Cohere2MoeConfig, tf.Cohere2MoeForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                        **COMMON)),
    "glm4_moe_lite": (tf.Glm4MoeLiteConfig, tf.Glm4MoeLiteForCausalLM, dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                                                            first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                                                                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                                                            **{**COMMON, "num_key_value_heads": 4})),
    "mimo_v2_flash": (tf.MiMoV2FlashConfig, tf.MiMoV2FlashForCausalLM, dict(num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
                                                                            moe_intermediate_size=16, head_dim=8, **COMMON)),
    "laguna": (tf.LagunaConfig, tf.LagunaForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                                                           **COMMON)),
    "mellum": (tf.MellumConfig, tf.MellumForCausalLM, dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                                                           **COMMON)),
    "granitemoeshared": (tf.GraniteMoeSharedConfig, tf.GraniteMoeSharedForCausalLM, dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                                                                                         shared_intermediate_size=16, **COMMON)),
}


def _inputs(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True, scope="module")
def _recorder_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    RECORDER_DIR.append(tmp_path_factory.mktemp("recorder"))


RECORDER_DIR: list[Path] = []


def capture(model: torch.nn.Module, ids: torch.Tensor, **forward: object) -> tuple[torch.Tensor, np.ndarray]:
    """Logits and routes ``[B, S, model layers, k]`` (-1 for dense layers) of one forward, captured by moetrace."""
    batch, length = ids.shape
    sites = hf.find_moe_sites(model)
    k = hf.layers.model_top_k(model, sites)
    capturer = RoutedExpertsCapturer(max(s.layer_id for s in sites) + 1, k, max_tokens_per_pass=batch * length, num_kv_slots=batch * length)
    handle = hf.instrument(model, capturer=capturer, capture_seq_len=length, output_dir=RECORDER_DIR[-1])
    try:
        with torch.no_grad():
            logits = model(ids, **forward).logits
        routes = np.stack([handle.routed_experts(row, length, batch_size=batch) for row in range(batch)]).astype(np.int64)
    finally:
        handle.uninstrument()
    return logits, routes


def assert_replay_reproduces(model: torch.nn.Module, ids: torch.Tensor, given: object, logits: torch.Tensor, routes: np.ndarray, **forward: object) -> None:
    """Under ``hf.replay(model, given)`` a forward over ``ids`` takes exactly ``routes`` and gives ``logits`` (to 1e-6)."""
    with hf.replay(model, given):
        replayed_logits, replayed = capture(model, ids, **forward)
    np.testing.assert_array_equal(replayed, routes)
    assert (replayed_logits - logits).abs().max().item() <= 1e-6


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {name: FAMILIES[name].build() for name in NAMES}


# Families whose configuration takes a subset of these fields (only the accepted ones are passed).
_TINY = dict(num_hidden_layers=2, num_experts=8, n_routed_experts=8, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
             first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             layer_types=None, pad_token_id=0, eos_token_id=1, bos_token_id=2, **{**COMMON, "num_key_value_heads": 4})
_FULL = {"layer_types": ["full_attention", "full_attention"]}  # hybrid families: attention layers only
_MLA = {"q_lora_rank": 16}
GENERIC: dict[str, tuple[str, dict[str, object]]] = {
    "axk1": ("AXK1ForCausalLM", _MLA),
    "axk2": ("AXK2ForCausalLM", _MLA),
    "bailing_hybrid": ("BailingHybridForCausalLM", _FULL),
    "deepseek_v32": ("DeepseekV32ForCausalLM", _MLA),
    "dots3_note": ("Dots3NoteForCausalLM", _MLA),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", _MLA),
    "granitemoe_swa": ("GraniteMoeSWAForCausalLM", {}),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", {**_FULL, "mamba_n_heads": 4, "mamba_expand": 2, "mamba_d_head": 16}),
    "hy_v3": ("HYV3ForCausalLM", {}),
    "hy_v4": ("HYV4ForCausalLM", _MLA),
    "inkling": ("InklingForCausalLM", {}),
    "inkling2": ("Inkling2ForCausalLM", {}),
    "jamba": ("JambaForCausalLM", {"attn_layer_period": 1, "attn_layer_offset": 0, "expert_layer_period": 1, "expert_layer_offset": 0}),
    "kimi_linear": ("KimiLinearForCausalLM", _FULL),
    "kolibri1": ("Kolibri1ForCausalLM", {}),
    "lara_mini": ("LaraMiniForCausalLM", {}),
    # LongCat-Flash: routes to real and zero-compute (identity) experts; experts-call site.
    "longcat_flash": ("LongcatFlashForCausalLM", {**_MLA, "num_layers": 1, "ffn_hidden_size": 32, "expert_ffn_hidden_size": 16, "zero_expert_num": 2,
                                             "moe_topk": 2}),
    "minimax_m2": ("MiniMaxM2ForCausalLM", {}),
    "mistral4": ("Mistral4ForCausalLM", {}),
    "nemotron_h": ("NemotronHForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", _FULL),
}


def _generic(family: str) -> tuple[type, type, dict[str, object]]:
    import importlib
    import inspect

    name, overrides = GENERIC[family]
    cls = getattr(importlib.import_module(f"transformers.models.{family}"), name)
    accepted = inspect.signature(cls.config_class.__init__).parameters
    fields = {k: v for k, v in {**_TINY, **overrides}.items() if k in accepted or k.endswith("_token_id") or k in overrides}
    return cls.config_class, cls, fields


def test_tested_families_are_the_ones_run_here() -> None:
    assert set(REPLAY_TESTED) == set(NAMES) | set(MORE) | set(GENERIC)
    coverage = replay_coverage()
    assert all(coverage[name] == "tested" for name in NAMES)
    assert all(coverage[name].startswith("refused") for name in REPLAY_REFUSED)


@pytest.mark.parametrize("name", NAMES)
def test_replaying_own_routes_reproduces_logits_and_routes(name: str, models: dict[str, torch.nn.Module]) -> None:
    model = models[name]
    ids = _inputs()
    logits, routes = capture(model, ids)
    assert (routes[..., FAMILIES[name].layer_ids, :] >= 0).all()
    baseline = hook_counts(model)
    with hf.replay(model, routes) as handle:
        assert handle.active and hook_counts(model) > baseline
        replayed_logits, replayed_routes = capture(model, ids)
    assert hook_counts(model) == baseline and not handle.active
    assert (replayed_logits - logits).abs().max().item() <= 1e-6
    np.testing.assert_array_equal(replayed_routes, routes)


@pytest.mark.parametrize("name", sorted(MORE) + sorted(GENERIC))
def test_more_families_replay_own_and_forced_routes(name: str) -> None:
    config, cls, fields = MORE[name] if name in MORE else _generic(name)
    model = _lm(config, cls, **fields)()
    ids = _inputs()
    logits, routes = capture(model, ids, use_cache=False)  # sparse-attention indexers (DSA) need no cache here
    assert_replay_reproduces(model, ids, routes, logits, routes, use_cache=False)
    sites = hf.find_moe_sites(model)
    experts, k = sites[0].num_experts, routes.shape[-1]
    rng = np.random.default_rng(0)
    forced = np.stack([rng.permutation(experts)[:k] for _ in range(ids.numel() * len(sites))]).reshape(*ids.shape, len(sites), k)
    with hf.replay(model, forced):
        _, followed = capture(model, ids, use_cache=False)
    np.testing.assert_array_equal(followed[..., [s.layer_id for s in sites], :], forced)


@pytest.mark.parametrize("name", NAMES)
def test_other_routes_are_followed_exactly(name: str, models: dict[str, torch.nn.Module]) -> None:
    """Routes drawn at random: the model's MoE layers go exactly there (what the adapter records)."""
    model, family = models[name], FAMILIES[name]
    ids = _inputs()
    logits, own = capture(model, ids)
    rng = np.random.default_rng(0)
    forced = np.stack([rng.permutation(family.num_experts)[: family.top_k] for _ in range(ids.numel() * len(family.layer_ids))])
    forced = forced.reshape(*ids.shape, len(family.layer_ids), family.top_k)  # MoE layers only
    with hf.replay(model, forced):
        replayed_logits, replayed = capture(model, ids)
    np.testing.assert_array_equal(replayed[..., family.layer_ids, :], forced)
    assert route_divergence(replayed[..., family.layer_ids, :], forced).router_agreement == 1.0
    assert route_divergence(own[..., family.layer_ids, :], forced).router_agreement < 0.5
    assert (replayed_logits - logits).abs().max().item() > 1e-4


FAMILIES_ROUTER = {f.block: f.router for f in FAMILIES.values()}


def _gate_weights(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Router logits, ids and the weights the experts module received, per MoE layer (one forward)."""
    sites = hf.find_moe_sites(model)
    logits, topk_ids, weights = [], [], []
    handles = []

    def experts_args(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        topk_ids.append(args[1])
        weights.append(args[2].detach())

    for site in sites:
        block = model.get_submodule(site.name.rpartition(".")[0])
        handles.append(getattr(block, FAMILIES_ROUTER[type(block).__name__]).register_forward_hook(lambda m, a, out: logits.append(out[0].detach().reshape(-1, out[0].shape[-1]))))
        handles.append(site.module.register_forward_pre_hook(experts_args))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return logits, topk_ids, weights


@pytest.mark.parametrize(
    ("name", "norm"),
    [
        # Mixtral: softmax over all experts, then the k chosen renormalised.
        ("mixtral", lambda lg, i, m: (p := lg.softmax(-1).gather(1, i)) / p.sum(-1, keepdim=True)),
        # Qwen2-MoE (norm_topk_prob=False by default): softmax over all experts, not renormalised.
        ("qwen2_moe", lambda lg, i, m: lg.softmax(-1).gather(1, i)),
        # gpt-oss: softmax over the k chosen logits.
        ("gpt_oss", lambda lg, i, m: lg.gather(1, i).softmax(-1)),
        # DeepSeek-V3: sigmoid scores at the chosen ids (selection bias not applied), renormalised, scaled.
        ("deepseek_v3", lambda lg, i, m: (s := lg.sigmoid().gather(1, i)) / (s.sum(-1, keepdim=True) + 1e-20) * m.config.routed_scaling_factor),
    ],
)
def test_weights_follow_the_familys_normalisation_at_replayed_ids(name: str, norm: object, models: dict[str, torch.nn.Module]) -> None:
    model, family = models[name], FAMILIES[name]
    ids = _inputs(batch=1, length=9, seed=3)
    rng = np.random.default_rng(1)
    forced = np.stack([rng.permutation(family.num_experts)[: family.top_k] for _ in range(ids.numel() * len(family.layer_ids))])
    forced = forced.reshape(ids.numel(), len(family.layer_ids), family.top_k)
    with hf.replay(model, forced):
        logits, topk_ids, weights = _gate_weights(model, ids)
    for layer, (lg, got_ids, got) in enumerate(zip(logits, topk_ids, weights, strict=True)):
        np.testing.assert_array_equal(got_ids.numpy(), forced[:, layer])
        torch.testing.assert_close(got, norm(lg.float(), got_ids, model).to(got.dtype), rtol=1e-5, atol=1e-6)  # type: ignore[operator]


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "llama4"])
def test_gradients_reach_the_router_in_training_mode(name: str, models: dict[str, torch.nn.Module]) -> None:
    model = models[name]
    ids = _inputs()
    _, routes = capture(model, ids)
    routers = [p for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight"))]
    assert routers

    def grads(replaying: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        model.train()
        try:
            if replaying:
                with hf.replay(model, routes):
                    loss = model(ids, labels=ids).loss
                    loss.backward()
            else:
                loss = model(ids, labels=ids).loss
                loss.backward()
        finally:
            model.eval()
        return loss.detach(), [p.grad.clone() for p in routers]

    plain_loss, plain = grads(False)
    replay_loss, replayed = grads(True)
    model.zero_grad()
    assert torch.equal(plain_loss, replay_loss)
    for a, b in zip(plain, replayed, strict=True):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_activation_checkpointing_recomputes_with_the_replayed_routes(models: dict[str, torch.nn.Module]) -> None:
    """With gradient checkpointing the MoE blocks run again inside backward(): they must route as in the forward."""
    model = models["mixtral"]
    ids = _inputs()
    rng = np.random.default_rng(5)
    forced = np.stack([rng.permutation(8)[:2] for _ in range(ids.numel() * 2)]).reshape(*ids.shape, 2, 2)
    router = model.model.layers[0].mlp.gate.weight

    def router_grad(checkpointing: bool) -> torch.Tensor:
        model.zero_grad()
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable()
        try:
            with hf.replay(model, forced):
                model(ids, labels=ids, use_cache=False).loss.backward()
        finally:
            model.activation_checkpointing_disable()
            model.eval()
        return router.grad.clone()

    plain, recomputed = router_grad(False), router_grad(True)
    model.zero_grad()
    assert plain.abs().sum() > 0
    torch.testing.assert_close(recomputed, plain, rtol=1e-6, atol=1e-9)


def test_last_token_without_routes_keeps_its_own_top_k(models: dict[str, torch.nn.Module]) -> None:
    """A rollout's final token has no routes (slime#1045): routes [B, S-1] replay a forward over [B, S]."""
    model = models["mixtral"]
    ids = _inputs(length=8)
    logits, routes = capture(model, ids)
    assert_replay_reproduces(model, ids, routes[:, :-1], logits, routes)
    with pytest.raises(ReplayError, match="routes are for 2 x 6 positions"), hf.replay(model, routes[:, :-2]):
        model(ids)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_replays_each_sequence(side: str, models: dict[str, torch.nn.Module]) -> None:
    """Two sequences of 5 and 8 tokens, padded in one batch: pad positions are -1 rows, never expert 0."""
    model = models["qwen2_moe"]
    seqs = [_inputs(1, 5, seed=4)[0], _inputs(1, 8, seed=5)[0]]
    alone = [capture(model, s[None])[1][0] for s in seqs]
    ids = torch.zeros(2, 8, dtype=torch.int64)
    mask = torch.zeros(2, 8, dtype=torch.int64)
    for row, s in enumerate(seqs):
        span = slice(0, len(s)) if side == "right" else slice(8 - len(s), 8)
        ids[row, span], mask[row, span] = s, 1
    batch_routes = pad_routes(alone, side=side)
    assert (batch_routes[0, 5:] if side == "right" else batch_routes[0, :3]).max() == -1
    with hf.replay(model, batch_routes):
        _, replayed = capture(model, ids, attention_mask=mask)
    for row, s in enumerate(seqs):
        span = slice(0, len(s)) if side == "right" else slice(8 - len(s), 8)
        np.testing.assert_array_equal(replayed[row, span], alone[row])
    assert (replayed[..., 1, :] == -1).all()  # the dense layer (mlp_only_layers=[1]) has no routes


def test_more_than_256_experts_through_the_wire_format() -> None:
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_local_experts=300, num_experts_per_tok=4, max_position_embeddings=64)
    model = tf.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "gate" in n:
                p.normal_(0, 1.0)
    ids = _inputs(1, 12)
    logits, routes = capture(model, ids)
    assert routes.max() > 255
    payload = encode_routed_experts(routes[0])
    assert payload["dtype"] == "uint16"
    assert_replay_reproduces(model, ids, payload, logits, routes)


def test_physical_ids_are_refused_and_logical_ones_replay(models: dict[str, torch.nn.Module]) -> None:
    """Under a replica map (8 experts, 4 redundant slots) the engine reports physical slots; replay takes logical ids."""
    model = models["mixtral"]
    ids = _inputs(1, 6)
    logits, routes = capture(model, ids)
    phy2log = np.tile(np.concatenate([np.arange(8), [0, 1, 2, 3]]), (2, 1))
    physical = np.where(routes < 4, routes + 8, routes)  # experts 0-3 served by their replicas
    with pytest.raises(ReplayError, match="physical ids"):
        hf.replay(model, physical)
    assert_replay_reproduces(model, ids, logical_ids(physical, phy2log), logits, routes)


def test_routes_of_another_weight_version_are_refused_unless_allowed(models: dict[str, torch.nn.Module]) -> None:
    """A rollout's routes say which weights routed them (provenance); replay on other weights refuses them unless told."""
    model = models["mixtral"]
    ids = _inputs(1, 6)
    _, routes = capture(model, ids)
    payload = encode_routed_experts(routes, RouteProvenance(run_id="rollout-1", rank=0, weight_version="step-7"))
    with pytest.raises(ReplayError, match="weight version 'step-7' but 'step-8'"):
        hf.replay(model, payload, weight_version="step-8")
    with hf.replay(model, payload, weight_version="step-8", allow_other_weight_version=True) as handle:
        capture(model, ids)
    assert handle.audit_report().ok
    with hf.replay(model, payload, weight_version="step-7"):
        _, replayed = capture(model, ids)
    np.testing.assert_array_equal(replayed, routes)


def test_prefix_cached_positions_without_routes_route_themselves(models: dict[str, torch.nn.Module]) -> None:
    """An engine returns no routes for prefix-cached tokens: those rows are -1 and keep the model's own top-k."""
    model = models["olmoe"]
    ids = _inputs(1, 10)
    _, routes = capture(model, ids)
    partial = routes.copy()
    partial[:, :4] = -1
    rng = np.random.default_rng(2)
    partial[:, 4:] = np.stack([rng.permutation(8)[:2] for _ in range(6 * 2)]).reshape(1, 6, 2, 2)
    with hf.replay(model, partial):
        _, replayed = capture(model, ids)
    np.testing.assert_array_equal(replayed[:, :4], routes[:, :4])  # causal: positions 0-3 see no replayed position
    np.testing.assert_array_equal(replayed[:, 4:], partial[:, 4:])


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (np.tile([0, 1, 2], (2, 7, 2, 1)), "top_k=3"),
        (np.tile([0, 1], (2, 7, 5, 1)), "5 layers"),
        (np.tile([1, 1], (2, 7, 2, 1)), "repeats"),
        (np.tile([1, -1], (2, 7, 2, 1)), "mixes -1"),
    ],
)
def test_routes_that_do_not_fit_are_refused(routes: np.ndarray, match: str, models: dict[str, torch.nn.Module]) -> None:
    model = models["mixtral"]
    baseline = hook_counts(model)
    with pytest.raises(ReplayError, match=match):
        hf.replay(model, routes)
    assert hook_counts(model) == baseline


def test_dense_layer_routes_must_be_empty(models: dict[str, torch.nn.Module]) -> None:
    model = models["qwen2_moe"]
    routes = np.tile([0, 1], (1, 4, 3, 1))
    with pytest.raises(ReplayError, match="not MoE layers"):
        hf.replay(model, routes)


def test_kv_cache_continuation_and_wrong_batch_are_refused(models: dict[str, torch.nn.Module]) -> None:
    model = models["mixtral"]
    ids = _inputs(1, 6)
    _, routes = capture(model, ids)
    with hf.replay(model, routes), torch.no_grad():
        out = model(ids, use_cache=True)
        with pytest.raises(ReplayError, match="KV cache"):
            model(ids[:, :1], past_key_values=out.past_key_values)
        with pytest.raises(ReplayError, match="2 x 6 tokens"):
            model(ids.repeat(2, 1))
    with hf.replay(model, routes):
        with pytest.raises(ReplayError, match="before any forward"):
            model.model.layers[0].mlp(torch.zeros(1, 6, 32))
        with pytest.raises(ReplayError, match="already replaying"):
            hf.replay(model, routes)
    hf.replay(model, routes).remove()  # after remove() a new replay is fine


def test_refused_family_says_why() -> None:
    torch.manual_seed(0)
    config = tf.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    model = tf.PhimoeForCausalLM(config).eval()
    with pytest.raises(ReplayError, match="sparsemixer"):
        hf.replay(model, np.tile([0, 1], (4, 1, 1)))
