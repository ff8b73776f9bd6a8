"""Routing divergence between two real engines, and replay closing it.

The same tiny checkpoint runs through vLLM (CPU engine, bfloat16) and through
transformers (float32) on the same tokens, both recorded by moetrace:

1. vLLM generates each prompt alone (prefill, then one pass per decode step),
   ``per_token`` trace; per-request routes are read back from it.
2. transformers runs the same tokens in the same passes (prefill, then each of
   vLLM's tokens fed back with the KV cache), ``per_token`` trace:
   ``moetrace diff`` aligns the two traces by pass and position.
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
from moetrace.routes import save_routes, select_layers
from moetrace.trace.reader import open_trace

from .checkpoints import MODELS, build_checkpoint, prompt
from .engine import start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NEW_TOKENS = 8
PROMPTS = [prompt(*np.random.default_rng(seed).integers(0, 125, size=int(n)).tolist()) for seed, n in enumerate([6, 9, 12, 15, 18, 21, 24, 30])]
"""Eight prompts of 6 to 30 tokens (about 200 routed positions with the generated tokens)."""


@dataclass
class Request:
    tokens: list[int]  # prompt + every generated token
    prompt_len: int
    vllm_logprobs: np.ndarray  # [len(tokens) - 1]: log p(tokens[j + 1] | tokens[: j + 1]) in vLLM


@dataclass
class Runs:
    name: str
    layer_ids: list[int]
    requests: list[Request]
    vllm_trace: Path
    hf_trace: Path
    files: dict[str, Path]  # routes files: vllm, hf (teacher-forced), replay
    hf_logprobs: dict[str, list[np.ndarray]]  # "own" / "replay": per request [len(tokens) - 1]


def _vllm_run(checkpoint: Path, out: Path) -> tuple[list[Request], Path]:
    from vllm import SamplingParams

    llm = start_llm(checkpoint, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        handle = mt_vllm.instrument(llm, mode="per_token", output_dir=out)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        requests = []
        handle.recorder.start_record()
        for prompt in PROMPTS:  # one request at a time: its passes are prefill + one per decode step
            result = llm.generate([prompt], params, use_tqdm=False)[0]
            prompt_ids, generated = list(result.prompt_token_ids), list(result.outputs[0].token_ids)
            tokens = prompt_ids + generated
            logprobs = [entry[tok].logprob for entry, tok in zip(result.prompt_logprobs[1:], prompt_ids[1:], strict=True)]
            logprobs += [entry[tok].logprob for entry, tok in zip(result.outputs[0].logprobs, generated, strict=True)]
            requests.append(Request(tokens, len(prompt_ids), np.asarray(logprobs)))
        handle.recorder.stop_record()
        path = handle.recorder.dump_record(out / "vllm.h5")
        handle.uninstrument()
    finally:
        stop_llm(llm)
    return requests, path


def _vllm_routes(trace_path: Path, requests: list[Request]) -> list[np.ndarray]:
    """Per request ``[P + N - 1, L, k]``: its prefill pass, then one token per decode pass, in pass order."""
    with open_trace(trace_path) as trace:
        chunks = list(trace.iter_tokens())
    ids = np.concatenate([c.topk_ids for c in chunks]).astype(np.int64)
    pass_id = np.concatenate([c.pass_id for c in chunks])
    passes = np.unique(pass_id)
    assert len(passes) == len(requests) * NEW_TOKENS, "one prefill and NEW_TOKENS - 1 decode passes per request"
    out = []
    for i, req in enumerate(requests):
        mine = passes[i * NEW_TOKENS : (i + 1) * NEW_TOKENS]
        rows = np.concatenate([ids[pass_id == p] for p in mine])
        assert (pass_id == mine[0]).sum() == req.prompt_len
        out.append(rows)
    return out


def _hf_passes(model: torch.nn.Module, requests: list[Request], out: Path) -> Path:
    """The vLLM pass structure in transformers: prefill, then each fed-back token with the KV cache."""
    handle = hf.instrument(model, mode="per_token", output_dir=out)
    handle.recorder.start_record()
    with torch.no_grad():
        for req in requests:
            ids = torch.tensor([req.tokens])
            step = model(ids[:, : req.prompt_len], use_cache=True)
            for j in range(req.prompt_len, len(req.tokens) - 1):
                step = model(ids[:, j : j + 1], past_key_values=step.past_key_values, use_cache=True)
    handle.recorder.stop_record()
    path = handle.recorder.dump_record(out / "hf_passes.h5")
    handle.uninstrument()
    return path


def _teacher_forced(model: torch.nn.Module, tokens: list[int], layer_ids: list[int], out: Path) -> tuple[np.ndarray, np.ndarray]:
    """Routes ``[S - 1, L, k]`` (MoE layers) and log p of each next token, of one forward over ``tokens[:-1]``."""
    length = len(tokens) - 1
    capturer = RoutedExpertsCapturer(max(layer_ids) + 1, 2, max_tokens_per_pass=length, num_kv_slots=length)
    handle = hf.instrument(model, capturer=capturer, capture_seq_len=length, output_dir=out)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens[:-1]])).logits[0]
        routes = handle.routed_experts(0, length, batch_size=1)
    finally:
        handle.uninstrument()
    logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return select_layers(routes.astype(np.int64), layer_ids), logprobs.numpy()


@pytest.fixture(scope="module", params=sorted(MODELS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    from transformers import AutoModelForCausalLM

    name = request.param
    out = tmp_path_factory.mktemp(f"divergence-{name}")
    checkpoint = build_checkpoint(name, out / "checkpoint")
    layer_ids = list(MODELS[name]["layer_ids"])
    requests, vllm_trace = _vllm_run(checkpoint, out)
    gc.collect()
    vllm_routes = _vllm_routes(vllm_trace, requests)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf_trace = _hf_passes(model, requests, out)
    own, replayed, own_lp, replay_lp = {}, {}, [], []
    for i, (req, routes) in enumerate(zip(requests, vllm_routes, strict=True)):
        own[str(i)], lp = _teacher_forced(model, req.tokens, layer_ids, out)
        own_lp.append(lp)
        with hf.replay(model, routes):
            replayed[str(i)], lp = _teacher_forced(model, req.tokens, layer_ids, out)
        replay_lp.append(lp)
    meta = {"model": name, "layer_ids": layer_ids, "num_experts": MODELS[name]["num_experts"]}
    files = {
        "vllm": save_routes(out / "vllm.json", {str(i): r for i, r in enumerate(vllm_routes)}, **meta),
        "hf": save_routes(out / "hf.json", own, **meta),
        "replay": save_routes(out / "hf_replay.json", replayed, **meta),
    }
    return Runs(name, layer_ids, requests, vllm_trace, hf_trace, files, {"own": own_lp, "replay": replay_lp})


def _gap(runs: Runs, which: str) -> tuple[float, float]:
    gaps = np.concatenate([np.abs(hf_lp - req.vllm_logprobs) for hf_lp, req in zip(runs.hf_logprobs[which], runs.requests, strict=True)])
    return float(gaps.mean()), float(gaps.max())


def test_engines_diverge_and_diff_reports_it(runs: Runs) -> None:
    cli = CliRunner().invoke(app, ["diff", str(runs.vllm_trace), str(runs.hf_trace), "--json"])
    assert cli.exit_code == 0, cli.output
    passes = json.loads(cli.output)
    assert passes["alignment"] == {"by": "pass and position", "matched_tokens": sum(len(r.tokens) - 1 for r in runs.requests), "only_in_a": 0, "only_in_b": 0}
    forward = diff_sources(runs.files["vllm"], runs.files["hf"])
    assert forward.alignment["matched_tokens"] == passes["alignment"]["matched_tokens"]
    assert forward.tokens == passes["tokens"] > 0
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


def test_vllm_routes_are_real_routes(runs: Runs) -> None:
    """Sanity for the comparison: vLLM's routes file holds distinct in-range ids for every token and MoE layer."""
    data: dict[str, Any] = json.loads(runs.files["vllm"].read_text())
    assert data["layer_ids"] == runs.layer_ids and len(data["requests"]) == len(PROMPTS)
