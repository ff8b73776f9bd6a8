"""Node-pair counters: each rank's exporter (``gpus_per_node``) says how many copies it routed to each node, and a
real Prometheus running the shipped rules gives the fleet's inter-node share, equal to ``moetrace traffic`` of the
ranks' traces. Four EP ranks (two nodes of two) in one process, fed the fleet's deterministic skewed routing."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import pytest
from moetrace.exporters import prometheus
from moetrace.exporters.catalog import rules_path
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from moetrace import ExpertDistributionRecorder
from moetrace.analysis.traffic import trace_traffic
from moetrace.layout import RankLayout
from tests.exporters import fleet
from tests.exporters.promserver import SCRAPE_INTERVAL_S, Prometheus, require_prometheus

SHAPE, GPUS_PER_NODE, PASSES = fleet.SMALL, 2, 6


def _recorders(out: Path, mode: str = "stat") -> list[ExpertDistributionRecorder]:
    recorders = [ExpertDistributionRecorder(fleet.recorder_config(SHAPE, rank, out, mode=mode, run_id="node-pairs")) for rank in range(SHAPE.ep)]
    for rec in recorders:
        rec.start_record()
    for index in range(PASSES):
        for rec in recorders:
            fleet.record_pass(rec, SHAPE, 0, index)
    for rec in recorders:
        rec.stop_record()
    return recorders


def _node_pairs(recorder: ExpertDistributionRecorder, gpus_per_node: int) -> dict[tuple[int, int], float]:
    text = generate_latest(prometheus.register(recorder, gpus_per_node=gpus_per_node)).decode()
    return {(int(s.labels["source_node"]), int(s.labels["destination_node"])): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == "moetrace_node_pair_token_copies_total"}


def test_each_rank_exports_its_copies_per_destination_node(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    recorders = _recorders(tmp_path)
    for rank, rec in enumerate(recorders):
        ids = np.stack([fleet.fleet_routing(SHAPE, 0, i)[rank] for i in range(PASSES)])  # [passes, L, T, k] this rank's ids
        hand = np.zeros(SHAPE.ep // GPUS_PER_NODE)
        for slot in ids.ravel():  # by hand: slot -> rank -> node
            hand[int(slot) // (SHAPE.slots // SHAPE.ep) // GPUS_PER_NODE] += 1
        got = _node_pairs(rec, GPUS_PER_NODE)
        assert got == {(rank // GPUS_PER_NODE, node): hand[node] for node in range(len(hand))}
    # Off by default (no series); sizes that do not fit leave the family empty with one warning, never a failed scrape.
    assert _node_pairs(recorders[0], 1) and not any("node_pair" in line for line in generate_latest(prometheus.register(recorders[0])).decode().splitlines())
    with caplog.at_level(logging.WARNING, logger="moetrace.exporters.prometheus"):
        assert _node_pairs(recorders[0], 3) == {}
    assert "must divide the 4 EP ranks" in caplog.text
    with pytest.raises(ValueError, match="gpus_per_node must be a positive integer"):
        prometheus.register(recorders[0], gpus_per_node=0)


def test_a_tp_replica_rank_adds_nothing(tmp_path: Path) -> None:
    """Under TP attention the peer that routes the same tokens counts them; the replica's counters read 0."""
    layout = RankLayout.tensor_parallel(1, 2, ep_size=SHAPE.ep, ep_rank=1)
    rec = ExpertDistributionRecorder(dataclasses.replace(fleet.recorder_config(SHAPE, 1, tmp_path, mode="stat"), layout=layout))
    rec.start_record()
    fleet.record_pass(rec, SHAPE, 0, 0)
    rec.stop_record()
    assert set(_node_pairs(rec, GPUS_PER_NODE).values()) == {0.0}


def test_rules_give_the_fleet_inter_node_share_of_the_traces(tmp_path: Path) -> None:
    require_prometheus()
    recorders = _recorders(tmp_path, mode="per_pass")
    servers = [prometheus.start_http_server(0, recorder=rec, gpus_per_node=GPUS_PER_NODE) for rec in recorders]
    try:
        paths = [rec.dump_record(tmp_path / "fleet.h5") for rec in recorders]
        want = trace_traffic(paths, GPUS_PER_NODE)
        share = want.to_dict()["inter_node_share"]
        node_tokens = want.node_tokens.sum(axis=0)
        expected = {(a, b): float(node_tokens[a, b]) for a in range(2) for b in range(2)}
        with Prometheus(tmp_path, {"fleet": [f"127.0.0.1:{s.port}" for s in servers]}, rule_files=[rules_path()]) as prom:
            deadline = time.monotonic() + 60  # the rules run after the scrapes that carry every rank's final values
            pairs: dict[tuple[int, int], float] = {}
            while pairs != expected and time.monotonic() < deadline:
                time.sleep(SCRAPE_INTERVAL_S / 2)
                pairs = {(int(labels["source_node"]), int(labels["destination_node"])): v for labels, v in prom.query("moetrace:node_pair_token_copies")}
            got = prom.value("moetrace:inter_node_share")
    finally:
        for server in servers:
            server.close()
    assert pairs == expected
    assert got == pytest.approx(share, rel=1e-12) and 0 < share < 1  # negative control: neither all local nor all remote
