"""The capturer and the recorder resolve "cuda" to the current device's index (checked on CPU)."""

from __future__ import annotations

import pytest
import torch

from moetrace.capturer import RoutedExpertsCapturer
from moetrace.devices import resolve_device
from moetrace.wire import CaptureError


def test_cuda_without_index_resolves_to_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda:3")
    # what a real tensor on the current device reports compares equal only after resolving
    assert torch.device("cuda:3") != torch.device("cuda") and torch.device("cuda:3") == resolve_device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("cpu") == torch.device("cpu")


def test_capturer_compares_against_the_resolved_device(monkeypatch):
    calls = []

    def resolve(device):
        calls.append(torch.device(device))
        return torch.device("cpu")

    monkeypatch.setattr("moetrace.capturer.resolve_device", resolve)
    capturer = RoutedExpertsCapturer(2, 2, 4, 8, device="cuda")
    assert calls == [torch.device("cuda")] and capturer.device == torch.device("cpu")
    capturer.capture(0, torch.zeros((1, 2), dtype=torch.int64))  # accepted: the tensor is on the resolved device
    with pytest.raises(CaptureError, match="meta"):
        capturer.capture(0, torch.zeros((1, 2), dtype=torch.int64, device="meta"))
