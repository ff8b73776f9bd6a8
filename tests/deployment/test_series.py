"""Analysis across recordings: 52 recordings of one deployment, with restarts and an EPLB-style remap.

Each recording is a fresh recorder (a restart: its own run id) dumped at a known
wall-clock time (a fast clock: ``time.time`` advanced by 20 minutes per recording). The fast
clock runs in this process only, so the streamed recordings write their segments here too
(the recording's fallback when no writer process can be started, as under an embedded
interpreter): a writer process would stamp its segments with the real clock.
Half-way the deployment is remapped: 18 physical slots on 3 EP ranks with two
redundant replicas instead of 16 slots on 2 ranks. The series is recomputed by
hand from the ids each recording was fed, with numpy loops written from the
metric definitions (DESIGN.md), not through moetrace.balance.
"""

from __future__ import annotations

import itertools
import json
from unittest import mock

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.analysis.deployment import analyze_deployment, group_recordings
from moetrace.trace.schema import TraceError
from tests.analysis.helpers import files_written_here, random_passes, record

E, L, K = 16, 3, 2
START = 1_790_000_000.0  # wall-clock of the first recording
STEP = 1200.0  # 20 minutes between recordings: 3 per hour


def _remap() -> np.ndarray:
    """18 slots: logical 0..15, then replicas of experts 0 and 1 (EPLB's phy2log, same per layer)."""
    row = np.concatenate([np.arange(E), [0, 1]])
    return np.tile(row, (L, 1))


def _js(a: np.ndarray, b: np.ndarray) -> float:
    out = []
    for x, y in zip(a, b, strict=True):
        p, q = x / x.sum(), y / y.sum()
        m = (p + q) / 2
        kl_p = sum(pi * np.log2(pi / mi) for pi, mi in zip(p, m, strict=True) if pi > 0)
        kl_q = sum(qi * np.log2(qi / mi) for qi, mi in zip(q, m, strict=True) if qi > 0)
        out.append(0.5 * kl_p + 0.5 * kl_q)
    return float(np.mean(out))


def _hand(passes: list[np.ndarray], mapping: np.ndarray | None, ep: int) -> dict:
    slots = E if mapping is None else mapping.shape[1]
    phy2log = np.tile(np.arange(E), (L, 1)) if mapping is None else mapping
    physical = np.zeros((L, slots), dtype=np.int64)
    tokens = 0
    for ids in passes:
        tokens += ids.shape[0]
        for t in range(ids.shape[0]):
            for layer in range(L):
                for e in ids[t, layer]:
                    if 0 <= e < slots:
                        physical[layer, e] += 1
    logical = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):
        for p in range(slots):
            logical[layer, phy2log[layer, p]] += physical[layer, p]
    per = slots // ep
    load = np.array([[physical[layer, r * per:(r + 1) * per].sum() for r in range(ep)] for layer in range(L)])
    return {"logical": logical, "load": load, "tokens": tokens, "passes": len(passes)}


def _balance(load: np.ndarray) -> float:
    return float(sum(row.mean() for row in load) / sum(row.max() for row in load))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deployment")
    rng = np.random.default_rng(7)
    paths, hand = [], []
    for i in range(52):
        remapped = i >= 26
        mapping, ep, slots = (_remap(), 3, 18) if remapped else (None, 2, E)
        skew = 0.5 + 1.5 * (i % 4) / 3  # the load changes between recordings
        passes = random_passes(rng, int(rng.integers(3, 7)), L, slots, K, skew=skew, max_tokens=6)
        now = START + i * STEP
        with mock.patch("time.time", lambda now=now: now), files_written_here():
            paths.append(record(tmp, "stat" if i % 5 else "per_pass", passes, slots, ep_size=ep, name=f"rec{i:02d}.h5",
                                physical_to_logical=mapping))
        hand.append({**_hand(passes, mapping, ep), "created": now, "ep": ep})
    return tmp, paths, hand


def test_series_equals_the_hand_computed_one(deployment):
    _, paths, hand = deployment
    shuffled = list(reversed(paths))  # the order given does not matter: wall-clock time orders the series
    report = analyze_deployment(shuffled, top=3)
    assert len(report.recordings) == 52
    for got, want in zip(report.recordings, hand, strict=True):
        assert got.created_unix == want["created"]
        np.testing.assert_array_equal(got.logical_count, want["logical"])
        np.testing.assert_array_equal(got.rank_load, want["load"])
        assert got.num_tokens == want["tokens"] and got.num_passes == want["passes"]
        assert got.balancedness == pytest.approx(_balance(want["load"]))
    for got, (a, b) in zip(report.drift(), itertools.pairwise(hand), strict=True):
        assert got == pytest.approx(_js(a["logical"], b["logical"]), abs=1e-12)
    assert report.remaps() == [26]
    doc = report.to_dict()
    np.testing.assert_array_equal(report.logical_count, sum(h["logical"] for h in hand))
    assert doc["span"]["tokens"] == sum(h["tokens"] for h in hand)
    assert doc["span"]["balancedness"] is None  # two layout sizes in the span: rank loads do not add up
    assert doc["span"]["remaps"] == [26]
    buckets: dict[int, list[dict]] = {}
    for h in hand:
        buckets.setdefault(int(h["created"] // 3600), []).append(h)
    hours = doc["hours"]
    assert [h["hour_unix"] for h in hours] == [b * 3600.0 for b in sorted(buckets)]
    for hour, key in zip(hours, sorted(buckets), strict=True):
        members = buckets[key]
        assert hour["recordings"] == len(members)
        assert hour["tokens"] == sum(m["tokens"] for m in members)
        if len({m["ep"] for m in members}) == 1:
            assert hour["balancedness"] == pytest.approx(_balance(sum(m["load"] for m in members)))
        else:
            assert hour["balancedness"] is None
    json.dumps(doc)


def test_cli_analyses_recordings_as_a_series(deployment):
    _, paths, hand = deployment
    runner = CliRunner()
    result = runner.invoke(app, ["analyze", "--json", *map(str, paths[:6])])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == "moetrace-deployment"
    assert [r["tokens"] for r in doc["recordings"]] == [h["tokens"] for h in hand[:6]]
    text = runner.invoke(app, ["analyze", *map(str, paths[:6])])
    assert text.exit_code == 0, text.output
    assert "6 recordings" in text.output
    assert max(len(line) for line in text.output.splitlines()) <= 80


def test_dask_series_equals_the_local_one(deployment):
    distributed = pytest.importorskip("distributed")
    _, paths, _ = deployment
    local = analyze_deployment(paths[:8]).to_dict()
    with distributed.Client(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as client:
        remote = analyze_deployment(paths[:8], client=client).to_dict()
    assert json.dumps(remote, sort_keys=True) == json.dumps(local, sort_keys=True)


def test_mixed_models_are_refused(deployment, tmp_path):
    _, paths, _ = deployment
    rng = np.random.default_rng(1)
    other_experts = record(tmp_path, "stat", random_passes(rng, 3, L, 8, K), 8, name="experts8.h5")
    with pytest.raises(TraceError, match="num_logical_experts=8 differs"):
        group_recordings([paths[0], other_experts])
    other_layers = record(tmp_path, "stat", random_passes(rng, 3, L, E, K), E, name="layers.h5", layer_ids=(1, 3, 5))
    with pytest.raises(TraceError, match=r"MoE layers .* differ"):
        group_recordings([paths[0], other_layers])
    result = CliRunner().invoke(app, ["analyze", str(paths[0]), str(other_experts)])
    assert result.exit_code == 2 and "different models" in result.output
