"""ServingLoop + capturer: exact per-request routed experts under continuous batching, joins, stop, bounds."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder
from moetrace.reference import (
    ModelConfig,
    ReferenceMoEModel,
    Request,
    ServingLoop,
    routed_positions,
    zipf_bias,
)
from moetrace.routes import load_routes
from moetrace.trace.reader import open_trace
from moetrace.trace.token_routes import request_routes

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=4, num_experts=8, top_k=2,
                     dense_layers=(1,), router_bias=tuple(zipf_bias(8, 0.8, seed=1).tolist()), seed=5)
LOOP = {"max_running": 5, "max_tokens_per_pass": 20, "chunk_size": 8, "num_kv_slots": 120, "max_len": 48}


@pytest.fixture(scope="module")
def model() -> ReferenceMoEModel:
    return ReferenceMoEModel(CONFIG)


def _mix(count: int = 18, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        prompt_len = int(rng.integers(1, 30))
        new = 0 if i % 6 == 0 else int(rng.integers(1, 9))  # every 6th is prefill-only
        requests.append(Request(f"r{i}", rng.integers(0, CONFIG.vocab_size, prompt_len).tolist(), new,
                                arrival_step=int(rng.integers(0, 15)), return_routed_experts=True,
                                routed_experts_start_len=int(rng.integers(0, prompt_len)) if i % 4 == 3 else 0))
    return requests


def _alone(model: ReferenceMoEModel, req: Request):
    solo = Request(req.rid, req.prompt, req.max_new_tokens, 0, True, req.routed_experts_start_len)
    return ServingLoop(model, **LOOP).run([solo])[0]


def test_mixed_batch_matches_each_request_alone(model):
    requests = _mix()
    loop = ServingLoop(model, **LOOP)
    results = {r.rid: r for r in loop.run(requests)}
    assert set(results) == {r.rid for r in requests}
    # the mix exercises what it must: prefill-only, chunked prompts, slot reuse, real batching
    assert sum(r.max_new_tokens == 0 for r in requests) >= 3
    assert sum(len(r.prompt) > LOOP["chunk_size"] for r in requests) >= 5
    assert sum(routed_positions(len(r.prompt), r.max_new_tokens) for r in requests) > LOOP["num_kv_slots"]
    shared = [set(a.forward_pass_ids) & set(b.forward_pass_ids) for a in results.values() for b in results.values() if a.rid < b.rid]
    assert sum(bool(s) for s in shared) >= 10
    for req in requests:
        got, alone = results[req.rid], _alone(model, req)
        expected_rows = routed_positions(len(req.prompt), req.max_new_tokens) - req.routed_experts_start_len
        assert got.routed_experts.shape == (expected_rows, CONFIG.num_layers, CONFIG.top_k), req.rid
        assert got.output_ids == alone.output_ids, req.rid
        np.testing.assert_array_equal(got.routed_experts, alone.routed_experts, err_msg=req.rid)
        assert (got.routed_experts[:, 1] == -1).all() and (got.routed_experts[:, [0, 2, 3]] >= 0).all()
        assert len(got.output_ids) == req.max_new_tokens and got.finish_reason == "length"
    # everything was given back
    assert loop.allocator.available == LOOP["num_kv_slots"] and loop.pool.available == LOOP["max_running"]


def test_token_convention(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    loop = ServingLoop(model, **LOOP)
    out = {r.rid: r for r in loop.run([
        Request("prefill-only", prompt, 0, return_routed_experts=True),
        Request("one", prompt, 1, return_routed_experts=True),
        Request("four", prompt, 4, return_routed_experts=True),
        Request("turn-2", prompt, 4, return_routed_experts=True, routed_experts_start_len=len(prompt)),
        Request("not-asked", prompt, 4),
    ])}
    assert out["not-asked"].routed_experts is None and out["not-asked"].output_ids == out["four"].output_ids
    assert out["prefill-only"].routed_experts.shape[0] == len(prompt) and out["prefill-only"].output_ids == []
    assert out["one"].routed_experts.shape[0] == len(prompt) and len(out["one"].output_ids) == 1
    assert out["four"].routed_experts.shape[0] == len(prompt) + 3
    np.testing.assert_array_equal(out["four"].routed_experts[: len(prompt)], out["prefill-only"].routed_experts)
    np.testing.assert_array_equal(out["turn-2"].routed_experts, out["four"].routed_experts[len(prompt):])
    assert out["turn-2"].routed_experts_start == len(prompt)


def test_pass_ids_join_the_recorder(model, tmp_path):
    recorder = ExpertDistributionRecorder(model.recorder_config(mode="per_pass", output_dir=tmp_path))
    recorder.start_record()
    loop = ServingLoop(model, recorder=recorder, **LOOP)
    requests = _mix(8, seed=3)
    requests = [Request(r.rid, r.prompt, r.max_new_tokens, r.arrival_step, True) for r in requests]
    tokens_per_pass: dict[int, int] = {}

    def on_progress(progress):
        if progress.forward_pass_id is not None:
            tokens_per_pass[progress.forward_pass_id] = progress.batch_tokens

    results = loop.run(requests, on_progress=on_progress)
    recorder.stop_record()
    with open_trace(recorder.dump_record()) as trace:
        chunk = next(trace.iter_passes())
        counts = trace.physical_count()
    assert dict(zip(chunk.pass_id.tolist(), chunk.num_tokens.tolist(), strict=True)) == tokens_per_pass
    assert set().union(*(r.forward_pass_ids for r in results)) == set(tokens_per_pass)
    # every routed token of every request is in the recorder's counts, layer by layer
    moe = list(model.moe_layer_ids)
    from_requests = np.zeros_like(counts)
    for r in results:
        for i, layer in enumerate(moe):
            from_requests[i] += np.bincount(r.routed_experts[:, layer].reshape(-1), minlength=CONFIG.num_experts)
    np.testing.assert_array_equal(counts, from_requests)


def test_progress_and_clean_early_stop(model):
    loop = ServingLoop(model, **LOOP)
    loop.submit(_mix(10, seed=4))
    seen = []
    for progress in loop.steps():
        seen.append(progress)
        if progress.finished >= 3:
            loop.stop()
    last = seen[-1]
    assert last.total == 10 and last.forward_pass_id is None
    assert [p.finished for p in seen] == sorted(p.finished for p in seen)
    stopped = [r for p in seen for r in p.new_results if r.finish_reason == "stopped"]
    assert stopped and all(r.routed_experts.shape[0] <= routed_positions(r.prompt_len, 8) for r in stopped)
    assert loop.allocator.available == LOOP["num_kv_slots"] and loop.pool.available == LOOP["max_running"]


def test_state_does_not_grow_with_requests_served(model):
    loop = ServingLoop(model, **LOOP)
    size = loop.capturer.nbytes()
    for round_ in range(3):
        reqs = [Request(f"{round_}-{r.rid}", r.prompt, r.max_new_tokens, 0, True) for r in _mix(8, seed=round_)]
        loop.run(reqs)
        assert loop.capturer.nbytes() == size and loop.capturer.pending <= 2
        assert loop.allocator.available == LOOP["num_kv_slots"] and loop.pool.available == LOOP["max_running"]
        assert not loop._running and not loop._waiting


def test_submit_errors(model):
    loop = ServingLoop(model, **LOOP)
    with pytest.raises(ValueError, match="empty prompt"):
        loop.submit([Request("a", [], 1)])
    with pytest.raises(ValueError, match="needs 60 positions"):
        loop.submit([Request("b", [1] * 50, 11)])
    with pytest.raises(ValueError, match=r"routed_experts_start_len=9 is outside \[0, 5\]"):
        loop.submit([Request("c", [1] * 3, 3, return_routed_experts=True, routed_experts_start_len=9)])
    with pytest.raises(ValueError, match="token ids outside"):
        loop.submit([Request("d", [1000], 1)])
    with pytest.raises(ValueError, match="capture=False"):
        ServingLoop(model, capture=False, **LOOP).submit([Request("e", [1], 1, return_routed_experts=True)])
    loop.submit([Request("f", [1], 1)])
    with pytest.raises(ValueError, match="already submitted"):
        loop.submit([Request("f", [1], 1)])


class _Taps:
    """A recorder stand-in for the independent forward: keeps each MoE layer's top-k ids of one pass."""

    def __init__(self) -> None:
        self.ids: dict[int, np.ndarray] = {}
        self._layer = 0

    def with_forward_pass(self, forward_pass_id=None, batch=None):
        return contextlib.nullcontext()

    def with_current_layer(self, layer):
        self._layer = layer
        return contextlib.nullcontext()

    def with_phase(self, name):
        return contextlib.nullcontext()

    def on_select_experts(self, ids):
        self.ids[self._layer] = ids.numpy().copy()

    def on_dispatch(self, *args):
        return None


