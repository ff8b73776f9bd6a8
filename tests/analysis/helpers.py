"""Trace builders (real recorder / TraceWriter) and an independent numpy oracle."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.data import olmoe_counts as olmoe
from moetrace.trace import TraceHeader, TraceWriter


@contextlib.contextmanager
def files_written_here() -> Iterator[None]:
    """Recordings started in the block write their files (segments, checkpoints, small dumps) in
    this process, the recorder's fallback when no writer process can be started (an embedded
    interpreter): for tests that patch this process's writing (a fast clock, :func:`~moetrace.trace.integrity.unsealed`),
    which a writer process would not see."""
    with mock.patch("moetrace.recording.session.WriterProcess", side_effect=OSError("written in the test's process")):
        yield


def random_passes(rng: np.random.Generator, num_passes: int, num_layers: int, num_experts: int, top_k: int, skew: float = 1.5, max_tokens: int = 16) -> list[np.ndarray]:
    """Per pass ``[T, L, k]`` ids, distinct per token, skewed; a few -1 (padding) and out-of-range ids."""
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
    out = []
    for _ in range(num_passes):
        tokens = int(rng.integers(1, max_tokens + 1))
        ids = np.empty((tokens, num_layers, top_k), dtype=np.int64)
        for layer in range(num_layers):
            p = np.roll(weights, layer) / weights.sum()
            for t in range(tokens):
                ids[t, layer] = rng.choice(num_experts, size=top_k, replace=False, p=p)
        mask = rng.random(ids.shape)
        ids[mask < 0.03] = -1
        ids[mask > 0.99] = num_experts + 3  # invalid: counted apart, never as an expert
        out.append(ids)
    return out


def replay_pass(rec: ExpertDistributionRecorder, ids: np.ndarray, pass_id: int | None = None) -> None:
    """Drive the hooks with one forward: ``ids`` ``[T, L, k]``, column ``l`` to compact layer ``l`` (pass id auto when ``None``)."""
    with rec.with_forward_pass(pass_id):
        for layer in range(ids.shape[1]):
            with rec.with_current_layer(layer):
                rec.on_select_experts(torch.as_tensor(ids[:, layer]))


def record(tmp: Path, mode: str, passes: list[np.ndarray], num_experts: int, ep_size: int = 1, window: int = 1000, name: str | None = None, layer_ids: tuple[int, ...] | None = None, physical_to_logical: np.ndarray | None = None, hidden_size: int | None = None) -> Path:
    """Replay ``passes`` (``[T, L, k]`` each) through the real recorder in ``mode`` and dump a trace."""
    num_layers, top_k = passes[0].shape[1:]
    cfg = RecorderConfig(
        num_layers=num_layers, num_physical_experts=num_experts, top_k=top_k, ep_size=ep_size, mode=mode,
        window=window, output_dir=tmp, layer_ids=layer_ids, physical_to_logical=physical_to_logical,
        max_tokens_per_pass=max(len(p) for p in passes), stream_chunk_tokens=max(4096, max(len(p) for p in passes)),
        stream_chunk_passes=16, hidden_size=hidden_size, model="test-moe",
    )
    rec = ExpertDistributionRecorder(cfg)
    rec.start_record()
    for ids in passes:
        replay_pass(rec, ids)
    rec.stop_record()
    return rec.dump_record(tmp / (name or f"{mode}.h5"))


def oracle_counts(passes: list[np.ndarray], num_experts: int) -> np.ndarray:
    """Valid assignments per layer and expert ``[L, E]``, by plain loops over ids."""
    num_layers = passes[0].shape[1]
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    for ids in passes:
        for t in range(ids.shape[0]):
            for layer in range(num_layers):
                for e in ids[t, layer]:
                    if 0 <= e < num_experts:
                        counts[layer, e] += 1
    return counts


def oracle_figures(counts: np.ndarray, ep_size: int) -> dict[str, np.ndarray | float]:
    """Balance figures written out from DESIGN.md's definitions, without moetrace.balance."""
    num_layers, num_experts = counts.shape
    per_rank = num_experts // ep_size
    load = np.array([[counts[layer, r * per_rank : (r + 1) * per_rank].sum() for r in range(ep_size)] for layer in range(num_layers)], dtype=np.float64)
    means, peaks = load.mean(axis=1), load.max(axis=1)
    entropy = []
    for layer in range(num_layers):
        p = counts[layer] / counts[layer].sum()
        entropy.append(-sum(x * np.log(x) for x in p if x > 0) / np.log(num_experts))
    return {
        "load": load,
        "balancedness": float(means.sum() / peaks.sum()),
        "layer_balancedness": means / peaks,
        "imbalance": peaks / means,
        "entropy": np.array(entropy),
        "dead": (counts == 0).sum(axis=1),
    }


