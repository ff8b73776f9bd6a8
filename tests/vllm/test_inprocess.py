"""moetrace on a real in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), CPU, tiny checkpoints.

One engine per model (module scope); one instrumented ``generate`` whose
per-pass, per-layer counts are checked against an independent capture of
the same run (:mod:`tests.vllm.capture`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moetrace.adapters import AlreadyInstrumentedError
from moetrace.adapters.vllm import RouterTap, find_moe_layers, instrument

from moetrace.config import RecorderConfig
from moetrace.recorder import ExpertDistributionRecorder
from moetrace.testing import assert_no_host_sync
from moetrace.trace.reader import Trace, open_trace

from .capture import RoutingCapture
from .checkpoints import MODELS, build_checkpoint
from .engine import GENERATION, PROMPTS, sampling_params, start_llm, stop_llm

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = [len(p.split()) for p in PROMPTS]


@dataclass
class Engine:
    name: str
    llm: Any
    model: torch.nn.Module
    layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int


@dataclass
class Run:
    handle: Any
    capture: RoutingCapture
    trace: Trace
    tokens: list[list[int]]
    baseline_tokens: list[list[int]]


def _generate(llm: Any) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, sampling_params(), use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name = request.param
    llm = start_llm(build_checkpoint(name, tmp_path_factory.mktemp(name)), {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    spec = MODELS[name]
    yield Engine(name, llm, llm.apply_model(lambda m: m)[0], spec["layer_ids"], spec["num_experts"], spec["top_k"])
    stop_llm(llm)


@pytest.fixture(scope="module")
def run(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Plain generate, then instrumented generate with an independent capture, dumped per pass."""
    baseline = _generate(engine.llm)
    out = tmp_path_factory.mktemp("traces")
    handle = instrument(engine.llm, mode="per_pass", output_dir=out)
    capture = RoutingCapture(engine.model)
    handle.recorder.start_record()
    tokens = _generate(engine.llm)
    handle.recorder.stop_record()
    capture.remove()
    path = handle.recorder.dump_record(out / f"{engine.name}.h5")
    yield Run(handle, capture, open_trace(path), tokens, baseline)
    handle.uninstrument()


