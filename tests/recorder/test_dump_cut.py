"""A dump while recording is a cut at a pass boundary: exact on both sides, and the forward thread never waits for the join."""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.testing import assert_no_host_sync
from moetrace.trace import offload, open_trace

LAYERS, EXPERTS, TOP_K, TOKENS = 3, 16, 2, 8
WAIT_S = 60  # bound on every wait (never reached when the code is right)


def routing(pass_id: int) -> np.ndarray:
    """Pass ``pass_id``'s ids ``[T, L, k]``: distinct per token; ``pass_id % 3`` tokens of the pass are padding (-1)."""
    rng = np.random.default_rng(pass_id)
    ids = np.argsort(rng.random((TOKENS, LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K].astype(np.int64)
    ids[TOKENS - pass_id % 3 :] = -1
    return ids


def recorder(tmp_path: Path, mode: str, **config: object) -> ExpertDistributionRecorder:
    options = {"stream_chunk_passes": 4, "stream_chunk_tokens": 32, "segment_bytes": 4096, "segment_seconds": 0, "window": 64, **config}
    return ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path, max_tokens_per_pass=TOKENS, **options,  # type: ignore[arg-type]
    ))


def feed(rec: ExpertDistributionRecorder, passes: range) -> None:
    for pass_id in passes:
        ids = torch.as_tensor(routing(pass_id))
        with rec.with_forward_pass(pass_id):
            for layer in range(LAYERS):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(ids[:, layer])


def expected_totals(passes: range) -> np.ndarray:
    """``[L, P]`` counts of the fed passes, counted here independently of moetrace."""
    out = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    for pass_id in passes:
        ids = routing(pass_id)
        for layer in range(LAYERS):
            real = ids[:, layer][ids[:, layer] >= 0]
            out[layer] += np.bincount(real, minlength=EXPERTS)
    return out


def check_dump(path: Path, mode: str, passes: range) -> None:
    """The trace at ``path`` holds exactly ``passes`` as fed: totals, rows and (per_token) every id."""
    with open_trace(path) as trace:
        np.testing.assert_array_equal(trace.physical_count(), expected_totals(passes))
        tokens = sum(int((routing(i)[:, 0, 0] >= 0).sum()) for i in passes)
        assert int(trace.num_tokens().sum()) == tokens
        if mode == "stat":
            assert int(trace.num_passes().sum()) == len(passes)
            return
        assert int(trace.num_passes().sum()) == len(passes)
        if mode == "per_pass":
            chunks = list(trace.iter_passes())
            np.testing.assert_array_equal(np.concatenate([c.pass_id for c in chunks]), np.array(passes))
            counts = np.concatenate([c.physical_count for c in chunks])
            np.testing.assert_array_equal(counts.sum(axis=0), expected_totals(passes))
            np.testing.assert_array_equal(counts[-1], expected_totals(range(passes[-1], passes[-1] + 1)))
        else:
            chunks = list(trace.iter_tokens())
            ids = np.concatenate([c.topk_ids for c in chunks])
            pid = np.concatenate([c.pass_id for c in chunks])
            fed = [routing(i) for i in passes]
            np.testing.assert_array_equal(ids, np.concatenate([f[f[:, 0, 0] >= 0] for f in fed]))
            np.testing.assert_array_equal(pid, np.concatenate([np.full(int((f[:, 0, 0] >= 0).sum()), i) for i, f in zip(passes, fed, strict=True)]))


@pytest.mark.parametrize("child", [False, True])
@pytest.mark.parametrize("mode", ["per_token", "per_pass", "stat"])
def test_cut_while_recording_holds_what_came_before_and_the_next_dump_what_followed(tmp_path, mode, child, monkeypatch):
    """``child``: the dump's file is written in a child process (a streaming dump's join, a ``stat``
    dump's arrays), as a dump at DeepSeek-V3 size is."""
    if child:
        monkeypatch.setattr(offload, "CHILD_MIN_BYTES", 0)
    rec = recorder(tmp_path, mode)
    rec.start_record()
    feed(rec, range(0, 37))
    first = rec.dump_record(tmp_path / "first.h5")  # while recording: a cut after pass 36
    feed(rec, range(37, 90))
    rec.stop_record()
    second = rec.dump_record(tmp_path / "second.h5")
    if mode == "stat":  # stat dumps are cumulative
        check_dump(first, mode, range(0, 37))
        check_dump(second, mode, range(0, 90))
    else:  # nothing lost, nothing counted twice
        check_dump(first, mode, range(0, 37))
        check_dump(second, mode, range(37, 90))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["first.h5", "second.h5"]  # segments and journal consumed


