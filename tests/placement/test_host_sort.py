"""``descending_order`` gives ``torch.sort(descending=True)``'s host order, equal loads included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace.placement import host_sort
from moetrace.placement.host_sort import descending_order


def _torch_order(values: np.ndarray) -> list[int]:
    return torch.from_numpy(np.ascontiguousarray(values)).sort(descending=True).indices.tolist()


def _cases(rng: np.random.Generator) -> list[np.ndarray]:
    cases = []
    for n in [*range(1, 80), 127, 128, 255, 256, 257, 1000, 3000]:
        cases.append(rng.integers(0, int(rng.integers(1, 6)), size=n).astype(np.float32))  # few distinct loads
        cases.append((rng.integers(0, 50, size=n) / 7).astype(np.float32))
        cases.append(np.zeros(n, dtype=np.float32))
        cases.append((np.arange(n) % 3).astype(np.float32))
        ramp = np.sort(rng.integers(0, n // 3 + 1, size=n)).astype(np.float32)
        cases.append(np.concatenate([ramp[::2], ramp[1::2]]))  # interleaved ramps: reach the heap sort
        cases.append(np.concatenate([ramp[::2], ramp[1::2]])[::-1].copy())
    return cases


def test_descending_order_is_torch_sorts_order(monkeypatch: pytest.MonkeyPatch) -> None:
    heap_sorts = []
    heap_sort = host_sort._heap_sort
    monkeypatch.setattr(host_sort, "_heap_sort", lambda *args: (heap_sorts.append(args[2] - args[1]), heap_sort(*args)))
    cases = _cases(np.random.default_rng(5))
    wrong = [len(v) for v in cases if descending_order(v) != _torch_order(v)]
    assert wrong == [], f"orders differ from torch.sort's for arrays of these lengths: {wrong}"
    assert heap_sorts, "no case reached the heap sort, so that path went unchecked"


def test_negative_control_a_stable_sort_is_not_torch_sorts_order() -> None:
    """The comparison above can fail: beyond 16 equal loads a stable sort's order is not torch's."""
    values = np.zeros(40, dtype=np.float32)
    assert np.argsort(-values, kind="stable").tolist() != _torch_order(values)
    assert descending_order(values) == _torch_order(values)
