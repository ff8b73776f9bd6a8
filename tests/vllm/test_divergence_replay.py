"""Routing divergence between two real engines, and replay closing it.

The same tiny checkpoint runs through vLLM (CPU engine, bfloat16) and through
transformers (float32) on the same tokens, both recorded by moetrace:

1. vLLM generates each prompt alone (prefill, then one pass per decode step),
   ``per_token`` trace; per-request routes are read back from it. Two more
   requests: a long prompt prefilled in chunks, and one whose first 128 tokens
   come from the prefix cache (no forward, so ``-1`` routes there). The trace's
   own request rows (``moetrace routes``) give the same routes, and its passes
   the phases vLLM ran. Then the eight prompts at once (continuous batching:
   chunked prefills beside decodes), a second trace whose every row is checked
   against the token vLLM fed at that row and the request it answered.
2. transformers runs the first eight requests' tokens in the same passes
   (prefill, then each of vLLM's tokens fed back with the KV cache),
   ``per_token`` trace: ``moetrace diff`` aligns the two traces by pass and
   position.
3. transformers runs the teacher-forced forward an RL trainer runs (the whole
   sequence in one pass), captured per request: ``moetrace diff`` aligns the
   routes files by request and position.
4. The same forward with ``hf.replay`` of vLLM's routes: 100% agreement, and
   the gap between the two engines' log-probabilities of the sampled tokens
   shrinks.

The figures are printed (``pytest -s``) and recorded in docs/divergence.md.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moetrace.adapters import hf
from moetrace.adapters import vllm as mt_vllm
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis.divergence import diff_sources
from moetrace.capturer import RoutedExpertsCapturer
from moetrace.routes import load_routes, pad_routes, save_routes, select_route_layers
from moetrace.trace.reader import open_trace
from tests.divergence.oracle import assert_matches_oracle, oracle

from .checkpoints import MODELS, build_checkpoint, prompt
from .engine import start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NEW_TOKENS = 8
PROMPTS = [prompt(*np.random.default_rng(seed).integers(0, 125, size=int(n)).tolist()) for seed, n in enumerate([6, 9, 12, 15, 18, 21, 24, 30])]
"""Eight prompts of 6 to 30 tokens (about 200 routed positions with the generated tokens)."""

CHUNK = 64
"""``max_num_batched_tokens``: a longer prompt is prefilled in chunks of this many tokens, one pass each."""
_LONG = np.random.default_rng(100).integers(0, 125, size=150).tolist()
EXTRA = [prompt(*_LONG), prompt(*_LONG[:128], *np.random.default_rng(101).integers(0, 125, size=20).tolist())]
"""A 150-token prompt (chunked prefill: 64 + 64 + 22), then one sharing its first 128 tokens (one CPU KV block:
vLLM serves them from its prefix cache and computes, hence routes, only the rest)."""


@dataclass
class Request:
    tokens: list[int]  # prompt + every generated token
    prompt_len: int
    vllm_logprobs: np.ndarray  # [len(tokens) - 1]: log p(tokens[j + 1] | tokens[: j + 1]) in vLLM (NaN: not asked)
    passes: int  # forward passes vLLM ran for it
    cached: int  # prompt tokens vLLM served from its prefix cache (no forward, no routes)


@dataclass
class Runs:
    name: str
    layer_ids: list[int]
    requests: list[Request]
    vllm_trace: Path
    hf_trace: Path
    files: dict[str, Path]  # routes files: vllm, hf (teacher-forced), replay
    hf_logprobs: dict[str, list[np.ndarray]]  # "own" / "replay": per request [len(tokens) - 1]
    model: torch.nn.Module  # the transformers model (float32)
    vllm_routes: list[np.ndarray]  # per request [len(tokens) - 1, L, k]
    vllm_ids: list[str]  # per request: vLLM's RequestOutput.request_id
    batched: Batched  # the eight prompts at once


@dataclass
class Batched:
    """The eight prompts generated at once, recorded in their own per_token trace."""

    trace: Path
    ids: list[str]  # RequestOutput.request_id of each
    tokens: list[list[int]]  # prompt + generated tokens of each
    cached: list[int]  # prompt tokens served from the prefix cache
    fed: np.ndarray  # [rows] the token id vLLM fed at each row of the recorded passes, in pass order


def _vllm_run(checkpoint: Path, out: Path) -> tuple[list[Request], list[str], Path, Batched]:
    from vllm import SamplingParams

    llm = start_llm(checkpoint, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, max_num_batched_tokens=CHUNK, enable_prefix_caching=True)
    try:
        model = llm.apply_model(lambda m: m)[0]
        fed: list[torch.Tensor] = []  # input ids of every forward: the token fed at each row
        counter = model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"].clone()), with_kwargs=True)
        handle = mt_vllm.instrument(llm, mode="per_token", output_dir=out)
        requests, ids = [], []
        handle.recorder.start_record()
        for i, text in enumerate(PROMPTS + EXTRA):  # one request at a time: its passes are its prefill chunks + decode steps
            extra = i >= len(PROMPTS)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1,
                                    prompt_logprobs=None if extra else 1)
            before = len(fed)
            result = llm.generate([text], params, use_tqdm=False)[0]
            ids.append(result.request_id)
            prompt_ids, generated = list(result.prompt_token_ids), list(result.outputs[0].token_ids)
            logprobs = [math.nan] * (len(prompt_ids) - 1) if extra else [
                entry[tok].logprob for entry, tok in zip(result.prompt_logprobs[1:], prompt_ids[1:], strict=True)]
            logprobs += [entry[tok].logprob for entry, tok in zip(result.outputs[0].logprobs, generated, strict=True)]
            requests.append(Request(prompt_ids + generated, len(prompt_ids), np.asarray(logprobs), len(fed) - before,
                                    int(result.num_cached_tokens or 0)))
        handle.recorder.stop_record()
        path = handle.recorder.dump_record(out / "vllm.h5")
        first = len(fed)
        handle.recorder.start_record()
        results = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
        handle.recorder.stop_record()
        batched = Batched(handle.recorder.dump_record(out / "vllm_batched.h5"), [r.request_id for r in results],
                          [list(r.prompt_token_ids) + list(r.outputs[0].token_ids) for r in results],
                          [int(r.num_cached_tokens or 0) for r in results], torch.cat(fed[first:]).numpy())
        handle.uninstrument()
        counter.remove()
    finally:
        stop_llm(llm)
    return requests, ids, path, batched


def _vllm_routes(trace_path: Path, requests: list[Request]) -> list[np.ndarray]:
    """Per request ``[P + N - 1, L, k]``: ``-1`` for prefix-cached positions, then its passes' tokens in pass order."""
    with open_trace(trace_path) as trace:
        chunks = list(trace.iter_tokens())
    ids = np.concatenate([c.topk_ids for c in chunks]).astype(np.int64)
    pass_id = np.concatenate([c.pass_id for c in chunks])
    passes = np.unique(pass_id)
    assert len(passes) == sum(r.passes for r in requests)
    out, first = [], 0
    for req in requests:
        mine = passes[first : first + req.passes]
        first += req.passes
        rows = np.concatenate([ids[pass_id == p] for p in mine])
        cached = np.full((req.cached, *rows.shape[1:]), -1, dtype=np.int64)
        out.append(np.concatenate([cached, rows]))
        assert len(out[-1]) == len(req.tokens) - 1
    return out


