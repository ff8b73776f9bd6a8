"""Live: 3 reference replica processes behind the router serve 48 requests (shared prefixes, 3-turn sessions).

The replica trace must hold exactly what the replicas counted (decisions per
replica, cached tokens, queue waits and TTFTs), the prefix cache must really be
used, and every output must equal a plain unrouted run.
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.drivers.live import LiveCluster, Session, run_sessions, run_unrouted
from moetrace.replicas import ReplicaRecorder
from moetrace.trace.replica_requests import read_requests

pytestmark = pytest.mark.slow


def _sessions() -> list[Session]:
    rng = np.random.default_rng(3)
    systems = [tuple(rng.integers(0, 256, 48).tolist()) for _ in range(4)]
    return [
        Session(f"s{i}", systems[i % 4], tuple(tuple(rng.integers(0, 256, int(rng.integers(8, 21))).tolist()) for _ in range(3)), 6)
        for i in range(16)
    ]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("live")
    sessions = _sessions()
    rec = ReplicaRecorder(3, output_dir=out, block_size=16, engine="moetrace.reference")
    rec.start_record()
    with LiveCluster(3, "cache_aware", recorder=rec, cache_blocks=64, block_size=16) as cluster:
        outputs = run_sessions(cluster, sessions)
    path = rec.dump_record(out / "live.h5")
    rec.close()
    return sessions, outputs, cluster, read_requests(path)


def test_live_trace_equals_replica_counts(live_run):
    _, outputs, cluster, table = live_run
    q = table.requests
    assert len(table) == len(outputs) == 48
    assert (q["finished"] == 1).all()
    counted = {rid: (replica, c) for replica, stats in cluster.stats.items() for rid, c in stats.items()}
    assert sorted(counted) == sorted(q["id"])
    # decisions per replica = requests each replica served
    served = np.bincount([counted[rid][0] for rid in q["id"]], minlength=3)
    assert np.array_equal(np.bincount(q["replica"], minlength=3), served)
    for i, rid in enumerate(q["id"]):
        replica, c = counted[rid]
        assert q["replica"][i] == replica
        assert q["cached_tokens"][i] == c["cached_tokens"]
        assert q["output_tokens"][i] == c["output_tokens"] == len(outputs[rid])
        assert q["ttft"][i] == pytest.approx(c["ttft"], abs=1e-9)
        assert q["queue_wait"][i] == pytest.approx(c["queue_wait"], abs=1e-9)
        assert q["e2e"][i] == pytest.approx(c["e2e"], abs=1e-9)
    # the prefix cache was really used: later turns and shared system prompts hit it
    assert q["cached_tokens"].sum() > 0.3 * q["input_tokens"].sum()
    later = np.array(["-t0" not in rid for rid in q["id"]])
    assert (q["cached_tokens"][later] >= 48).all()
    # every session stuck to one replica or moved by the policy's rule; candidates cover all replicas
    assert (q["cand_count"] == 3).all()


def test_live_outputs_equal_unrouted(live_run):
    sessions, outputs, _, _ = live_run
    assert outputs == run_unrouted(sessions)


def test_live_router_view_matches_replica_caches(live_run):
    """The router's KV-event view predicts the replica's cache: predicted cached tokens = counted, at least for most requests."""
    _, _, cluster, _ = live_run
    pairs = list(cluster.predicted.values())
    agree = sum(p == c for p, c in pairs)
    assert all(c >= 0 for _, c in pairs)
    assert agree >= 0.75 * len(pairs), pairs