def test_per_token_rows_are_each_requests_routes(model, tmp_path):
    """Issue 35: the per_token trace alone gives every request's routes, equal to what the loop returned
    (the capturer) and to an independent forward of the request's whole sequence, at every position."""
    recorder = ExpertDistributionRecorder(model.recorder_config(mode="per_token", output_dir=tmp_path, segment_bytes=4096))
    recorder.start_record()
    requests = _mix(18, seed=7)
    results = {r.rid: r for r in ServingLoop(model, recorder=recorder, **LOOP).run(requests)}
    recorder.stop_record()
    trace = recorder.dump_record()
    routes = request_routes(trace)
    moe = list(model.moe_layer_ids)
    assert sorted(routes) == sorted(results) and len(routes) >= 16
    assert sum(len(r.forward_pass_ids) > 2 for r in results.values()) >= 10  # interleaved over many passes
    for req in requests:
        got, res = routes[req.rid], results[req.rid]
        assert got.shape == (routed_positions(len(req.prompt), req.max_new_tokens), len(moe), CONFIG.top_k), req.rid
        np.testing.assert_array_equal(got[res.routed_experts_start :], res.routed_experts[:, moe], err_msg=req.rid)
        taps = _Taps()
        sequence = (list(req.prompt) + res.output_ids)[: got.shape[0]]
        model.forward(torch.tensor([sequence]), recorder=taps)
        independent = np.stack([taps.ids[i] for i in range(len(moe))], axis=1)
        np.testing.assert_array_equal(got, independent, err_msg=req.rid)

    # `moetrace routes` writes the same as a routes file; --request one; analyze --by reads the trace directly
    runner = CliRunner()
    out = runner.invoke(app, ["routes", str(trace), "-o", str(tmp_path / "routes.json")])
    assert out.exit_code == 0, out.output
    saved = load_routes(tmp_path / "routes.json")
    assert sorted(saved.requests) == sorted(routes) and saved.layer_ids == moe
    for rid, (start, arr) in saved.requests.items():
        assert start == 0
        np.testing.assert_array_equal(arr, routes[rid])
    one = runner.invoke(app, ["routes", str(trace), "-o", str(tmp_path / "one.json"), "--request", requests[3].rid])
    assert one.exit_code == 0 and list(load_routes(tmp_path / "one.json").requests) == [requests[3].rid]
    missing = runner.invoke(app, ["routes", str(trace), "-o", str(tmp_path / "none.json"), "--request", "nope"])
    assert missing.exit_code == 2 and "no token rows" in missing.output and not (tmp_path / "none.json").exists()
    by_trace = runner.invoke(app, ["analyze", str(trace), "--by", "request", "--json"])
    by_file = runner.invoke(app, ["analyze", str(tmp_path / "routes.json"), "--by", "request", "--json"])
    assert by_trace.exit_code == 0 and json.loads(by_trace.output) == json.loads(by_file.output)
