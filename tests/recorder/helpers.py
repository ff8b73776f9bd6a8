"""Routing streams and a plain numpy oracle for recorder tests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from moetrace.data import olmoe_counts
from moetrace.recorder import ExpertDistributionRecorder
from moetrace.testing import CpuGraph


def numpy_counts(passes: list[list[np.ndarray]], num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Oracle: ``(counts [L, P], invalid [L])`` from per-pass, per-layer id arrays ``[T, k]``."""
    num_layers = len(passes[0])
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    invalid = np.zeros(num_layers, dtype=np.int64)
    for layers in passes:
        for layer, ids in enumerate(layers):
            flat = ids.reshape(-1)
            ok = (flat >= 0) & (flat < num_experts)
            counts[layer] += np.bincount(flat[ok], minlength=num_experts)
            invalid[layer] += int(((flat != -1) & ~ok).sum())
    return counts, invalid


def random_passes(rng: np.random.Generator, num_passes: int, num_layers: int, num_experts: int, top_k: int, max_tokens: int = 12, bad: bool = True) -> list[list[np.ndarray]]:
    """Random routing; with ``bad`` some ids are -1 (padding) or out of range."""
    out = []
    for _ in range(num_passes):
        tokens = int(rng.integers(1, max_tokens + 1))
        layers = []
        for _ in range(num_layers):
            ids = np.stack([rng.choice(num_experts, size=top_k, replace=False) for _ in range(tokens)])
            if bad:
                mask = rng.random(ids.shape)
                ids = np.where(mask < 0.05, -1, ids)
                ids = np.where((mask > 0.97), num_experts + rng.integers(0, 50, ids.shape), ids)
                ids = np.where((mask > 0.95) & (mask <= 0.97), -7, ids)
            layers.append(ids.astype(np.int64))
        out.append(layers)
    return out


def replay(recorder: ExpertDistributionRecorder, passes: list[list[np.ndarray]], dtype: torch.dtype = torch.int64) -> None:
    """Drive the hooks with ``passes`` as a runtime would (one forward per pass)."""
    for layers in passes:
        with recorder.with_forward_pass():
            for layer, ids in enumerate(layers):
                with recorder.with_current_layer(layer):
                    recorder.on_select_experts(torch.as_tensor(ids, dtype=dtype))


def olmoe_token_stream(domain: str, tokens_per_pass: int, scale: int, seed: int = 0) -> tuple[np.ndarray, Iterator[list[np.ndarray]]]:
    """Replay real OLMoE counts (3 layers x 64 experts, top-8) as a token stream.

    Each layer's count vector is divided by ``scale`` (rounded), expanded into
    that many assignments, shuffled, and cut into tokens of 8 distinct-slot
    ids. Returns the exact expected counts ``[3, 64]`` and the passes.
    """
    data = olmoe_counts()
    rng = np.random.default_rng(seed)
    counts = np.rint(np.asarray(data["expert_counts"][domain], dtype=np.float64) / scale).astype(np.int64)
    top_k = data["top_k"]
    per_layer = []
    for layer_counts in counts:
        ids = np.repeat(np.arange(len(layer_counts)), layer_counts)
        rng.shuffle(ids)
        usable = len(ids) - len(ids) % top_k
        per_layer.append(ids[:usable])
    tokens = min(len(ids) for ids in per_layer) // top_k
    expected = np.stack([np.bincount(ids[: tokens * top_k], minlength=counts.shape[1]) for ids in per_layer])

    def passes() -> Iterator[list[np.ndarray]]:
        for start in range(0, tokens, tokens_per_pass):
            stop = min(start + tokens_per_pass, tokens)
            yield [ids[start * top_k : stop * top_k].reshape(-1, top_k) for ids in per_layer]

    return expected, passes()


def captured_hooks(recorder: ExpertDistributionRecorder, static: torch.Tensor) -> CpuGraph:
    """A graph of one pass's hooks on the static ids ``[L, T, k]`` (layer ``l`` reads ``static[l]``),
    captured once, as an engine captures at start-up."""
    graph = CpuGraph()
    with graph.capture():
        for layer in range(static.shape[0]):
            with recorder.with_current_layer(layer):
                recorder.on_select_experts(static[layer])
    return graph
