"""A small Megatron-Core MoE model for the tests: embedding, ``MoELayer`` stack, output head.

Built from Megatron's own local spec (``get_moe_module_spec(use_te=False)``) on the
expert-parallel process groups of ``parallel_state`` (gloo, CPU). Every rank holds the
same embedding, routers and head (same seed) and its own slice of the experts; each rank
feeds its own tokens (data parallel over the EP group), as a training step does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import shims

__all__ = ["HiddenStack", "MoEStack", "StackSpec", "build", "setup_parallel", "teardown_parallel"]


@dataclass(frozen=True)
class StackSpec:
    """What to build. ``dispatcher``: ``"alltoall"`` or ``"allgather"``."""

    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 16
    ffn: int = 32
    vocab: int = 64
    dispatcher: str = "alltoall"
    capacity_factor: float | None = None
    routing_replay: bool = False
    recompute_moe: bool = False
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float | None = 1e-3
    score_function: str = "softmax"
    seed: int = 0


class MoEStack(torch.nn.Module):
    """``input_ids [B, S]`` -> logits ``[B, S, vocab]`` through ``num_layers`` residual MoE layers.

    As in ``GPTModel``, hidden states are ``[S, B, H]`` inside (the MoE layers see
    tokens sequence-major). ``skip`` names layers the forward leaves out (a negative
    control for the replay audit: a router that is never reached).
    """

    def __init__(self, spec: StackSpec, config: Any, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.embed = torch.nn.Embedding(spec.vocab, spec.hidden)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(spec.hidden) for _ in layers)
        self.layers = torch.nn.ModuleList(layers)
        self.head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.skip: set[int] = set()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids.t())
        for i, (norm, layer) in enumerate(zip(self.norms, self.layers, strict=True)):
            if i in self.skip:
                continue
            out, _ = layer(norm(hidden))
            hidden = hidden + out
        return self.head(hidden).transpose(0, 1)


class HiddenStack(torch.nn.Module):
    """Hidden states ``[S, B, H]`` -> ``[S, B, H]`` through ``MoELayer`` s alone, residual: how
    Megatron-Core's own unit tests drive MoE layers (and what an RL trainer's module may look
    like). Its first argument is no ``input_ids``: ``S * B * H`` elements, ``S * B`` tokens."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            out, _ = layer(hidden)
            hidden = hidden + out
        return hidden


def setup_parallel(ep_size: int) -> None:
    """Expert-parallel groups of size ``ep_size`` over the initialised (gloo) world."""
    from megatron.core import parallel_state

    shims.apply()
    shims.reset_megatron_state()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep_size)


def teardown_parallel() -> None:
    from megatron.core import parallel_state

    shims.reset_megatron_state()
    parallel_state.destroy_model_parallel()


def build(spec: StackSpec, dtype: torch.dtype = torch.float32) -> MoEStack:
    """Build the stack on the current parallel groups (call :func:`setup_parallel` first)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra: dict[str, Any] = {}
    if spec.capacity_factor is not None:
        extra.update(moe_expert_capacity_factor=spec.capacity_factor, moe_token_drop_policy="probs")
    if spec.recompute_moe:
        extra.update(recompute_granularity="selective", recompute_modules=["moe"])
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden,
        ffn_hidden_size=spec.ffn,
        moe_ffn_hidden_size=spec.ffn,
        num_attention_heads=2,
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.top_k,
        moe_token_dispatcher_type=spec.dispatcher,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=spec.aux_loss_coeff,
        moe_z_loss_coeff=spec.z_loss_coeff,
        moe_router_score_function=spec.score_function,
        moe_enable_routing_replay=spec.routing_replay,
        expert_model_parallel_size=torch.distributed.get_world_size(),
        use_cpu_initialization=True,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **extra,
    )
    moe_spec = get_moe_module_spec(use_te=False, num_experts=spec.num_experts, moe_grouped_gemm=False)
    torch.manual_seed(spec.seed)
    layers = []
    for number in range(1, spec.num_layers + 1):
        layer = MoELayer(config, submodules=moe_spec.submodules, layer_number=number)
        layer.set_layer_number(number)  # aux losses are tracked only for numbered layers
        layers.append(layer)
    torch.manual_seed(spec.seed + 1)
    model = MoEStack(spec, config, layers).to(dtype)
    return model
