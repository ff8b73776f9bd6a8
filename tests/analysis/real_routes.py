"""A single-rank trace of real routes: reference routers biased with the real OLMoE counts.

Three MoE layers (OLMoE layers 0, 7, 15), 64 experts, top-8: each layer's
:class:`~moetrace.reference.TopKRouter` carries :func:`~moetrace.reference.olmoe_bias`
fitted to that layer's real counts, routes random hidden states, and the real
recorder records the ids (``ep_size=1``, ``stat``). The expected counts come
straight from the router's ids (``np.bincount``), independent of moetrace.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from moetrace.reference import TopKRouter, olmoe_bias

from .helpers import record

NUM_EXPERTS, TOP_K, HIDDEN = 64, 8, 64
LAYER_IDS = (0, 7, 15)


def olmoe_router_ids(tokens: int = 4096, domain: str = "github", seed: int = 0) -> np.ndarray:
    """Routed expert ids ``[tokens, 3, 8]`` from the three OLMoE-biased routers."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    with torch.no_grad():
        for layer in range(len(LAYER_IDS)):
            router = TopKRouter(HIDDEN, NUM_EXPERTS, TOP_K, bias=olmoe_bias(NUM_EXPERTS, layer=layer, domain=domain), seed=seed + layer)
            ids, _ = router(torch.randn(tokens, HIDDEN, generator=generator))
            layers.append(ids.numpy())
    return np.stack(layers, axis=1)


def olmoe_router_trace(tmp: Path, tokens: int = 4096, tokens_per_pass: int = 256) -> tuple[Path, np.ndarray]:
    """Record the routes as a one-rank ``stat`` trace; returns ``(path, counts [3, 64])``."""
    ids = olmoe_router_ids(tokens)
    passes = [ids[s : s + tokens_per_pass] for s in range(0, tokens, tokens_per_pass)]
    path = record(tmp, "stat", passes, num_experts=NUM_EXPERTS, ep_size=1, layer_ids=LAYER_IDS, name="olmoe-router.h5")
    counts = np.stack([np.bincount(ids[:, layer].reshape(-1), minlength=NUM_EXPERTS) for layer in range(len(LAYER_IDS))])
    return path, counts
