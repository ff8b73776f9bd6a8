"""The vllm.general_plugins entry point on a real multi-process vLLM engine (engine core + worker processes).

``MOETRACE_ENABLED=1``: the plugin instruments the model inside the worker,
starts recording after warm-up, serves the control endpoint and dumps on
exit. An independent capture is installed in the same worker through
``llm.apply_model`` and compared with what the control endpoint dumps.
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
from moetrace.adapters import AdapterError
from moetrace.adapters.vllm import instrument

from moetrace.trace.reader import Trace, open_trace

from . import capture, probes
from .checkpoints import MODELS, build_checkpoint
from .engine import PROMPTS, sampling_params, start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = MODELS["mixtral"]


@dataclass
class Served:
    output_dir: Path
    installed_routers: int
    summary: dict[str, Any]
    after_dump: dict[str, Any]
    control: dict[str, Any]
    status: dict[str, Any]
    live: Trace
    state: dict[str, Any]
    instrument_error: Exception | None
    exit_dumps: list[Path]


def _wait_for(find: Callable[[], list[Path]], seconds: float = 60.0) -> list[Path]:
    """``find()`` once it returns something (the worker may still be exiting), or its last answer."""
    deadline = time.monotonic() + seconds
    while not (found := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def _http(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    out = tmp_path_factory.mktemp("served")
    with pytest.MonkeyPatch.context() as env:
        # Lets apply_model ship the test's probe functions (read when sending, in this process, too).
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        return _serve(tmp_path_factory, out)


def _serve(tmp_path_factory: pytest.TempPathFactory, out: Path) -> Served:
    llm = start_llm(build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral")), {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "MOETRACE_ENABLED": "1",
        "MOETRACE_MODE": "per_pass",
        "MOETRACE_OUTPUT_DIR": str(out),
        "MOETRACE_CONTROL_PORT": "0",
    })
    try:
        installed = llm.apply_model(capture.install)[0]
        llm.generate(PROMPTS, sampling_params(), use_tqdm=False)
        summary = llm.apply_model(capture.collect(SPEC["layer_ids"], SPEC["num_experts"]))[0]
        (control_file,) = out.glob("moetrace-control-*.json")
        control = json.loads(control_file.read_text())
        status = _http(control["url"] + "/status")
        dumped = _http(control["url"] + "/dump", {"name": "live.h5"})
        # Passes after the live dump: the dump on exit holds exactly these (a streaming dump is a segment).
        llm.generate(PROMPTS[:1], sampling_params(), use_tqdm=False)
        after_dump = llm.apply_model(capture.collect(SPEC["layer_ids"], SPEC["num_experts"]))[0]
        state = llm.apply_model(probes.plugin_state)[0]
        try:
            instrument(llm)
            error = None
        except AdapterError as exc:
            error = exc
    finally:
        stop_llm(llm, timeout=30)
    exit_dumps = _wait_for(lambda: sorted(out.glob("moetrace-per_pass-*.h5")))
    return Served(out, installed, summary, after_dump, control, status, open_trace(dumped["path"]), state, error, exit_dumps)


def test_plugin_instruments_the_worker_model_once(served: Served) -> None:
    assert served.state == {
        "same_session": True, "instrumented": True, "layer_ids": SPEC["layer_ids"], "wrapped_once": True,
        "recording": True, "mode": "per_pass", "steps_followed": True,
    }
    assert served.installed_routers == len(SPEC["layer_ids"])


def test_control_endpoint_dump_equals_independent_capture(served: Served) -> None:
    chunks = list(served.live.iter_passes(1024))
    counts = np.concatenate([c.physical_count for c in chunks])
    tokens = np.concatenate([c.num_tokens for c in chunks])
    # Warm-up and profiling passes ran before recording started: only the generate's passes are there.
    assert served.status["passes"] == served.summary["passes"] == len(counts)
    np.testing.assert_array_equal(counts, served.summary["counts"])
    np.testing.assert_array_equal(tokens, served.summary["tokens"])
    prompt_tokens = sum(len(p.split()) for p in PROMPTS)
    assert tokens.sum() == prompt_tokens + len(PROMPTS) * (sampling_params().max_tokens - 1)
    assert served.summary["topk_violations"] == 0
    # The worker's model runner is followed: each pass names the phase and requests of vLLM's step. The
    # front end hands the engine core the prompts one by one, so a prompt can join beside the first
    # one's decode (a mixed pass); whatever the schedule, each request is in one prefill pass and
    # max_tokens - 1 decode passes (no prompt here is chunked), and a decode pass has one row per request.
    from moetrace.pass_phase import PASS_PHASES

    phases = np.asarray([PASS_PHASES[p] for p in np.concatenate([c.pass_phase for c in chunks])])
    requests = np.concatenate([c.num_requests for c in chunks])
    assert phases[0] == "prefill" and phases[-1] == "decode" and set(phases) <= {"prefill", "mixed", "decode"}
    assert requests.sum() == len(PROMPTS) * sampling_params().max_tokens
    np.testing.assert_array_equal(tokens[phases == "decode"], requests[phases == "decode"])
    assert (tokens[phases != "decode"] > requests[phases != "decode"]).all()
    assert served.live.attrs["engine"] == "vllm" and served.live.layers.tolist() == list(SPEC["layer_ids"])


def test_dump_on_exit_holds_the_passes_since_the_live_dump(served: Served) -> None:
    if not served.exit_dumps and list(served.output_dir.glob("moetrace-control-*.json")):
        # The worker's exit hooks never ran: vLLM SIGKILLed it (its engine core missed the shutdown
        # deadline), which no in-process hook survives. Dump-on-exit is best effort; /dump is not.
        pytest.skip("vLLM killed the worker process before it could exit; nothing to check")
    assert len(served.exit_dumps) == 1, f"expected one dump on exit in {served.output_dir}: {served.exit_dumps}"
    trace = open_trace(served.exit_dumps[0])
    first, total = served.summary["passes"], served.after_dump["passes"]
    assert total > first
    np.testing.assert_array_equal(trace.physical_count(), served.after_dump["counts"][first:].sum(axis=0))
    assert trace.num_passes().tolist() == [total - first] and trace.num_rows("passes/pass_id") == total - first
    assert not list(served.output_dir.glob("moetrace-control-*.json")), "the control endpoint file outlived the worker"
    assert served.control["pid"] == int(served.exit_dumps[0].stem.rsplit("-", 1)[1])


def test_instrument_refuses_an_engine_in_another_process(served: Served) -> None:
    assert isinstance(served.instrument_error, AdapterError)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in str(served.instrument_error)
    assert "MOETRACE_ENABLED=1" in str(served.instrument_error)
