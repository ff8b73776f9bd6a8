"""A two-rank vLLM engine on CPU with moetrace's plugin, read the way the multi-rank tests need it.

One engine per test module (every two-rank start costs tens of seconds on two
cores): :func:`serve` runs the prompts, collects an independent capture in every
worker, each rank's ``/status``, ``/metrics`` and ``/dump``, ``moetrace top
--once`` over both endpoints, serves the first prompt once more (recorded: what
each worker's dump at exit must hold), then removes the hooks and serves the
prompts again, stops the engine and waits (bounded) for both exit dumps.
:func:`hf_count` counts the tokens the engine computed with the Hugging Face
forward of the same checkpoint on the same token ids; :func:`topk_agreement`
measures how often that fp32 forward picks the experts vLLM picked.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moetrace.trace.reader import open_trace

from ..servers import SUBPROCESS_BOUND_S, moetrace_cli, post_json
from . import capture, probes
from .checkpoints import MODELS, build_checkpoint
from .engine import PROMPTS, sampling_params, start_llm, stop_llm

__all__ = ["SPEC", "TP", "WORKER_EXIT_S", "Served", "check_dumps_at_exit", "computed", "hf_count", "hf_logits", "pass_counts",
           "serve", "topk_agreement", "wait_for"]

SPEC = MODELS["mixtral"]
TP = 2


@dataclass
class Served:
    checkpoint: Path
    outputs: list[list[int]]
    prompt_ids: list[list[int]]
    plain_outputs: list[list[int]]
    captures: list[dict[str, Any]]
    statuses: list[dict[str, Any]]
    dumps: list[Path]
    top: str
    exported_tokens: float
    after: list[dict[str, Any]]
    expert_maps: list[dict[int, list[int]]]  # per rank: {layer id: global expert -> local slot, -1 elsewhere}; {} without EP
    exit_captures: list[dict[str, Any]]  # per rank: the capture after the recorded second generate (cumulative)
    exit_dumps: list[Path]  # each worker's dump at exit, in rank order
    exit_sequences: list[list[int]]  # the token ids the second generate ran through the model
    request_ids: list[str]  # RequestOutput.request_id of each prompt of the first generate


#: Seconds a worker may take to exit (vLLM's default, 5 s, then SIGTERM and SIGKILL, is short on a
#: loaded machine; the exit dump runs in the worker's exit). The engine core waits this long, bounded.
WORKER_EXIT_S = 120


def wait_for(find: Callable[[], list[Path]], count: int, seconds: float = WORKER_EXIT_S) -> list[Path]:
    """``find()`` once it returns ``count`` paths (exiting workers write their dumps), or its last answer."""
    deadline = time.monotonic() + seconds
    while len(found := find()) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def serve(tmp_path_factory: pytest.TempPathFactory, name: str, mode: str = "per_pass", **options: Any) -> Served:
    """Start a two-rank engine (``options`` go to ``vllm.LLM``), serve :data:`PROMPTS` with the plugin in
    ``mode``, read every rank's control endpoint, serve the first prompt again (recorded), remove the
    hooks, serve again, stop, and collect both workers' dumps at exit."""
    out = tmp_path_factory.mktemp(name)
    checkpoint = build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships the probes to the workers
        llm = start_llm(checkpoint, {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (vLLM refuses more ranks than NUMA nodes otherwise)
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": str(WORKER_EXIT_S),
            "MOETRACE_ENABLED": "1",
            "MOETRACE_MODE": mode,
            "MOETRACE_OUTPUT_DIR": str(out),
            "MOETRACE_CONTROL_PORT": "0",
        }, tensor_parallel_size=TP, enable_prefix_caching=False, **options)
        try:
            expert_maps = llm.apply_model(probes.expert_maps)
            llm.apply_model(capture.install)
            results = llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
            captures = llm.apply_model(capture.collect(SPEC["layer_ids"], SPEC["num_experts"]))
            controls = sorted((json.loads(p.read_text()) for p in out.glob("moetrace-control-*.json")), key=lambda c: c["rank"])
            statuses = [json.loads(get(c["url"] + "/status")) for c in controls]
            exported = sum(tokens_total(get(c["url"] + "/metrics")) for c in controls)
            top = moetrace_cli("top", "--once", *(arg for c in controls for arg in ("--url", c["url"])))
            dumps = [Path(post_json(c["url"] + "/dump", {"name": "live.h5"}, timeout=SUBPROCESS_BOUND_S)["path"]) for c in controls]
            again = llm.generate(PROMPTS[:1], sampling_params(), use_tqdm=False)  # what the dumps at exit hold
            exit_captures = llm.apply_model(capture.collect(SPEC["layer_ids"], SPEC["num_experts"]))
            llm.apply_model(probes.uninstrument)
            plain = llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
            after = [json.loads(get(c["url"] + "/status")) for c in controls]
        finally:
            stop_llm(llm, timeout=2 * WORKER_EXIT_S)
    exit_dumps = sorted(wait_for(lambda: list(out.glob(f"moetrace-{mode}-*.h5")), TP), key=lambda p: p.stem.rsplit("-rank", 1)[-1])
    (second,) = [list(r.prompt_token_ids) + list(r.outputs[0].token_ids)[:-1] for r in again]
    return Served(checkpoint, [list(r.outputs[0].token_ids) for r in results], [list(r.prompt_token_ids) for r in results],
                  [list(r.outputs[0].token_ids) for r in plain], captures, statuses, dumps, top, exported, after, expert_maps,
                  exit_captures, exit_dumps, [second], [r.request_id for r in results])


def tokens_total(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "moetrace_tokens_total")


