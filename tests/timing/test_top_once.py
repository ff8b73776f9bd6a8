"""``moetrace top --once`` against a real control endpoint on loopback: metrics, token, errors."""

from __future__ import annotations

import time

import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.control import serve_control
from moetrace.reference import free_port


def test_one_frame_from_a_protected_control_endpoint(tmp_path, monkeypatch):
    monkeypatch.delenv("MOETRACE_CONTROL_TOKEN", raising=False)
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=4, top_k=2, ep_size=2, timing=True, output_dir=tmp_path))
    rec.start_record()
    for _ in range(3):
        with rec.with_forward_pass():
            for layer in range(2):
                with rec.with_current_layer(layer), rec.with_phase("expert"):
                    rec.on_select_experts(torch.tensor([[0, 1], [2, 3], [3, 2]]))
                    time.sleep(0.002)
    runner = CliRunner()
    with serve_control(rec, token="s3cret", per_ep_rank=True) as server:
        refused = runner.invoke(app, ["top", "--url", server.url, "--once"])
        frame = runner.invoke(app, ["top", "--url", server.url, "--url", f"http://127.0.0.1:{free_port()}", "--once", "--token", "s3cret"])
    assert refused.exit_code == 0 and "ERROR (HTTP 401 Unauthorized; pass --token)" in refused.output
    assert frame.exit_code == 0, frame.output
    out = frame.output
    assert "rank 0 [TP1 EP2 tp0 ep0]: recording, 3 passes" in out and "GONE" in out
    assert "tokens served: 9" in out
    assert "balancedness over 2 EP ranks: 0.750" in out  # per pass and layer: rank 0 gets 2 copies, rank 1 gets 4
    assert "expert" in out and "hottest experts: endpoints export no per-expert series" in out