def _hf_passes(model: torch.nn.Module, requests: list[Request], out: Path) -> Path:
    """The vLLM pass structure in transformers: prefill, then each fed-back token with the KV cache."""
    handle = hf.instrument(model, mode="per_token", output_dir=out)
    handle.recorder.start_record()
    with torch.no_grad():
        for req in requests[: len(PROMPTS)]:
            ids = torch.tensor([req.tokens])
            step = model(ids[:, : req.prompt_len], use_cache=True)
            for j in range(req.prompt_len, len(req.tokens) - 1):
                step = model(ids[:, j : j + 1], past_key_values=step.past_key_values, use_cache=True)
    handle.recorder.stop_record()
    path = handle.recorder.dump_record(out / "hf_passes.h5")
    handle.uninstrument()
    return path


def _teacher_forced(model: torch.nn.Module, tokens: list[int], layer_ids: list[int], top_k: int, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """Routes ``[S - 1, L, k]`` (MoE layers) and log p of each next token, of one forward over ``tokens[:-1]``."""
    length = len(tokens) - 1
    capturer = RoutedExpertsCapturer(max(layer_ids) + 1, top_k, max_tokens_per_pass=length, num_kv_slots=length)
    handle = hf.instrument(model, capturer=capturer, capture_seq_len=length, output_dir=out)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens[:-1]])).logits[0]
        routes = handle.routed_experts(0, length, batch_size=1)
    finally:
        handle.uninstrument()
    logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return select_route_layers(routes.astype(np.int64), layer_ids), logprobs.numpy()


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    from transformers import AutoModelForCausalLM

    name = request.param
    out = tmp_path_factory.mktemp(f"divergence-{name}")
    checkpoint = build_checkpoint(name, out / "checkpoint")
    layer_ids = list(MODELS[name]["layer_ids"])
    requests, vllm_ids, vllm_trace, batched = _vllm_run(checkpoint, out)
    gc.collect()
    vllm_routes = _vllm_routes(vllm_trace, requests)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf_trace = _hf_passes(model, requests, out)
    own, replayed, own_lp, replay_lp = {}, {}, [], []
    for i, (req, routes) in enumerate(zip(requests, vllm_routes, strict=True)):
        own[str(i)], lp = _teacher_forced(model, req.tokens, layer_ids, int(MODELS[name]["top_k"]), out)
        own_lp.append(lp)
        with hf.replay(model, routes):
            replayed[str(i)], lp = _teacher_forced(model, req.tokens, layer_ids, int(MODELS[name]["top_k"]), out)
        replay_lp.append(lp)
    meta = {"model": name, "layer_ids": layer_ids, "num_experts": MODELS[name]["num_experts"]}
    files = {
        "vllm": save_routes(out / "vllm.json", {str(i): r for i, r in enumerate(vllm_routes)}, **meta),
        "hf": save_routes(out / "hf.json", own, **meta),
        "replay": save_routes(out / "hf_replay.json", replayed, **meta),
    }
    return Runs(name, layer_ids, requests, vllm_trace, hf_trace, files, {"own": own_lp, "replay": replay_lp}, model, vllm_routes,
                vllm_ids, batched)