def hf_logits(checkpoint: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """The fp32 reference: per sequence, the Hugging Face router logits ``[positions, L, E]`` of every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.stack(model(torch.tensor([ids]), output_router_logits=True).router_logits, dim=1).numpy() for ids in sequences]


def hf_count(checkpoint: Path, sequences: list[list[int]]) -> tuple[int, np.ndarray]:
    """The independent count: (tokens, ``[L, E]`` top-k counts) of the HF forward on the tokens vLLM computed."""
    counts = np.zeros((len(SPEC["layer_ids"]), SPEC["num_experts"]), dtype=np.int64)
    logits = hf_logits(checkpoint, sequences)
    for per_sequence in logits:
        chosen = np.argsort(-per_sequence, axis=-1, kind="stable")[..., : SPEC["top_k"]]  # [n, L, k]
        for layer in range(len(SPEC["layer_ids"])):
            counts[layer] += np.bincount(chosen[:, layer].ravel(), minlength=SPEC["num_experts"])
    return sum(len(ids) for ids in sequences), counts


def topk_agreement(routes: list[dict[str, np.ndarray]], sequences: list[list[int]], reference: list[np.ndarray]) -> np.ndarray:
    """Per MoE layer ``[L, 2]``: (tokens whose top-k *set* equals the reference's, tokens compared).

    ``routes`` are one rank's captured rows (:meth:`~.capture.RoutingCapture.routes`); each row's
    token is found in ``reference`` (:func:`hf_logits` of ``sequences``) by its token id and position,
    and among the positions that share both (the same token at the same place in several
    sequences) by the nearest router logits.
    """
    candidates: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s, ids in enumerate(sequences):
        for position, token in enumerate(ids):
            candidates.setdefault((position, token), []).append((s, position))
    column = {layer: i for i, layer in enumerate(SPEC["layer_ids"])}
    out = np.zeros((len(column), 2), dtype=np.int64)
    for row in routes:
        layer = column[row["layer"]]
        for token, position, chosen, logits in zip(row["token"], row["position"], row["ids"], row["logits"], strict=True):
            found = candidates[(int(position), int(token))]
            s, p = min(found, key=lambda c: float(np.abs(reference[c[0]][c[1], layer] - logits).max()))
            expected = np.argsort(-reference[s][p, layer], kind="stable")[: len(chosen)]
            out[layer] += (set(chosen.tolist()) == set(expected.tolist()), 1)
    return out


def computed(served: Served) -> list[list[int]]:
    """The token ids vLLM ran through the model: each prompt and every generated token but the last."""
    return [p + o[:-1] for p, o in zip(served.prompt_ids, served.outputs, strict=True)]


def pass_counts(path: Path) -> np.ndarray:
    """``[passes, L, E]`` top-k counts of one rank's ``per_pass`` or ``per_token`` trace, in pass order."""
    with open_trace(path) as trace:
        if trace.mode == "per_pass":
            return np.concatenate([c.physical_count for c in trace.iter_passes()])
        chunks = list(trace.iter_tokens())
    pass_id = np.concatenate([c.pass_id for c in chunks])
    ids = np.concatenate([c.topk_ids for c in chunks]).astype(np.int64)  # [N, L, k]
    passes = np.unique(pass_id)
    out = np.zeros((len(passes), ids.shape[1], SPEC["num_experts"]), dtype=np.int64)
    row = np.broadcast_to(np.searchsorted(passes, pass_id)[:, None], ids.shape[::2])
    for layer in range(ids.shape[1]):
        np.add.at(out[:, layer], (row, ids[:, layer]), 1)
    return out


def check_dumps_at_exit(served: Served, mode: str) -> None:
    """Both workers' dumps at exit (vLLM tore its process group down first) say rank r of 2, hold what
    the engine routed (each worker's independent capture: the passes after the live ``/dump``, or every
    pass for a cumulative ``stat`` dump), and ``moetrace analyze`` of the two files and ``moetrace
    merge`` count the tokens the engine ran once."""
    assert len(served.exit_dumps) == TP, f"expected one dump at exit per worker, found {served.exit_dumps}"
    first = 0 if mode == "stat" else served.captures[0]["passes"]  # the capture is cumulative
    for rank, path in enumerate(served.exit_dumps):
        expected = served.exit_captures[rank]["counts"][first:]  # [passes, L, E]
        with open_trace(path) as trace:
            assert (trace.attrs["rank"], trace.attrs["world_size"], trace.mode) == (rank, TP, mode)
            assert [(x.rank, x.tp_rank, x.replicates_tokens) for x in trace.layouts] == [(rank, rank, rank > 0)]
            np.testing.assert_array_equal(trace.physical_count(), expected.sum(axis=0))  # this rank's own view
        if mode != "stat":
            np.testing.assert_array_equal(pass_counts(path), expected)
    sequences = (computed(served) if mode == "stat" else []) + served.exit_sequences
    tokens = sum(len(ids) for ids in sequences)
    engine = served.exit_captures[0]["counts"][first:].sum(axis=0)  # [L, E], rank 0's view (rank 1 routes alike)
    assert int(engine.sum()) == tokens * SPEC["top_k"] * len(SPEC["layer_ids"])
    paths = [str(p) for p in served.exit_dumps]
    report = json.loads(moetrace_cli("analyze", "--json", *paths))
    assert (report["totals"]["tokens"], report["totals"]["assignments"]) == (tokens, int(engine.sum()))
    merged = served.exit_dumps[0].with_name(f"exit-merged-{mode}.h5")
    moetrace_cli("merge", *paths, "-o", str(merged))
    with open_trace(merged) as trace:
        assert trace.tokens_served() == tokens
        np.testing.assert_array_equal(trace.physical_count(), engine)
