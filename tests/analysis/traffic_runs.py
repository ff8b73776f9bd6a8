"""Per-rank traces of a small expert-parallel run for the traffic tests, and the hand count they are held to.

Four EP ranks, two to a node (two nodes), 8 experts on 8 slots (rank ``r`` holds slots
``2r, 2r+1``), top-2, two MoE layers (model layers 1 and 3). Each rank routes its own
tokens (DP attention, as SGLang with DeepEP): its recorder writes its own file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.layout import RankLayout

from .helpers import replay_pass

RANKS, GPUS_PER_NODE, SLOTS, TOP_K, LAYER_IDS = 4, 2, 8, 2, (1, 3)
NODES = RANKS // GPUS_PER_NODE


def spread_routes(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """``[T, L, 2]`` ids whose two experts sit on different nodes (slots of ranks 0-1 and 2-3)."""
    near = rng.integers(0, 4, size=(tokens, len(LAYER_IDS)))
    far = rng.integers(4, 8, size=(tokens, len(LAYER_IDS)))
    return np.stack([near, far], axis=2)


def local_routes(rng: np.random.Generator, tokens: int, rank: int) -> np.ndarray:
    """``[T, L, 2]`` distinct ids on the source rank's own node."""
    base = 4 * (rank // GPUS_PER_NODE)
    pairs = np.array([(a, b) for a in range(4) for b in range(4) if a != b])
    return base + pairs[rng.integers(0, len(pairs), size=(tokens, len(LAYER_IDS)))]


def write_rank_traces(out: Path, mode: str, passes: dict[int, list[np.ndarray]], phy2log: np.ndarray | None = None,
                      phases: list[str] | None = None, tp_attention: bool = False) -> list[Path]:
    """One trace per rank of one run (``run_id`` from ``out`` and ``mode``): rank ``r`` replays ``passes[r]`` (``[T, L, k]``
    physical ids each) through its own recorder; ``phases``: the pass phase of each pass index (default: unknown);
    ``tp_attention``: the ranks form one TP group whose routers see the same tokens (default: each its own, DP attention)."""
    paths = []
    for rank, own in passes.items():
        cfg = RecorderConfig(num_layers=len(LAYER_IDS), num_physical_experts=SLOTS, top_k=TOP_K, ep_size=RANKS, ep_rank=rank, mode=mode,
                             layer_ids=LAYER_IDS, physical_to_logical=phy2log, output_dir=out, run_id=f"{out.name}-{mode}", hidden_size=16, dtype_bytes=2,
                             max_tokens_per_pass=max(len(p) for p in own), stream_chunk_passes=4,
                             layout=(RankLayout.tensor_parallel if tp_attention else RankLayout.independent)(
                                 rank, RANKS, ep_size=RANKS, ep_rank=rank, source="reference"))
        rec = ExpertDistributionRecorder(cfg)
        rec.start_record()
        for index, ids in enumerate(own):
            if phases is not None:
                rec.set_pass_phase(phases[index])
            replay_pass(rec, ids)
        rec.stop_record()
        paths.append(rec.dump_record(out / f"{mode}-rank{rank}.h5"))
    return paths


def hand_count(passes: dict[int, list[np.ndarray]], slot_rank: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """By plain loops: ``rank_tokens [L, R, R]`` and ``nodes_per_token [L, N + 1]`` (distinct nodes of each token's ids)."""
    rank_tokens = np.zeros((len(LAYER_IDS), RANKS, RANKS), dtype=np.int64)
    nodes = np.zeros((len(LAYER_IDS), NODES + 1), dtype=np.int64)
    for source, own in passes.items():
        for ids in own:
            for token in ids:
                for layer, chosen in enumerate(token):
                    reached = set()
                    for slot in chosen:
                        if slot >= 0:
                            rank_tokens[layer, source, slot_rank[slot]] += 1
                            reached.add(slot_rank[slot] // GPUS_PER_NODE)
                    nodes[layer, len(reached)] += 1
    return rank_tokens, nodes