def _gap(runs: Runs, which: str) -> tuple[float, float]:
    gaps = np.concatenate([np.abs(hf_lp - req.vllm_logprobs) for hf_lp, req in zip(runs.hf_logprobs[which], runs.requests, strict=True)])
    return float(np.nanmean(gaps)), float(np.nanmax(gaps))


def test_engines_diverge_and_diff_reports_it(runs: Runs) -> None:
    cli = CliRunner().invoke(app, ["diff", str(runs.vllm_trace), str(runs.hf_trace), "--json"])
    assert cli.exit_code == 0, cli.output
    passes = json.loads(cli.output)
    base, extra = runs.requests[: len(PROMPTS)], runs.requests[len(PROMPTS) :]
    # transformers replayed the pass structure of the first eight requests only.
    assert passes["alignment"] == {"by": "pass and position", "matched_tokens": sum(len(r.tokens) - 1 for r in base),
                                   "only_in_a": sum(len(r.tokens) - 1 - r.cached for r in extra), "only_in_b": 0}
    forward = diff_sources(runs.files["vllm"], runs.files["hf"])
    assert forward.alignment["matched_tokens"] == sum(len(r.tokens) - 1 for r in runs.requests)
    assert forward.tokens == forward.alignment["matched_tokens"] - sum(r.cached for r in runs.requests)
    # Figures equal the independent computation on these real routes.
    a, b = (np.concatenate([v[1] for _, v in sorted(load_routes(runs.files[k]).requests.items())]) for k in ("vllm", "hf"))
    assert_matches_oracle(forward, oracle(a, b, MODELS[runs.name]["num_experts"]))
    print(f"\n[{runs.name}] vLLM bf16 vs transformers fp32, same passes: router agreement {passes['router_agreement']:.4f}, "
          f"tokens with >= 1 differing layer {passes['tokens_any_differ']:.4f}, per layer set agreement "
          f"{[round(x['set_agreement'], 4) for x in passes['layers']]}, histogram {passes['differing_layers_histogram']}")
    print(f"[{runs.name}] vLLM bf16 vs transformers fp32 teacher-forced: router agreement {forward.router_agreement:.4f}, "
          f"tokens with >= 1 differing layer {forward.tokens_any_differ:.4f}, set agreement {np.round(forward.set_agreement, 4).tolist()}, "
          f"order agreement {np.round(forward.order_agreement, 4).tolist()}, Jaccard {np.round(forward.jaccard, 4).tolist()}")
    # Expect some divergence between the dtypes (the checkpoint's router logits are small: near-ties flip).
    assert forward.router_agreement < 1.0 and passes["router_agreement"] < 1.0


