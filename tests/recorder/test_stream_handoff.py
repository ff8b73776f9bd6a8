"""The streaming modes' hand-off on both of its paths (issue 50).

On a CPU device a stream stages its rows in a host buffer of its pool and hands that buffer itself
to the writer, staging on in a free one: the forward thread copies no rows. On CUDA it stages on
the device and copies into a free host buffer. Both paths run here, the CUDA one forced on this CPU
(``stages_in_host_buffers`` answering ``False``), so both are checked against the ids fed while the
three buffers cycle many times through the writer, and the buffers the writer gives back are, in
order, those it was handed (a writer quicker than the forward thread hides a mix-up from the ids). A
``TorchDispatchMode`` around each hand-off sees what it copies: no staged rows on the swap path, one
copy of them per hand-off on the copy path (the negative control).

``per_token`` keeps only the rows that are tokens, which the pass end marks beside the rows (the
writer no longer scans the chunk's ids): passes with padding rows, rows that are -1 in some layers
only, and a layer given fewer rows keep exactly the rows an independent numpy filter keeps, on
both paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrace.recording import streams
from moetrace.recording.streams import RowStream
from moetrace.trace import open_trace
from moetrace.trace.stream import HostBufferPool
from tests.faults.recording import EXPERTS, LAYERS, TOKENS, feed, make_recorder, pass_ids

PASSES = 100  # 12 hand-offs of 8 passes (and one of 4 at stop): each buffer goes round 4 times or more


class RowCopies(TorchDispatchMode):
    """Counts the ``copy_`` ops whose source is staged rows: ``staging``'s dtype and row shape."""

    def __init__(self, staging: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.row = staging.dtype, staging.shape[1:]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.copy_.default:
            source = args[1]
            self.count += int(source.dtype == self.dtype and source.shape[1:] == self.row)
        return func(*args, **(kwargs or {}))


class HandOffs:
    """What the fixture saw: copies of staged rows in hand-offs, and the rows buffers (``data_ptr``)
    handed to the writer and given back to the pool, each in order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.row_copies = 0
        self.handed: list[int] = []
        self.released: list[int] = []


@pytest.fixture
def hand_offs(monkeypatch, request) -> HandOffs:
    """Runs every hand-off under :class:`RowCopies` and notes the rows buffers handed and released;
    the staging path is the test's parameter (``swap``: the CPU's own; ``copy``: CUDA's, forced)."""
    if request.param == "copy":
        monkeypatch.setattr(streams, "stages_in_host_buffers", lambda device: False)
    seen, pools = HandOffs(request.param), set()
    flush, rows_into, release = RowStream.flush, RowStream._rows_into, HostBufferPool.release

    def counted_flush(self, rotate=False, wait=False):
        with RowCopies(self.staging) as copies:
            flush(self, rotate, wait)
        seen.row_copies += copies.count

    def noted_rows_into(self, free):
        pools.add(id(self.pool))
        host = rows_into(self, free)
        seen.handed.append(host.data_ptr())
        return host

    def noted_release(self, buffer):
        if id(self) in pools:
            seen.released.append(buffer.data_ptr())
        release(self, buffer)

    monkeypatch.setattr(RowStream, "flush", counted_flush)
    monkeypatch.setattr(RowStream, "_rows_into", noted_rows_into)
    monkeypatch.setattr(HostBufferPool, "release", noted_release)
    return seen


@pytest.mark.parametrize("hand_offs", ["swap", "copy"], indirect=True)
@pytest.mark.parametrize("mode", ["per_pass", "per_token"])
def test_both_hand_off_paths_keep_every_id_fed_and_only_the_copy_path_copies_rows(tmp_path, mode, hand_offs):
    rec = make_recorder(mode, tmp_path, segment_seconds=0)
    assert rec._sink.swaps is (hand_offs.path == "swap")
    rec.start_record()
    for pass_id in range(PASSES):
        feed(rec, pass_id)
    rec.stop_record()
    dumped = rec.dump_record(tmp_path / "t.h5")  # the writer has written every hand-off
    handed = len(hand_offs.handed)
    assert handed >= PASSES // 8 and len(set(hand_offs.handed)) == (3 if rec._sink.swaps else 2)
    assert hand_offs.released == hand_offs.handed, "the writer gave back buffers other than those it was handed"
    expected = 0 if rec._sink.swaps else handed
    assert hand_offs.row_copies == expected, f"{hand_offs.path}: {hand_offs.row_copies} copies of staged rows in {handed} hand-offs"

    fed = np.stack([pass_ids(p) for p in range(PASSES)])  # [N, T, L, k]
    with open_trace(dumped) as trace:
        if mode == "per_token":
            chunks = list(trace.iter_tokens())
            np.testing.assert_array_equal(np.concatenate([c.pass_id for c in chunks]), np.repeat(np.arange(PASSES), TOKENS))
            np.testing.assert_array_equal(np.concatenate([c.topk_ids for c in chunks]), fed.reshape(PASSES * TOKENS, LAYERS, -1))
        else:
            chunks = list(trace.iter_passes())
            np.testing.assert_array_equal(np.concatenate([c.pass_id for c in chunks]), np.arange(PASSES))
            np.testing.assert_array_equal(np.concatenate([c.physical_count for c in chunks]), np.stack([counts(ids) for ids in fed]))
        np.testing.assert_array_equal(trace.physical_count(), counts(fed))


def padded_pass(pass_id: int) -> tuple[np.ndarray, int]:
    """Pass ``pass_id``'s ids ``[TOKENS, L, k]`` with rows that are no tokens and rows that are, and
    the rows its last layer is given (fewer in two passes of three; the rest read as -1 there)."""
    rng = np.random.default_rng((50, pass_id))
    ids = pass_ids(pass_id).copy()
    ids[rng.random(TOKENS) < 0.3] = -1  # padding rows of a static batch: -1 in every layer
    ids[rng.random(TOKENS) < 0.3, 0] = -1  # -1 in the first layer only: still tokens
    ids[1, :, 0] = -1  # a row mixing -1 with ids in every layer
    last_rows = TOKENS - pass_id % 3
    ids[last_rows:, LAYERS - 1] = -1
    return ids, last_rows


@pytest.mark.parametrize("hand_offs", ["swap", "copy"], indirect=True)
def test_per_token_keeps_exactly_the_rows_that_are_tokens(tmp_path, hand_offs):
    rec = make_recorder("per_token", tmp_path, segment_seconds=0)
    rec.start_record()
    fed = []
    for pass_id in range(PASSES):
        ids, last_rows = padded_pass(pass_id)
        fed.append(ids)
        with rec.with_forward_pass(pass_id):
            for layer in range(LAYERS):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.as_tensor(ids[: last_rows if layer == LAYERS - 1 else TOKENS, layer]))
    rec.stop_record()
    dumped = rec.dump_record(tmp_path / "t.h5")
    assert len(hand_offs.handed) >= PASSES // 8

    stacked = np.stack(fed)  # [N, T, L, k]
    tokens = (stacked != -1).any(axis=(2, 3))  # [N, T]: the independent filter
    assert 0 < tokens.sum() < tokens.size  # padding rows were fed, and tokens
    pass_of, position = np.nonzero(tokens)
    with open_trace(dumped) as trace:
        chunks = list(trace.iter_tokens())
        np.testing.assert_array_equal(np.concatenate([c.pass_id for c in chunks]), pass_of)
        np.testing.assert_array_equal(np.concatenate([c.position for c in chunks]), position)
        np.testing.assert_array_equal(np.concatenate([c.topk_ids for c in chunks]), stacked[tokens])
        assert int(trace.num_tokens().sum()) == tokens.sum()


def counts(ids: np.ndarray) -> np.ndarray:
    """``[L, P]`` counts of ``ids [..., L, k]`` by layer, by numpy."""
    return np.stack([np.bincount(ids[..., layer, :].ravel(), minlength=EXPERTS) for layer in range(LAYERS)])
