"""What the multi-rank SGLang tests share: the CPU setting for two ranks, and the independent counts.

Two scheduler processes on this 2-core machine need one core each
(``SGLANG_CPU_OMP_THREADS_BIND="0|1"``; without it SGLang asserts that ranks must not
outnumber NUMA nodes). The independent count is the Hugging Face forward of the same
checkpoint on the token sequences the engine computed (:func:`.reference.hf_routes`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import NUM_EXPERTS, NUM_LAYERS
from .engine import GENERATION, PROMPTS
from .reference import hf_routes
from .workload import computed_sequences

__all__ = ["TWO_RANKS", "WORKLOAD_TOKENS", "expert_count", "generate_sequentially", "hf_computed_routes",
           "sglang_recorder_count"]

TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
"""Environment of a two-rank CPU engine: one core per scheduler process."""

WORKLOAD_TOKENS = sum(len(p) + GENERATION["max_new_tokens"] - 1 for p in PROMPTS)
"""Tokens the engine computes for :data:`PROMPTS` one request at a time: 5+3+7 prompt
positions and 3 fed-back generated tokens each (the last one is never fed back) = 24."""


def generate_sequentially(llm: Any) -> list[dict[str, Any]]:
    """One ``generate`` call per prompt (each forward pass then holds one request)."""
    return [llm.generate(input_ids=p, sampling_params=GENERATION) for p in PROMPTS]


def hf_computed_routes(checkpoint: Path, answers: list[dict[str, Any]]) -> list[np.ndarray]:
    """The Hugging Face router's top-k ``[positions, L, k]`` of every computed position, per request."""
    return hf_routes(checkpoint, computed_sequences(answers, PROMPTS))


def expert_count(routes: list[np.ndarray]) -> np.ndarray:
    """Assignments per layer and logical expert ``[L, E]`` of ``routes``."""
    count = np.zeros((NUM_LAYERS, NUM_EXPERTS), np.int64)
    for route in routes:
        for layer in range(NUM_LAYERS):
            count[layer] += np.bincount(route[:, layer].ravel(), minlength=NUM_EXPERTS)
    return count


def sglang_recorder_count(files: list[Path], tp_size: int) -> np.ndarray:
    """``[L, E]`` what the engine routed, from SGLang's own ``stat`` recorder dumps (an independent record
    inside the engine): SGLang all-reduces the ranks' counts over the TP group, so each TP rank's file
    holds ``tp_size`` x the count under TP attention; the files must agree.

    Every TP rank is EP rank 0 here and writes ``expert_distribution_recorder_{time.time()}.pt``, a name
    without the rank (SGLang 0.5.23, ``_StatAccumulator.dump``). Two ranks leaving the all-reduce together
    can read the same clock and write one file (a fresh-clone CI run: both ranks' log lines name
    ``..._1796650638.3074987.pt``), so 1 to ``tp_size`` files."""
    import torch

    assert 1 <= len(files) <= tp_size, f"expected one SGLang dump per TP rank (or fewer, sharing a name), found {files}"
    totals = [torch.load(path, weights_only=True)["logical_count"].numpy().sum(axis=0) for path in files]
    for other in totals[1:]:
        np.testing.assert_array_equal(other, totals[0])
    assert (totals[0] % tp_size == 0).all()
    return totals[0] // tp_size