def test_replay_of_vllm_routes_agrees_fully_and_shrinks_the_logprob_gap(runs: Runs) -> None:
    cli = CliRunner().invoke(app, ["diff", str(runs.files["vllm"]), str(runs.files["replay"]), "--json"])
    assert cli.exit_code == 0, cli.output
    figures = json.loads(cli.output)
    assert figures["router_agreement"] == 1.0 and figures["tokens_any_differ"] == 0.0
    assert all(layer["order_agreement"] == 1.0 for layer in figures["layers"])
    before, after = _gap(runs, "own"), _gap(runs, "replay")
    print(f"[{runs.name}] |log p_hf - log p_vllm| of the sampled tokens: mean {before[0]:.5f} -> {after[0]:.5f}, "
          f"max {before[1]:.5f} -> {after[1]:.5f} with replay")
    assert after[0] < before[0] and after[1] <= before[1]


def test_chunked_prefill_and_prefix_cached_tokens(runs: Runs) -> None:
    """The long prompt took ceil(150 / CHUNK) prefill passes; the second one had 128 prefix-cached tokens without routes."""
    long, shared = runs.requests[len(PROMPTS) :]
    assert long.cached == 0 and long.passes == math.ceil(long.prompt_len / CHUNK) + NEW_TOKENS - 1
    assert shared.cached == 128 and shared.passes == 1 + NEW_TOKENS - 1
    vllm_routes = load_routes(runs.files["vllm"]).requests
    replayed = load_routes(runs.files["replay"]).requests
    hf_routes = load_routes(runs.files["hf"]).requests
    last = str(len(runs.requests) - 1)
    assert (vllm_routes[last][1][:128] == -1).all() and (vllm_routes[last][1][128:] >= 0).all()
    # Cached positions keep transformers' own routing under replay; the rest follow vLLM.
    np.testing.assert_array_equal(replayed[last][1][:128], hf_routes[last][1][:128])
    np.testing.assert_array_equal(replayed[last][1][128:], vllm_routes[last][1][128:])
    data: dict[str, Any] = json.loads(runs.files["vllm"].read_text())
    assert data["layer_ids"] == runs.layer_ids and len(data["requests"]) == len(PROMPTS) + len(EXTRA)


