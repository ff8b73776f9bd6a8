"""moetrace on a live SGLang HTTP server (``python -m sglang.launch_server``, loopback), driven by ``moetrace ... --sglang``.

The server runs SGLang's recorder in ``stat`` mode and moetrace's in ``stat``
mode. ``moetrace start/stop/dump/status --sglang --url`` drive SGLang's own
``/start_expert_distribution_record``, ``/stop_...``, ``/dump_...`` and
``/server_info``; the dump writes SGLang's ``.pt`` and moetrace's trace.
Compared: moetrace's counts, SGLang's stat dump read by ``moetrace convert``,
and an independent count from the per-request routed experts the server
returned.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moetrace.adapters.sglang import read_routed_experts

from moetrace.reference import free_port
from moetrace.trace.reader import open_trace

from ..servers import SUBPROCESS_BOUND_S, http_status, moetrace_cli, post_json, serve
from .checkpoint import NUM_EXPERTS, NUM_LAYERS, TOP_K, build_checkpoint
from .engine import CPU_ENV, ENGINE_ARGS, GENERATION, PROMPTS

pytestmark = pytest.mark.slow

START_TIMEOUT = 420.0


@dataclasses.dataclass
class Server:
    url: str
    moetrace_dir: Path
    sglang_dir: Path
    log: Path


def _flags(args: dict[str, Any]) -> list[str]:
    flags = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        else:
            flags += [flag, str(value)]
    return flags


_post = functools.partial(post_json, timeout=SUBPROCESS_BOUND_S)
_cli = moetrace_cli


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("server")
    checkpoint = build_checkpoint(root / "qwen3_moe")
    port = free_port()
    env = {
        **os.environ, **CPU_ENV, "MOETRACE_ENABLED": "1", "MOETRACE_MODE": "stat",
        "MOETRACE_OUTPUT_DIR": str(root / "moetrace"), "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": str(root / "sglang"),
    }
    args = {**ENGINE_ARGS, "expert_distribution_recorder_mode": "stat", "enable_return_routed_experts": True}
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(checkpoint), "--host", "127.0.0.1", "--port", str(port), *_flags(args)]
    url = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    with serve(command, env, log, url + "/health", START_TIMEOUT):
        yield Server(url, root / "moetrace", root / "sglang", log)


@pytest.fixture(scope="module")
def recorded(server: Server) -> dict[str, Any]:
    """status, start, requests, stop, dump, all through the CLI and SGLang's endpoints."""
    status = json.loads(_cli("status", "--sglang", "--url", server.url))
    _cli("start", "--sglang", "--url", server.url)
    answers = [
        _post(server.url + "/generate", {"input_ids": p, "sampling_params": GENERATION, "return_routed_experts": True})
        for p in PROMPTS
    ]
    _cli("stop", "--sglang", "--url", server.url)
    _cli("dump", "--sglang", "--url", server.url)
    return {"status": status, "answers": answers}


def test_status_reads_sglang_server_info(recorded: dict[str, Any]) -> None:
    status = recorded["status"]
    assert status["expert_distribution_recorder_mode"] == "stat"
    assert status["model_path"].endswith("qwen3_moe")


def test_dump_writes_sglang_and_moetrace_files_with_equal_counts(server: Server, recorded: dict[str, Any], tmp_path: Path) -> None:
    (pt,) = server.sglang_dir.glob("*.pt")
    (h5,) = server.moetrace_dir.glob("moetrace-*.h5")
    expected = np.zeros((NUM_LAYERS, NUM_EXPERTS), np.int64)  # independent: the per-request routed experts
    for answer in recorded["answers"]:
        routed = read_routed_experts(answer, NUM_LAYERS, TOP_K)[answer["meta_info"]["cached_tokens"] :]
        for layer in range(NUM_LAYERS):
            expected[layer] += np.bincount(routed[:, layer].ravel(), minlength=NUM_EXPERTS)
    assert expected.sum() == sum(len(p) + GENERATION["max_new_tokens"] - 1 for p in PROMPTS) * NUM_LAYERS * TOP_K
    with open_trace(h5) as trace:
        assert trace.mode == "stat" and trace.attrs["engine"] == "sglang"
        np.testing.assert_array_equal(trace.logical_count(), expected)
        assert int(trace.num_passes().sum()) > 0
    dump = torch.load(pt, weights_only=True)
    np.testing.assert_array_equal(dump["logical_count"].numpy().sum(axis=0), expected)  # SGLang's own [buffer, L, E] window
    converted = tmp_path / "converted.h5"
    _cli("convert", str(pt), "-o", str(converted), "--top-k", str(TOP_K))
    with open_trace(converted) as trace:
        np.testing.assert_array_equal(trace.logical_count(), expected)


def test_sglang_endpoints_keep_working_over_http(server: Server, recorded: dict[str, Any]) -> None:
    """A second round through SGLang's endpoints directly (as its own users drive them)."""
    before = set(server.sglang_dir.glob("*.pt"))
    for action in ("start", "stop", "dump"):
        request = urllib.request.Request(f"{server.url}/{action}_expert_distribution_record", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
    assert len(set(server.sglang_dir.glob("*.pt")) - before) == 1
    assert http_status(server.url + "/health") == 200