def js_bits(a: np.ndarray, b: np.ndarray) -> float:
    """Jensen-Shannon divergence (bits) of two count vectors, straight from the definition."""
    p, q = a / a.sum(), b / b.sum()
    m = (p + q) / 2
    kl = lambda x: sum(xi * np.log2(xi / mi) for xi, mi in zip(x, m, strict=True) if xi > 0)  # noqa: E731
    return 0.5 * kl(p) + 0.5 * kl(q)


def write_stat_trace(path: Path, counts: np.ndarray, top_k: int, ep_size: int, layer_ids: list[int], model: str = "", run_id: str | None = None, rank: int = 0, world_size: int = 1) -> Path:
    """A ``stat`` trace holding exactly ``counts [L, E]`` (logical = physical ids), via TraceWriter."""
    num_layers, num_experts = counts.shape
    extra = {"run_id": run_id} if run_id else {}
    header = TraceHeader(
        mode="stat", id_space="logical", num_layers=num_layers, num_physical_experts=num_experts, top_k=top_k,
        ep_size=ep_size, layer_ids=np.asarray(layer_ids), physical_to_logical=np.tile(np.arange(num_experts), (num_layers, 1)),
        model=model, rank=rank, world_size=world_size, **extra,
    )
    writer = TraceWriter(path, header)
    writer.write("stat/physical_count", counts[None].astype(np.int64))
    writer.write("stat/logical_count", counts[None].astype(np.int64))
    writer.write("stat/invalid_ids", np.zeros((1, num_layers), np.int64))
    writer.write("stat/send_count", np.zeros((1, num_layers, ep_size), np.int64))
    writer.write("stat/recv_count", np.zeros((1, num_layers, ep_size), np.int64))
    writer.write("stat/dropped", np.zeros((1, num_layers), np.int64))
    writer.write("stat/num_passes", np.array([1], np.int64))
    writer.write("stat/num_tokens", np.array([-(-int(counts.sum(axis=1).max()) // top_k)], np.int64))  # every layer's assignments fit
    return writer.commit()


def olmoe_token_passes(domain: str, scale: int, tokens_per_pass: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Real OLMoE counts (3 layers x 64 experts, top-8) divided by ``scale``, cut into tokens.

    Each layer's assignments are shuffled and dealt 8 per token (a token may
    repeat an expert; every assignment is counted). Returns the exact counts
    ``[3, 64]`` and passes of ``[T, 3, 8]`` ids.
    """
    data = olmoe()
    rng = np.random.default_rng(seed)
    counts = np.rint(np.asarray(data["expert_counts"][domain], dtype=np.float64) / scale).astype(np.int64)
    tokens = min(int(c.sum()) for c in counts) // 8
    layers = []
    for layer_counts in counts:
        ids = np.repeat(np.arange(64), layer_counts)
        rng.shuffle(ids)
        layers.append(ids[: tokens * 8].reshape(tokens, 8))
    ids = np.stack(layers, axis=1)  # [T, 3, 8]
    exact = np.stack([np.bincount(ids[:, layer].reshape(-1), minlength=64) for layer in range(3)])
    passes = [ids[s : s + tokens_per_pass] for s in range(0, tokens, tokens_per_pass)]
    return exact, passes
