"""Tiny random-weight MoE checkpoints that vLLM loads from disk (no hub access).

Weights come from transformers' own initialisation (``save_pretrained``), so
every layer routes differently (``load_format="dummy"`` would give identical
routing in every layer). The tokenizer is a word-level fast tokenizer:
prompt ``"w3 w7 w1"`` is token ids ``[6, 10, 4]``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

__all__ = ["MODELS", "build_checkpoint", "prompt"]

VOCAB = 128
_SPECIALS = ["<unk>", "<s>", "</s>"]

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)

MODELS: dict[str, dict[str, object]] = {
    # 3 MoE layers, 8 experts, top-2.
    "mixtral": dict(num_experts=8, top_k=2, layer_ids=(0, 1, 2)),
    # 3 layers of which layer 1 is dense (mlp_only_layers), 8 experts, top-2, shared expert.
    "qwen2_moe": dict(num_experts=8, top_k=2, layer_ids=(0, 2)),
}


def _config(name: str) -> tuple[type, object]:
    if name == "mixtral":
        return MixtralForCausalLM, MixtralConfig(
            intermediate_size=256, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2, **_COMMON,
        )
    if name == "qwen2_moe":
        return Qwen2MoeForCausalLM, Qwen2MoeConfig(
            intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128,
            num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[1], norm_topk_prob=False, **_COMMON,
        )
    raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")


def _tokenizer() -> PreTrainedTokenizerFast:
    words = _SPECIALS + [f"w{i}" for i in range(VOCAB - len(_SPECIALS))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """Save model ``name`` (random bf16 weights) and its tokenizer into ``directory``."""
    cls, config = _config(name)
    torch.manual_seed(seed)
    model = cls(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def prompt(*word_ids: int) -> str:
    """The prompt whose token ids are ``word_ids`` shifted past the special tokens."""
    return " ".join(f"w{i}" for i in word_ids)