def test_one_padded_training_batch_replays_every_request(runs: Runs, tmp_path: Path) -> None:
    """All ten rollouts in one right-padded batch (as a trainer sends them): each row follows its vLLM routes."""
    length = max(len(r.tokens) - 1 for r in runs.requests)
    ids = torch.zeros(len(runs.requests), length, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, req in enumerate(runs.requests):
        ids[row, : len(req.tokens) - 1], mask[row, : len(req.tokens) - 1] = torch.tensor(req.tokens[:-1]), 1
    top_k = int(MODELS[runs.name]["top_k"])
    capturer = RoutedExpertsCapturer(max(runs.layer_ids) + 1, top_k, max_tokens_per_pass=ids.numel(), num_kv_slots=ids.numel())
    with hf.replay(runs.model, pad_routes(runs.vllm_routes)):
        handle = hf.instrument(runs.model, capturer=capturer, capture_seq_len=length, output_dir=tmp_path)
        try:
            with torch.no_grad():
                runs.model(ids, attention_mask=mask)
            got = [select_route_layers(handle.routed_experts(row, length, batch_size=len(runs.requests)).astype(np.int64), runs.layer_ids)
                   for row in range(len(runs.requests))]
        finally:
            handle.uninstrument()
    for row, routes in enumerate(runs.vllm_routes):
        routed = (routes >= 0).all(-1).all(-1)
        np.testing.assert_array_equal(got[row][: len(routes)][routed], routes[routed])


def _trace_key(keys: list[str], request_id: str) -> str:
    """The trace's id of a request: vLLM's engine-core id, ``RequestOutput.request_id`` + ``-`` + 8 random characters."""
    found = [k for k in keys if k.rsplit("-", 1)[0] == request_id and len(k.rsplit("-", 1)[1]) == 8]
    assert len(found) == 1, (request_id, keys)
    return found[0]


def _cli_routes(trace: Path, out: Path, *extra: str) -> Any:
    cli = CliRunner().invoke(app, ["routes", str(trace), "-o", str(out), *extra])
    assert cli.exit_code == 0, cli.output
    return load_routes(out)


def test_trace_request_rows_are_each_requests_routes_and_the_audit_passes(runs: Runs, tmp_path: Path) -> None:
    """``moetrace routes`` of the trace alone equals the routes rebuilt from vLLM's passes and cached-token counts."""
    found = _cli_routes(runs.vllm_trace, tmp_path / "routes.json")
    keys = sorted(found.requests)
    assert len(keys) == len(runs.requests)
    for rid, req, routes in zip(runs.vllm_ids, runs.requests, runs.vllm_routes, strict=True):
        start, rows = found.requests[_trace_key(keys, rid)]
        assert start == 0 and rows.shape == (len(req.tokens) - 1, len(runs.layer_ids), routes.shape[2])
        np.testing.assert_array_equal(rows, routes)  # prefix-cached positions -1, the rest as each pass routed them
    one = _cli_routes(runs.vllm_trace, tmp_path / "one.json", "--request", keys[-1])
    assert list(one.requests) == [keys[-1]]
    audit = CliRunner().invoke(app, ["audit", str(runs.vllm_trace), "--returned", str(tmp_path / "routes.json")])
    assert audit.exit_code == 0, audit.output
    # Negative control: one request's computed rows shifted by a position are flagged, in that request only.
    victim = _trace_key(keys, runs.vllm_ids[3])
    start, rows = found.requests[victim]
    shifted = dict(found.requests)
    shifted[victim] = (start, np.concatenate([rows[1:], rows[-1:]]))
    bad = save_routes(tmp_path / "shifted.json", {k: v[1] for k, v in shifted.items()}, model=found.model, id_space=found.id_space,
                      num_experts=found.num_experts, layer_ids=found.layer_ids, physical_to_logical=found.physical_to_logical)
    audit = CliRunner().invoke(app, ["audit", str(runs.vllm_trace), "--returned", str(bad), "--json"])
    assert audit.exit_code == 1, audit.output
    report = json.loads(audit.output)
    assert [r["request"] for r in report["per_request"] if not r["ok"]] == [victim]


def test_trace_passes_carry_the_phase_vllm_ran(runs: Runs) -> None:
    """Requests one at a time: each request's prefill chunks are ``prefill`` passes, its decode steps ``decode`` passes."""
    from moetrace.pass_phase import PASS_PHASES

    with open_trace(runs.vllm_trace) as trace:
        chunks = list(trace.iter_tokens())
    pass_id = np.concatenate([c.pass_id for c in chunks])
    phase = np.concatenate([c.pass_phase for c in chunks])
    _, first = np.unique(pass_id, return_index=True)
    expected = []
    for req in runs.requests:
        prefills = math.ceil((req.prompt_len - req.cached) / CHUNK)
        expected += ["prefill"] * prefills + ["decode"] * (req.passes - prefills)
    assert [PASS_PHASES[p] for p in phase[np.sort(first)]] == expected


def test_batched_rows_are_the_tokens_vllm_fed_for_their_request(runs: Runs) -> None:
    """Continuous batching, chunked prefill beside decodes: every row's (request, position) names the token vLLM fed there."""
    from moetrace.pass_phase import PASS_PHASES

    batched = runs.batched
    with open_trace(batched.trace) as trace:
        chunks = list(trace.iter_tokens())
        table = [str(t) for t in trace.request_table()]
    request = np.concatenate([c.request for c in chunks]).astype(np.int64)
    position = np.concatenate([c.request_position for c in chunks]).astype(np.int64)
    phases = {PASS_PHASES[p] for p in np.concatenate([c.pass_phase for c in chunks])}
    assert len(request) == len(batched.fed) and (request >= 0).all()
    assert "mixed" in phases and "decode" in phases
    index = {key: i for i, key in enumerate(table)}
    for rid, tokens, cached in zip(batched.ids, batched.tokens, batched.cached, strict=True):
        mine = request == index[_trace_key(table, rid)]
        # Every position vLLM computed, once each, and each row is the token vLLM fed at that row.
        assert sorted(position[mine].tolist()) == list(range(cached, len(tokens) - 1))
        np.testing.assert_array_equal(batched.fed[mine], np.asarray(tokens)[position[mine]])
