"""An independent count: the Hugging Face forward of the same checkpoint, its router's top-k per token."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3MoeForCausalLM

from .checkpoint import TOP_K

__all__ = ["hf_routes"]


def hf_routes(checkpoint: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """Per sequence, the experts each position routes to: ``[positions, L, k]``, ids sorted within a token."""
    model = Qwen3MoeForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    routes = []
    with torch.no_grad():
        for ids in sequences:
            out = model(torch.tensor([ids]), output_router_logits=True)
            per_layer = [logits.reshape(len(ids), -1).topk(TOP_K, dim=-1).indices for logits in out.router_logits]
            routes.append(torch.stack(per_layer, dim=1).sort(dim=-1).values.numpy())
    return routes
