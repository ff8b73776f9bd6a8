"""Rank layouts on real gloo ranks with the reference runtime: each token counted once.

One spawn of two ranks records five layouts, in ``stat`` (gathered into one
file) and ``per_token`` (one file per rank) modes, and the ``tp`` layout once
more in every mode with the process group torn down before the dump (what vLLM's
workers do before their exit dumps: each rank writes its own file, which must
still say which rank of the layout it holds):

- ``tp``: TP attention, both ranks route the same tokens (replicated router);
- ``tp_ep``: the same with the experts split over the two ranks (vLLM's EP);
- ``dp``: each rank routes its own tokens (DP attention / data parallel);
- ``ep``: each rank routes its own tokens and dispatches them to the rank that
  holds the expert over a real all-to-all (``EPMoELayer``);
- ``legacy``: the ``tp`` workload recorded without a layout (the negative
  control: rank rows add up, so the tokens read twice).

The parent checks tokens served, per-expert counts, rank load, the EP
send/receive matrix and the Prometheus counters summed over ranks against a
numpy count from the router weights and the inputs, in the gathered dump,
the per-rank files joined by ``merge_traces``, ``analyze_trace``,
``analyze_traces`` and ``moetrace inspect``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from moetrace.cli.app import app
from moetrace.exporters.catalog import ALL, samples
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.analysis.distributed import analyze_traces
from moetrace.analysis.summary import analyze_trace
from moetrace.layout import RankLayout
from moetrace.reference import EPMoELayer, MoELayer, SwiGLUExperts, TopKRouter, launch, zipf_bias
from moetrace.trace import open_trace
from moetrace.trace.merge import merge_traces

pytestmark = pytest.mark.slow

H, FFN, E, K, PASSES, WORLD = 16, 24, 8, 2, 3, 2
LAYOUTS = ("tp", "tp_ep", "dp", "ep", "legacy")
MODES = ("stat", "per_pass", "per_token")
SHARED_TOKENS = ("tp", "tp_ep", "legacy")  # every rank holds the same tokens
COUNTERS = ("moetrace_tokens_total", "moetrace_layer_routed_tokens_total", "moetrace_rank_routed_tokens_total")


def _router() -> TopKRouter:
    return TopKRouter(H, E, K, bias=zipf_bias(E, 1.0, seed=0), seed=1)


def _inputs(name: str, rank: int, step: int) -> torch.Tensor:
    """This rank's hidden states ``[T, H]`` for pass ``step``: shared under TP attention, per rank otherwise."""
    owner = 0 if name in SHARED_TOKENS else rank
    tokens = 6 + step + 3 * owner
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(1000 * owner + step))


def _layout(name: str, rank: int, world: int) -> RankLayout | None:
    return {
        "tp": RankLayout.tensor_parallel(rank, world, source="reference"),
        "tp_ep": RankLayout.tensor_parallel(rank, world, ep_size=world, ep_rank=rank, source="reference"),
        "dp": RankLayout.independent(rank, world, source="reference"),
        "ep": RankLayout.independent(rank, world, ep_size=world, ep_rank=rank, source="reference"),
        "legacy": None,
    }[name]


def _tp_ep_forward(router: TopKRouter, local: SwiGLUExperts, x: torch.Tensor, recorder: ExpertDistributionRecorder) -> torch.Tensor:
    """vLLM's EP under TP attention: every rank routes the same tokens, computes the experts it
    holds and the partial outputs are all-reduced (no tokens exchanged, so no ``on_dispatch``)."""
    with recorder.with_current_layer(0):
        ids, weights = router(x)
        recorder.on_select_experts(ids)
        out = torch.zeros_like(x)
        for e in range(local.first, local.first + local.count):
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            out.index_add_(0, token, local.expert(e - local.first, x[token]) * weights[token, slot, None])
        dist.all_reduce(out)
    return out


def _worker(rank: int, world: int, out: str) -> dict:
    router = _router()
    dense = MoELayer(router, SwiGLUExperts(H, FFN, E, seed=2))
    per_rank = E // world
    local = SwiGLUExperts(H, FFN, per_rank, rank * per_rank, seed=2)
    sharded = EPMoELayer(router, local, ep_size=world, ep_rank=rank)
    forward = {"ep": lambda x, rec: sharded(x, recorder=rec), "tp_ep": lambda x, rec: _tp_ep_forward(router, local, x, rec)}
    results: dict = {}
    for name in LAYOUTS:
        layout = _layout(name, rank, world)
        ep = world if name in ("tp_ep", "ep") else 1
        for mode in ("stat", "per_token"):
            rec = ExpertDistributionRecorder(RecorderConfig(
                num_layers=1, num_physical_experts=E, top_k=K, ep_size=ep, ep_rank=rank if ep > 1 else 0, mode=mode,
                output_dir=out, layout=layout, max_tokens_per_pass=64, stream_chunk_tokens=64, segment_seconds=0))
            rec.start_record()
            with torch.inference_mode():
                for step in range(PASSES):
                    with rec.with_forward_pass():
                        forward.get(name, lambda x, rec: dense(x, recorder=rec))(_inputs(name, rank, step), rec)
            rec.stop_record()
            rec.dump_record(f"{out}/{name}-{mode}.h5")
            if mode == "stat":
                snap = rec.snapshot()
                exported = {spec.prom_name: {json.dumps(labels): value for labels, value in samples(spec, snap)}
                            for spec in ALL if spec.prom_name in COUNTERS}
                results[name] = {"status": rec.status()["layout"], "exported": exported}
    results["exit"] = _dump_without_the_group(rank, world, out)
    return results


