"""A two-rank vLLM engine on CPU with moetrace's plugin, read the way the multi-rank tests need it.

One engine per test module (every two-rank start costs tens of seconds on two
cores): :func:`serve` runs the prompts, collects an independent capture in every
worker, each rank's ``/status``, ``/metrics`` and ``/dump``, ``moetrace top
--once`` over both endpoints, then removes the hooks and serves the prompts
again. :func:`hf_count` is the independent count of the tokens the engine
computed: the Hugging Face forward of the same checkpoint on the same token ids.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ..servers import moetrace_cli, post_json
from . import capture, probes
from .checkpoints import MODELS, build_checkpoint
from .engine import PROMPTS, sampling_params, start_llm, stop_llm

__all__ = ["SPEC", "TP", "Served", "computed", "hf_count", "serve"]

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


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def serve(tmp_path_factory: pytest.TempPathFactory, name: str, **options: Any) -> Served:
    """Start a two-rank engine (``options`` go to ``vllm.LLM``), serve :data:`PROMPTS` with the plugin,
    read every rank's control endpoint, remove the hooks, serve again, stop."""
    out = tmp_path_factory.mktemp(name)
    checkpoint = build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships the probes to the workers
        llm = start_llm(checkpoint, {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank (vLLM refuses more ranks than NUMA nodes otherwise)
            "MOETRACE_ENABLED": "1",
            "MOETRACE_MODE": "per_pass",
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
            top = moetrace_cli("top", "--once", *(arg for c in controls for arg in ("--url", c["url"])), timeout=120)
            dumps = [Path(post_json(c["url"] + "/dump", {"name": f"tp-rank{c['rank']}.h5"}, timeout=120)["path"]) for c in controls]
            llm.apply_model(probes.uninstrument)
            plain = llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
            after = [json.loads(get(c["url"] + "/status")) for c in controls]
        finally:
            stop_llm(llm, timeout=60)
    return Served(checkpoint, [list(r.outputs[0].token_ids) for r in results], [list(r.prompt_token_ids) for r in results],
                  [list(r.outputs[0].token_ids) for r in plain], captures, statuses, dumps, top, exported, after, expert_maps)


def tokens_total(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "moetrace_tokens_total")


def hf_count(checkpoint: Path, sequences: list[list[int]]) -> tuple[int, np.ndarray]:
    """The independent count: (tokens, ``[L, E]`` top-k counts) of the HF forward on the tokens vLLM computed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    counts = np.zeros((len(SPEC["layer_ids"]), SPEC["num_experts"]), dtype=np.int64)
    tokens = 0
    with torch.inference_mode():
        for ids in sequences:
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
            for layer, layer_logits in enumerate(logits):
                chosen = layer_logits.topk(SPEC["top_k"], dim=-1).indices
                counts[layer] += np.bincount(chosen.reshape(-1).numpy(), minlength=SPEC["num_experts"])
            tokens += len(ids)
    return tokens, counts


def computed(served: Served) -> list[list[int]]:
    """The token ids vLLM ran through the model: each prompt and every generated token but the last."""
    return [p + o[:-1] for p, o in zip(served.prompt_ids, served.outputs, strict=True)]
