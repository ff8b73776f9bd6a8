"""A tiny random-weight Qwen3-MoE checkpoint that SGLang loads from disk (no hub access).

Qwen3-MoE because SGLang's expert-location support (what its recorder and the
moetrace adapter need) covers it; tiny Mixtral has none, and Qwen2-MoE's
shared-expert gate needs a Triton GPU driver. Weights come from transformers'
own initialisation (``save_pretrained``), in float32 so that the independent
Hugging Face forward routes exactly as SGLang does. The engine is driven with
token ids (``skip_tokenizer_init``), so no tokenizer is saved.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["HOT_BOOST", "HOT_SHIFT", "NUM_EXPERTS", "NUM_LAYERS", "TOP_K", "VOCAB", "build_checkpoint", "config"]

NUM_LAYERS, NUM_EXPERTS, TOP_K, VOCAB = 3, 8, 2, 128


def config() -> Qwen3MoeConfig:
    """3 MoE layers, 8 experts, top-2, hidden 64."""
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, torch_dtype="float32",
    )


HOT_SHIFT, HOT_BOOST = 0.05, 0.5
"""Router bias of a skewed checkpoint: embedding column 0 shifted by ``HOT_SHIFT`` (so the
normalised router input has a positive component 0 for every token) and the hot experts'
router weights on that component raised by ``HOT_BOOST``."""


def build_checkpoint(directory: Path, seed: int = 0, hot_experts: tuple[int, ...] = ()) -> Path:
    """Save the model (random float32 weights) into ``directory``; ``hot_experts`` get a router bias.

    With ``hot_experts=(0, 1)`` those two experts take about half of the assignments in
    every layer on the test prompts (8 experts, top-2): a skewed load to plan a placement for.
    """
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config()).to(torch.float32)
    if hot_experts:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] += HOT_SHIFT
            for layer in model.model.layers:
                layer.mlp.gate.weight[list(hot_experts), 0] += HOT_BOOST
    model.save_pretrained(directory)
    return directory
