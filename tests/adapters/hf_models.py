"""Tiny random-weight transformers MoE models and an independent router capture for tests.

Each :class:`Family` builds a 2-3 layer model (hidden 32) from a config, no
hub access, and knows how to read which experts each token went to from the
*router's output* (a hook on the router module written here, independent of
the adapter's hooks on the experts modules).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import transformers as tf

VOCAB = 64


def _mask_from_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], num_experts, dtype=torch.bool).scatter_(1, ids.long(), True)


def _tuple_last(block: torch.nn.Module, output: object, num_experts: int) -> torch.Tensor:
    """Routers returning ``(logits, weights, indices)``."""
    return _mask_from_ids(output[-1], num_experts)  # type: ignore[index]


def _llama4(block: torch.nn.Module, output: object, num_experts: int) -> torch.Tensor:
    # Llama4Router returns sigmoid scores with -inf (-> 0) for every expert not selected.
    return output[0] > 0  # type: ignore[index]


def _dbrx(block: torch.nn.Module, output: object, num_experts: int) -> torch.Tensor:
    _, indices = block.route_tokens_to_experts(output)  # type: ignore[operator]
    return _mask_from_ids(indices, num_experts)


def _jetmoe(block: torch.nn.Module, output: object, num_experts: int) -> torch.Tensor:
    _, batch_index, _, expert_size, logits = output  # type: ignore[misc]
    experts = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(expert_size))
    mask = torch.zeros(logits.shape[0], num_experts, dtype=torch.bool)
    mask[batch_index, experts] = True
    return mask


@dataclass
class Family:
    """A tiny model of one transformers MoE family.

    ``block`` is the MoE block class, ``router`` its router attribute and
    ``selected(block, router_output, E) -> [T, E] bool`` reads the routing.
    """

    name: str
    build: Callable[[], torch.nn.Module]
    block: str
    router: str
    selected: Callable[[torch.nn.Module, object, int], torch.Tensor]
    num_experts: int
    top_k: int
    layer_ids: list[int]
    kind: str = "experts"


def _lm(config_cls: type, model_cls: type, **fields: object) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        config = config_cls(vocab_size=VOCAB, max_position_embeddings=64, **fields)
        model = model_cls(config).eval()
        with torch.no_grad():  # random init is too small to spread routing: widen the routers
            for name, param in model.named_parameters():
                if any(key in name for key in ("gate", "router")) and param.dim() == 2:
                    param.normal_(0, 1.0)
        return model

    return build


COMMON = dict(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("mixtral", _lm(tf.MixtralConfig, tf.MixtralForCausalLM, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, **COMMON),
               "MixtralSparseMoeBlock", "gate", _tuple_last, 8, 2, [0, 1]),
        # Qwen2-MoE: shared expert, and layer 1 dense through mlp_only_layers.
        Family("qwen2_moe", _lm(tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=16, shared_expert_intermediate_size=16, mlp_only_layers=[1], **COMMON),
               "Qwen2MoeSparseMoeBlock", "gate", _tuple_last, 8, 2, [0, 2]),
        Family("qwen3_moe", _lm(tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=16, head_dim=8, **COMMON),
               "Qwen3MoeSparseMoeBlock", "gate", _tuple_last, 8, 2, [0, 1]),
        Family("olmoe", _lm(tf.OlmoeConfig, tf.OlmoeForCausalLM, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, **COMMON),
               "OlmoeSparseMoeBlock", "gate", _tuple_last, 8, 2, [0, 1]),
        # DeepSeek-V3: first layer dense, group-limited routing (4 groups, 2 kept).
        Family("deepseek_v3", _lm(tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, num_hidden_layers=3, first_k_dense_replace=1,
                                  n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                  moe_intermediate_size=16, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, **{**COMMON, "num_key_value_heads": 4}),
               "DeepseekV3MoE", "gate", _tuple_last, 8, 2, [1, 2]),
        # Param2-MoE: a configuration only; transformers builds it with GLM-4.5-MoE's modeling (sigmoid scores,
        # selection bias, group-limited: 2 groups, 1 kept; first layer dense).
        Family("param2moe", _lm(tf.Param2MoeConfig, tf.AutoModelForCausalLM.from_config, num_hidden_layers=3, first_k_dense_replace=1,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                moe_intermediate_size=16, head_dim=8, **COMMON),
               "Glm4MoeMoE", "gate", _tuple_last, 8, 2, [1, 2]),
        Family("gpt_oss", _lm(tf.GptOssConfig, tf.GptOssForCausalLM, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                              head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"], **COMMON),
               "GptOssMLP", "router", _tuple_last, 8, 2, [0, 1]),
        # Llama 4: every second layer MoE; router-level hook.
        Family("llama4", _lm(tf.Llama4TextConfig, tf.Llama4ForCausalLM, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                             intermediate_size_mlp=32, interleave_moe_layer_step=2, head_dim=8,
                             **{k: v for k, v in COMMON.items()}),
               "Llama4TextMoe", "router", _llama4, 8, 2, [1], kind="router-topk"),
        Family("dbrx", _lm(tf.DbrxConfig, tf.DbrxForCausalLM, d_model=32, n_heads=4, n_layers=2,
                           attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2}),
               "DbrxFFN", "router", _dbrx, 8, 2, [0, 1], kind="experts-call"),
        Family("jetmoe", _lm(tf.JetMoeConfig, tf.JetMoeForCausalLM, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                             num_key_value_heads=2, kv_channels=8, num_local_experts=8, num_experts_per_tok=2),
               "JetMoeMoE", "router", _jetmoe, 8, 2, [0, 1], kind="router-topk"),
    ]
}


@dataclass
class RouterCapture:
    """Per-pass ``[T, E]`` selection masks per MoE layer, read from router outputs."""

    passes: list[list[torch.Tensor]] = field(default_factory=list)

    def counts(self, num_layers: int, num_experts: int) -> torch.Tensor:
        """Total ``[L, E]`` counts over every captured pass."""
        total = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        for layers in self.passes:
            for layer, mask in enumerate(layers):
                total[layer] += mask.sum(0)
        return total


@contextlib.contextmanager
def capture_routers(model: torch.nn.Module, family: Family) -> Iterator[RouterCapture]:
    """Record what each router selected, one entry per model forward."""
    capture = RouterCapture()
    blocks = [m for m in model.modules() if type(m).__name__ == family.block]
    assert len(blocks) == len(family.layer_ids), f"{family.name}: expected {len(family.layer_ids)} MoE blocks, found {len(blocks)}"
    handles = [model.register_forward_pre_hook(lambda *_: capture.passes.append([None] * len(blocks)))]

    def router_hook(layer: int, block: torch.nn.Module) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            capture.passes[-1][layer] = family.selected(block, output, family.num_experts).detach().clone()
        return hook

    for layer, block in enumerate(blocks):
        handles.append(getattr(block, family.router).register_forward_hook(router_hook(layer, block)))
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def hook_counts(model: torch.nn.Module) -> int:
    """Every forward / pre-hook registered anywhere in ``model`` (plus instance ``forward`` overrides)."""
    total = 0
    for module in model.modules():
        total += len(module._forward_pre_hooks) + len(module._forward_hooks)
        total += "forward" in module.__dict__
    return total