def _dump_without_the_group(rank: int, world: int, out: str) -> dict:
    """Record ``tp`` in every mode while the group lives (one run id per mode, broadcast), then tear the
    group down and dump, as vLLM's TP workers do at exit; returns each dump's path and ``/status`` layout."""
    recorders = {}
    for mode in MODES:
        rec = ExpertDistributionRecorder(RecorderConfig(
            num_layers=1, num_physical_experts=E, top_k=K, mode=mode, output_dir=out, layout=_layout("tp", rank, world),
            max_tokens_per_pass=64, stream_chunk_tokens=64, segment_seconds=0))
        rec.start_record()
        with torch.inference_mode():
            for step in range(PASSES):
                with rec.with_forward_pass():
                    MoELayer(_router(), SwiGLUExperts(H, FFN, E, seed=2))(_inputs("tp", rank, step), recorder=rec)
        rec.stop_record()
        recorders[mode] = rec
    dist.destroy_process_group()
    return {mode: {"path": str(rec.dump_record(f"{out}/tp-exit-{mode}.h5")), "layout": rec.status()["layout"]} for mode, rec in recorders.items()}


def _expected(name: str) -> dict[str, np.ndarray | int]:
    """The independent count: top-k of ``x W^T + b`` in float64 numpy, each distinct token once."""
    router = _router()
    weight, bias = router.weight.detach().double().numpy(), router.bias.double().numpy()
    owners = [0] if name in SHARED_TOKENS else list(range(WORLD))
    counts = np.zeros((len(owners), E), dtype=np.int64)
    send = np.zeros((WORLD, WORLD), dtype=np.int64)
    tokens = 0
    for i, owner in enumerate(owners):
        for step in range(PASSES):
            x = _inputs(name, owner, step).double().numpy()
            ids = np.argsort(-(x @ weight.T + bias), axis=1)[:, :K]
            counts[i] += np.bincount(ids.ravel(), minlength=E)
            tokens += len(x)
            np.add.at(send[owner], ids.ravel() // (E // WORLD), 1)
    return {"tokens": tokens, "per_row": counts, "counts": counts.sum(axis=0), "send": send}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    results = launch(_worker, WORLD, str(out))
    return out, results


@pytest.mark.parametrize("name", ["tp", "tp_ep", "dp", "ep"])
def test_counts_equal_the_engine_in_every_view(recorded, name):
    out, results = recorded
    want = _expected(name)
    ep = WORLD if name in ("tp_ep", "ep") else 1
    want_load = want["counts"].reshape(ep, -1).sum(axis=1)
    with open_trace(out / f"{name}-stat.h5") as trace:  # gathered by the recorder: one file, a rank axis
        assert [layout.rank for layout in trace.layouts] == [0, 1]
        assert trace.tokens_served() == want["tokens"]
        np.testing.assert_array_equal(trace.physical_count()[0], want["counts"])
        per_rank = trace.physical_count(per_rank=True)[:, 0]
        if name in SHARED_TOKENS:  # replicas: both rows hold the same view, counted once
            np.testing.assert_array_equal(per_rank, [want["counts"]] * WORLD)
            assert list(trace.counted().assignments) == [True, False]
        else:  # every rank's own tokens
            np.testing.assert_array_equal(per_rank, want["per_row"])
            assert list(trace.counted().assignments) == [True, True]
    merged = merge_traces([out / f"{name}-per_token-rank{r}.h5" for r in range(WORLD)], out / f"{name}-merged.h5")
    with open_trace(merged) as trace:
        assert trace.tokens_served() == want["tokens"]
        np.testing.assert_array_equal(trace.physical_count()[0], want["counts"])
        assert [layout.describe() for layout in trace.layouts] == [_layout(name, r, WORLD).describe() for r in range(WORLD)]
    per_rank_files = [out / f"{name}-per_token-rank{r}.h5" for r in range(WORLD)]
    for report in (analyze_trace(out / f"{name}-stat.h5"), analyze_trace(merged), analyze_traces(per_rank_files)):
        assert report.num_tokens == want["tokens"]
        np.testing.assert_array_equal(report.physical_count[0], want["counts"])
        np.testing.assert_array_equal(report.rank_load[0], want_load)
    for report in (analyze_trace(merged), analyze_traces(per_rank_files)):  # per_token: the drift windows add up the same
        assert int(report.drift.tokens.sum()) == want["tokens"]
    exported = [results[r][name]["exported"] for r in range(WORLD)]
    assert sum(sum(e["moetrace_tokens_total"].values()) for e in exported) == want["tokens"]
    assert sum(sum(e["moetrace_layer_routed_tokens_total"].values()) for e in exported) == want["tokens"] * K
    load = np.zeros(ep, dtype=np.int64)
    for e in exported:
        for labels, value in e["moetrace_rank_routed_tokens_total"].items():
            load[json.loads(labels)["ep_rank"]] += value
    np.testing.assert_array_equal(load, want_load)
    for r in range(WORLD):
        status = results[r][name]["status"]
        assert (status["rank"], status["replicates_tokens"]) == (r, name in SHARED_TOKENS and r > 0)


def test_ep_send_matrix_is_source_by_destination(recorded):
    out, _ = recorded
    want = _expected("ep")["send"]  # [source rank, destination rank]
    with open_trace(out / "ep-stat.h5") as trace:
        np.testing.assert_array_equal(trace.dispatch_matrix()[0], want)
        np.testing.assert_array_equal(trace.recv_count()[:, 0], want.T)  # rank r received from s what s sent to r
        np.testing.assert_array_equal(trace.dispatch_matrix()[0].sum(axis=0), analyze_trace(out / "ep-stat.h5").rank_load[0])


def test_without_a_layout_replicated_ranks_count_twice(recorded):
    """The negative control: the same TP workload, no layout recorded, reads each token twice."""
    out, results = recorded
    want = _expected("legacy")
    with open_trace(out / "legacy-stat.h5") as trace:
        assert trace.tokens_served() == WORLD * want["tokens"]
        np.testing.assert_array_equal(trace.physical_count()[0], WORLD * want["counts"])
    assert sum(sum(results[r]["legacy"]["exported"]["moetrace_tokens_total"].values()) for r in range(WORLD)) == WORLD * want["tokens"]


def test_inspect_shows_each_rank_row(recorded):
    out, _ = recorded
    result = CliRunner().invoke(app, ["inspect", str(out / "tp-stat.h5"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [(row["rank"], row["tp_rank"], row["counted"]) for row in doc["ranks"]] == [(0, 0, True), (1, 1, False)]
    assert doc["tokens_served"] == _expected("tp")["tokens"]
    text = CliRunner().invoke(app, ["inspect", str(out / "tp-stat.h5")]).output
    assert "TP2 (TP attention)" in text and "tokens served" in text


@pytest.mark.parametrize("mode", MODES)
def test_dumps_after_the_group_is_gone_keep_each_rank(recorded, mode):
    """vLLM's exit dump at TP=2: no process group any more, each rank writes its own file as rank r
    of 2 (not rank 0 of 1), and merge / analyze read the two files as one run, each token once."""
    out, results = recorded
    want = _expected("tp")
    paths = [out / f"tp-exit-{mode}-rank{r}.h5" for r in range(WORLD)]
    assert [results[r]["exit"][mode]["path"] for r in range(WORLD)] == [str(p) for p in paths]
    for r, path in enumerate(paths):
        with open_trace(path) as trace:
            assert (trace.attrs["rank"], trace.attrs["world_size"], trace.mode) == (r, WORLD, mode)
            assert [(x.rank, x.tp_rank, x.replicates_tokens) for x in trace.layouts] == [(r, r, r > 0)]
            np.testing.assert_array_equal(trace.physical_count()[0], want["counts"])  # this rank's view: the whole batch
        assert (results[r]["exit"][mode]["layout"]["rank"], results[r]["exit"][mode]["layout"]["world_size"]) == (r, WORLD)
    merged = merge_traces(paths, out / f"tp-exit-{mode}-merged.h5")
    with open_trace(merged) as trace:
        assert trace.tokens_served() == want["tokens"]
        np.testing.assert_array_equal(trace.physical_count()[0], want["counts"])
    report = analyze_traces(paths)
    assert report.num_tokens == want["tokens"]
    np.testing.assert_array_equal(report.physical_count[0], want["counts"])


@pytest.mark.parametrize("mode", MODES)
def test_a_layout_without_a_process_group_names_the_rank(tmp_path, mode):
    """A driver that launches ranks its own way (or an offline converter) gives rank 5 of 8 and never
    starts torch.distributed: every dump still says rank 5 of 8, and the file is named for it."""
    assert not dist.is_initialized()
    layout = RankLayout.independent(5, 8, source="reference")
    rec = ExpertDistributionRecorder(RecorderConfig(
        num_layers=1, num_physical_experts=E, top_k=K, mode=mode, output_dir=tmp_path, layout=layout,
        max_tokens_per_pass=64, stream_chunk_tokens=64, segment_seconds=0))
    rec.start_record()
    x = _inputs("dp", 0, 0)
    with torch.inference_mode(), rec.with_forward_pass():
        MoELayer(_router(), SwiGLUExperts(H, FFN, E, seed=2))(x, recorder=rec)
    path = rec.dump_record(tmp_path / "converted.h5")
    assert path.name == "converted-rank5.h5"
    with open_trace(path) as trace:
        assert (trace.attrs["rank"], trace.attrs["world_size"]) == (5, 8)
        assert trace.layouts == (layout,)
        assert trace.tokens_served() == len(x)
    assert (rec.status()["layout"]["rank"], rec.snapshot().rank_layout.rank) == (5, 5)
