"""analyze_trace streams: it finishes under an address-space cap smaller than the trace's data."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from moetrace.trace import TraceHeader, TraceWriter

TOKENS = 4 * 2**20  # 4Mi tokens x 4 layers x top-2 int16 = 64 MiB of ids (+ 48 MiB pass ids/positions)
LAYERS, TOP_K, EXPERTS = 4, 2, 16
HEADROOM = 40 * 2**20  # address space allowed beyond what the imports already mapped


def write_big_trace(path) -> np.ndarray:
    header = TraceHeader(mode="per_token", id_space="logical", num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=4, layer_ids=np.arange(LAYERS), physical_to_logical=np.tile(np.arange(EXPERTS), (LAYERS, 1)))
    writer = TraceWriter(path, header)
    block = 2**20
    pattern = (np.arange(block * LAYERS * TOP_K) * 7 // 5 % EXPERTS).astype(np.int16).reshape(block, LAYERS, TOP_K)
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    for start in range(0, TOKENS, block):
        writer.append("tokens/topk_ids", pattern)
        writer.append("tokens/pass_id", np.arange(start, start + block, dtype=np.int64) // 1024)
        writer.append("tokens/position", np.arange(block, dtype=np.int32) % 1024)
        for layer in range(LAYERS):
            counts[layer] += np.bincount(pattern[:, layer].ravel(), minlength=EXPERTS)
    writer.write("stat/physical_count", counts[None])
    writer.write("stat/logical_count", counts[None])
    for name, shape in (("invalid_ids", (1, LAYERS)), ("dropped", (1, LAYERS)), ("send_count", (1, LAYERS, 4)), ("recv_count", (1, LAYERS, 4))):
        writer.write(f"stat/{name}", np.zeros(shape, np.int64))
    writer.write("stat/num_passes", np.array([TOKENS // 1024]))
    writer.write("stat/num_tokens", np.array([TOKENS]))
    writer.commit()
    return counts


CAPPED = textwrap.dedent(
    """
    import json, resource, sys
    import h5py, numpy as np
    from moetrace.analysis import analyze_trace
    import moetrace.analysis.summary, moetrace.analysis.coactivation, moetrace.analysis.drift  # noqa: F401
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    limit = vm + int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    report = analyze_trace(sys.argv[1], window=2048)
    try:
        with h5py.File(sys.argv[1], "r") as f:
            f["tokens/topk_ids"][()]
        loaded_at_once = True
    except MemoryError:
        loaded_at_once = False
    print(json.dumps({"counts": report.logical_count.tolist(), "pairs": report.coactivation.coactivation.sum(axis=(1, 2)).tolist(), "windows": len(report.drift), "loaded_at_once": loaded_at_once}))
    """
)


@pytest.mark.slow
def test_analysis_fits_under_a_memory_cap(tmp_path):
    path = tmp_path / "big.h5"
    counts = write_big_trace(path)
    run = subprocess.run([sys.executable, "-c", CAPPED, str(path), str(HEADROOM)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    # Loading the ids at once does not fit under the cap; the streaming analysis did, exactly.
    assert out["loaded_at_once"] is False
    np.testing.assert_array_equal(out["counts"], counts)
    assert out["windows"] == TOKENS // 1024 // 2048
    assert all(p > 0 for p in out["pairs"])