def _pass_counts(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    chunks = list(trace.iter_passes(1024))
    return np.concatenate([c.physical_count for c in chunks]), np.concatenate([c.num_tokens for c in chunks])


def test_every_moe_layer_is_hooked_through_capture_fn(engine: Engine, run: Run) -> None:
    assert run.handle.layer_ids == engine.layer_ids
    assert set(run.handle.details["layers"].values()) == {"capture_fn"}
    cfg = run.handle.recorder.config
    assert (cfg.num_layers, cfg.num_physical_experts, cfg.top_k) == (len(engine.layer_ids), engine.num_experts, engine.top_k)
    assert cfg.engine == "vllm" and cfg.hidden_size == 128 and cfg.dtype_bytes == 2
    for layer in find_moe_layers(engine.model):
        assert isinstance(layer.runner.router.capture_fn, RouterTap)


def test_counts_equal_independent_capture_per_pass_and_layer(engine: Engine, run: Run) -> None:
    counts, tokens = _pass_counts(run.trace)
    expected = run.capture.counts(engine.layer_ids, engine.num_experts)
    assert counts.shape == expected.shape
    np.testing.assert_array_equal(counts, expected)
    np.testing.assert_array_equal(tokens, run.capture.tokens())
    # Prefill of all three prompts in one pass, then one pass per decode step.
    assert tokens.tolist() == [sum(PROMPT_LENGTHS)] + [len(PROMPTS)] * (GENERATION["max_tokens"] - 1)
    assert counts.sum(axis=2).tolist() == [[t * engine.top_k] * len(engine.layer_ids) for t in tokens]
    np.testing.assert_array_equal(run.trace.physical_count(), expected.sum(axis=0))
    assert run.trace.attrs["engine"] == "vllm"
    assert run.trace.layers.tolist() == list(engine.layer_ids)


def test_independent_capture_is_real_routing(engine: Engine, run: Run) -> None:
    assert run.capture.topk_violations(engine.num_experts) == 0
    per_layer = run.capture.counts(engine.layer_ids, engine.num_experts).sum(axis=0)
    assert not all(np.array_equal(per_layer[0], row) for row in per_layer[1:]), "every layer routes identically"
    assert (per_layer > 0).sum() > len(engine.layer_ids) * engine.top_k


def test_instrumentation_changes_no_output(run: Run) -> None:
    assert run.tokens == run.baseline_tokens


def test_instrument_twice_is_harmless(engine: Engine, run: Run) -> None:
    assert instrument(engine.llm) is run.handle
    assert instrument(engine.llm, recorder=run.handle.recorder) is run.handle
    other = ExpertDistributionRecorder(RecorderConfig(num_layers=len(engine.layer_ids), num_physical_experts=8, top_k=2))
    with pytest.raises(AlreadyInstrumentedError, match="another recorder"):
        instrument(engine.llm, recorder=other)


def test_router_tap_does_not_sync_host_and_device(engine: Engine, run: Run) -> None:
    recorder = run.handle.recorder
    recorder.start_record()
    tap = find_moe_layers(engine.model)[-1].runner.router.capture_fn
    ids = torch.tensor([[0, 1], [2, 3], [1, 7]], dtype=torch.int32)
    with recorder.with_forward_pass(), assert_no_host_sync():
        tap(ids)
    recorder.stop_record()
    last = recorder.snapshot().physical_count[-1]
    assert last.tolist() == [1, 2, 1, 1, 0, 0, 0, 1]


def test_vllm_capture_fn_is_chained_both_ways(engine: Engine, run: Run, tmp_path: Path) -> None:
    """A callback set before instrumenting and one set after through set_capture_fn both keep working."""
    run.handle.uninstrument()
    routers = [layer.runner.router for layer in find_moe_layers(engine.model)]
    seen: dict[str, list[int]] = {"before": [], "after": []}

    def callback(key: str, ids: torch.Tensor) -> None:
        seen[key].append(int(ids.numel()))

    routers[0].set_capture_fn(functools.partial(callback, "before"))
    handle = instrument(engine.llm, output_dir=tmp_path)
    try:
        routers[1].set_capture_fn(functools.partial(callback, "after"))  # as vLLM's routed-experts capture would
        handle.recorder.start_record()
        _generate(engine.llm)
        handle.recorder.stop_record()
        totals = handle.recorder.snapshot().physical_count.sum(axis=1)
        assert sum(seen["before"]) == totals[0] and sum(seen["after"]) == totals[1] > 0
    finally:
        handle.uninstrument()
    assert routers[0].capture_fn.func is callback and routers[1].capture_fn.func is callback
    for router in routers:
        router.set_capture_fn(None)


def test_uninstrument_restores_the_model(engine: Engine, run: Run) -> None:
    run.handle.uninstrument()
    assert run.handle.num_hooks == 0
    assert "forward" not in engine.model.__dict__
    for layer in find_moe_layers(engine.model):
        router = layer.runner.router
        assert router.capture_fn is None
        assert "set_capture_fn" not in router.__dict__ and "select_experts" not in router.__dict__
    run.handle.recorder.start_record()
    assert _generate(engine.llm) == run.baseline_tokens
    assert run.handle.recorder.snapshot().physical_count.sum() == 0
    run.handle.recorder.stop_record()


def test_report_of_the_vllm_trace_in_a_real_browser(engine: Engine, run: Run, tmp_path: Path) -> None:
    """``moetrace report`` of the live engine's per_pass trace, opened in Chromium: every section's figure drawn."""
    from moetrace.report import build_report

    from ..report.browser import available, browser, check_page, open_report

    out = build_report([run.trace.path], tmp_path / f"{engine.name}.html")
    assert available() is None, available()
    with browser() as driver:
        view = open_report(driver, out)
    assert {"headline", "experts", "placement"} <= set(view.sections)
    assert "coactivation" not in view.sections  # per_pass: no per-token ids
    check_page(view, view.sections)
