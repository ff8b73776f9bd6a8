"""ServingLoop under expert parallelism on 2 gloo ranks: each rank serves its share, lockstep, exact results."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.reference import EPSpec, ModelConfig, ReferenceMoEModel, Request, ServingLoop, launch

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=3, num_experts=8, top_k=2,
                     dense_layers=(0,), seed=9)
LOOP = {"max_running": 4, "max_tokens_per_pass": 16, "chunk_size": 6, "num_kv_slots": 64, "max_len": 40}


def _requests() -> list[Request]:
    rng = np.random.default_rng(2)
    return [Request(f"r{i}", rng.integers(0, 128, int(rng.integers(2, 20))).tolist(), int(rng.integers(0, 6)),
                    arrival_step=int(rng.integers(0, 6)) if i % 2 == 0 else 10 + i, return_routed_experts=True)
            for i in range(10)]


def _share(rank: int) -> list[Request]:
    # rank 0 gets 7 requests, rank 1 three late ones: it runs empty batches meanwhile
    return [r for i, r in enumerate(_requests()) if (i < 7) == (rank == 0)]


def _serve(rank: int, world: int) -> dict:
    out = {}
    for mode in ("exact", "padded"):
        model = ReferenceMoEModel(CONFIG, ep=EPSpec(world, rank, mode, max_tokens=LOOP["max_tokens_per_pass"]))
        loop = ServingLoop(model, **LOOP)
        results = loop.run(_share(rank))
        out[mode] = {"results": results, "passes": loop._next_pass_id}
    # stop() on rank 1 alone ends both ranks at the same step, everything freed
    loop = ServingLoop(ReferenceMoEModel(CONFIG, ep=EPSpec(world, rank)), **LOOP)
    loop.submit(_share(0))  # both ranks busy
    steps = 0
    for progress in loop.steps():
        steps += 1
        if rank == 1 and progress.forward_pass_id == 2:
            loop.stop()
    out["stop"] = {"steps": steps, "passes": loop._next_pass_id, "free": loop.allocator.available == LOOP["num_kv_slots"],
                   "stopped": sum(r.finish_reason == "stopped" for r in progress.new_results)}
    return out


@pytest.mark.slow
def test_ep_serving_loop_matches_dense():
    per_rank = launch(_serve, 2, backend="gloo", threads_per_rank=1)
    dense = {r.rid: r for r in ServingLoop(ReferenceMoEModel(CONFIG), **LOOP).run(_requests())}
    stop = [per_rank[rank]["stop"] for rank in (0, 1)]
    assert stop[0] == stop[1] and stop[0]["passes"] == 3 and stop[0]["free"] and stop[0]["stopped"] > 0
    for mode in ("exact", "padded"):
        assert per_rank[0][mode]["passes"] == per_rank[1][mode]["passes"]  # lockstep
        served = [r for rank in (0, 1) for r in per_rank[rank][mode]["results"]]
        assert sorted(r.rid for r in served) == sorted(dense)
        assert {r.rank for r in served if r.rid in {q.rid for q in _share(1)}} == {1}
        for r in served:
            assert r.output_ids == dense[r.rid].output_ids, (mode, r.rid)
            np.testing.assert_array_equal(r.routed_experts, dense[r.rid].routed_experts, err_msg=f"{mode} {r.rid}")