class BlockedRenames:
    """Holds every dump's last step on the background dump thread until ``release`` (bounded): the
    rename into place of its file (a streaming dump's join or a ``stat`` file, written here or
    in a child process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        promote = offload.promote

        def blocked_rename(staging: Path, target: Path) -> Path:
            if threading.current_thread().name == "moetrace-dump":
                self.started.set()
                assert self.release.wait(WAIT_S), "the test never released the dump"
            return promote(staging, target)

        monkeypatch.setattr(offload, "promote", blocked_rename)


@pytest.mark.parametrize("mode", ["per_token", "per_pass", "stat"])
def test_passes_keep_ending_while_the_dump_is_blocked(tmp_path, mode, monkeypatch):
    blocked = BlockedRenames(monkeypatch)
    rec = recorder(tmp_path, mode, segment_bytes=1024)  # several segments before the cut: the dump joins them
    rec.start_record()
    feed(rec, range(0, 30))
    target = rec.dump_record(tmp_path / "cut.h5", wait=False)  # from the forward thread itself
    assert blocked.started.wait(WAIT_S)
    with assert_no_host_sync():  # every hook and pass end, while a dump is in flight
        feed(rec, range(30, 70))
    # 40 passes ended while the dump's rename was held: the forward thread never waited for it.
    assert rec.pending_dumps == 1 and not target.exists() and rec.num_passes == 70
    assert rec.status()["pending_dumps"] == [str(target)]
    blocked.release.set()
    rec.wait_dumps()
    assert rec.pending_dumps == 0 and rec.last_dump_path == target
    check_dump(target, mode, range(0, 30))
    rec.stop_record()
    rest = rec.dump_record(tmp_path / "rest.h5")
    check_dump(rest, mode, range(0, 70) if mode == "stat" else range(30, 70))


def test_a_failed_background_dump_loses_nothing_and_says_so(tmp_path, monkeypatch):
    rec = recorder(tmp_path, "per_token", segment_bytes=1024)  # several segments: the dump joins them
    rec.start_record()
    feed(rec, range(0, 25))
    promote = offload.promote

    def failing(staging: Path, target: Path) -> Path:  # the join (in a child) succeeded; its rename fails
        staging.unlink()
        raise OSError("disk full (test)")

    monkeypatch.setattr(offload, "promote", failing)
    target = rec.dump_record(tmp_path / "lost.h5", wait=False)
    with pytest.raises(OSError, match="disk full"):
        rec.wait_dumps()
    assert not target.exists() and any("lost.h5 failed" in e for e in rec.status()["errors"])
    assert rec.undumped_passes == 25
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # neither the child's temporary nor the joined file is left
    monkeypatch.setattr(offload, "promote", promote)
    feed(rec, range(25, 40))
    rec.stop_record()
    check_dump(rec.dump_record(tmp_path / "retry.h5"), "per_token", range(0, 40))


def test_dumps_join_chunks_without_decoding_where_segments_line_up(tmp_path):
    """per_pass segments end on the counts' chunk grid (time rotations wait for it), so the join
    copies their stored chunks: the dump's chunks are byte for byte the segments'."""
    layers, slots = 8, 4096  # 128 KiB count rows: 8-row chunks
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=layers, num_physical_experts=slots, top_k=TOP_K, mode="per_pass", output_dir=tmp_path,
                                                    max_tokens_per_pass=TOKENS, stream_chunk_passes=8, segment_bytes=1, segment_seconds=0))
    rec.start_record()
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, slots, (40, TOKENS, TOP_K)))
    for pass_id in range(40):  # every hand-off of 8 passes closes a segment (segment_bytes=1)
        with rec.with_forward_pass(pass_id):
            for layer in range(layers):
                rec.on_select_experts(ids[pass_id], layer=layer)
    rec._files.session.writer.drain()
    segments = sorted(tmp_path.glob(".moetrace-*-seg*.h5"))
    assert len(segments) == 5

    def chunks(path: Path) -> list[bytes]:
        with h5py.File(path, "r") as f:
            ds = f["passes/physical_count"]
            assert ds.chunks[0] == 8
            return [ds.id.read_direct_chunk((at, 0, 0))[1] for at in range(0, ds.shape[0], ds.chunks[0])]

    stored = [c for path in segments for c in chunks(path)]
    rec.stop_record()
    out = rec.dump_record(tmp_path / "joined.h5")
    assert chunks(out) == stored
    with open_trace(out) as trace:
        counts = np.concatenate([c.physical_count for c in trace.iter_passes()])
    expected = np.stack([np.bincount(ids[i].numpy().ravel(), minlength=slots) for i in range(40)])
    np.testing.assert_array_equal(counts, np.repeat(expected[:, None], layers, axis=1))


def test_stat_window_is_copied_on_write_while_passes_overwrite_it(tmp_path, monkeypatch):
    """A stat dump copies the window a batch per lock hold (so a pass end waits for one batch, not
    the whole ring); passes that end meanwhile overwrite slots it has not copied yet, and each such
    pass end copies its slot first: the dump's window is the one at the cut, pass by pass."""
    import moetrace.recording.dump_cuts as dumper_module
    from moetrace.recording.window import StatWindow

    window = 16
    rec = recorder(tmp_path, "stat", window=window)
    monkeypatch.setattr(dumper_module, "WINDOW_BATCH_BYTES", 1)  # one slot per batch
    first_batch, release = threading.Event(), threading.Event()
    copy_cut = StatWindow.copy_cut
    batches: list[np.ndarray] = []

    def counted(self: StatWindow, cut: object, slots: np.ndarray) -> None:
        copy_cut(self, cut, slots)
        batches.append(slots.copy())

    class HeldLock:
        """The recorder's lock as its dumper takes it; the dump's thread waits before taking it again after its first batch (outside the lock)."""

        def __init__(self, lock: threading.RLock) -> None:
            self._lock = lock

        def __enter__(self) -> None:
            if threading.current_thread().name == "test-dump" and len(batches) == 1 and not release.is_set():
                first_batch.set()
                assert release.wait(WAIT_S), "the test never released the copy"
            self._lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self._lock.release()

    monkeypatch.setattr(StatWindow, "copy_cut", counted)
    rec._dumper._lock = HeldLock(rec._dumper._lock)  # type: ignore[attr-defined]
    rec.start_record()
    feed(rec, range(0, 40))  # the ring wrapped: its slots hold passes 24..39
    done: dict[str, Path] = {}
    thread = threading.Thread(target=lambda: done.setdefault("path", rec.dump_record(tmp_path / "cut.h5")), name="test-dump")
    thread.start()
    try:
        assert first_batch.wait(WAIT_S)
        with assert_no_host_sync():
            feed(rec, range(40, 40 + window - 2))  # overwrite every slot but the two newest, all but one not copied yet
    finally:
        release.set()
        thread.join(WAIT_S)
    assert len(batches) == window  # every slot was offered to the copy, one batch each
    with open_trace(done["path"]) as trace:
        got = trace.window()
        np.testing.assert_array_equal(got.pass_id[0], np.arange(24, 40))
        for row, pass_id in enumerate(range(24, 40)):
            np.testing.assert_array_equal(got.physical_count[0, row], expected_totals(range(pass_id, pass_id + 1)))
        assert int(trace.num_passes().sum()) == 40  # the totals at the cut
        np.testing.assert_array_equal(trace.physical_count(), expected_totals(range(0, 40)))
    assert rec._sink._cuts == []  # the copy on write ended with the dump
    rec.stop_record()
    check_dump(rec.dump_record(tmp_path / "after.h5"), "stat", range(0, 40 + window - 2))
