"""Hand-offs through shared memory (issue 50): the rows stay where the engine staged them.

On a CPU device a recording's host buffers (a stream's staged rows, a checkpoint's window) live in
shared memory that the writer process maps (:mod:`moetrace.trace.shared_memory`), so a hand-off
sends the writer process only where its arrays lie. Checked here:

* the references themselves: an array wholly in a shared buffer crosses as one, read-only over the
  same pages; anything else (a private array, reversed strides) crosses as bytes;
* a real recording's pipe carries none of the rows it hands off (``per_token``'s ids and its
  tokens' other ``/tokens`` columns, ``stat``'s window), against the negative control, sharing
  turned off, whose pipe carries them all; both traces equal to the ids fed;
* a writer process that cannot map the engine's buffers (its probe fails) gets the bytes, and the
  trace is still exact;
* a process forked after buffers were made writes into private memory, not its parent's, and has
  closed its copy of the buffer's file; the negative control, a buffer the fork hook does not know, shows that the parent would see it;
* a buffer that was garbage, not yet collected, at the fork is not freed while the forked child
  copies it (negative control: with the collector on during the fork hook, it is);
* a buffer that the collector frees while another is being made (its finalizer runs inside that
  code) does not deadlock.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import weakref

import numpy as np
import pytest
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import open_trace, shared_memory, writer_process
from moetrace.trace.shared_memory import SharedBuffer, SharedMaps, dumps_sharing, reference

pytestmark = pytest.mark.skipif(not shared_memory.sharing_available(), reason="no memfd: nothing is shared here")

LAYERS, EXPERTS, TOP_K, TOKENS = 16, 130, 8, 256  # int16 ids: 256 bytes of ids per row
CHUNK_TOKENS = 8192  # 32 passes per hand-off
WINDOW, PERIOD, PASSES = 32, 32, 80


def routing(pass_id: int) -> np.ndarray:
    """Pass ``pass_id``'s ids ``[TOKENS, L, k]`` (distinct per token and layer)."""
    rng = np.random.default_rng((7, pass_id))
    return np.argsort(rng.random((TOKENS, LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K].astype(np.int64)


def record(mode: str, tmp_path) -> tuple[str, np.ndarray]:
    """``PASSES`` passes of :func:`routing` recorded and dumped; ``(trace path, ids fed [N, T, L, k])``."""
    config = RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path / "out",
                            max_tokens_per_pass=TOKENS, stream_chunk_tokens=CHUNK_TOKENS, window=WINDOW, segment_passes=PERIOD)
    rec = ExpertDistributionRecorder(config)
    rec.start_record()
    fed = []
    for pass_id in range(PASSES):
        ids = routing(pass_id)
        fed.append(ids)
        with rec.with_forward_pass(pass_id):
            for layer in range(LAYERS):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.as_tensor(ids[:, layer]))
    rec.stop_record()
    return str(rec.dump_record(tmp_path / f"{mode}.h5")), np.stack(fed)


class CountingStream:
    """Forwards writes to a pipe and counts their bytes."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.stream, self.bytes = stream, 0

    def write(self, data) -> int:  # type: ignore[no-untyped-def]
        self.bytes += memoryview(data).nbytes
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()


@pytest.fixture
def piped(monkeypatch) -> list[int]:
    """Bytes of every hand-off sent to a writer process (a sink's ``write`` of rows), in order."""
    sent: list[int] = []
    send = writer_process.send

    def counted(stream, message, share=False):  # type: ignore[no-untyped-def]
        counter = CountingStream(stream)
        send(counter, message, share)
        target, name, args, _ = message if isinstance(message, tuple) and len(message) == 4 else (None, None, None, None)
        if (target, name) == ("sink", "write") and args and args[0] is not None:
            sent.append(counter.bytes)

    monkeypatch.setattr(writer_process, "send", counted)
    return sent


def test_an_array_in_a_shared_buffer_crosses_as_a_reference_and_anything_else_as_bytes():
    shared = SharedBuffer(4096)
    rows = np.frombuffer(shared.map, dtype=np.int16).reshape(64, 32)
    rows[:] = np.arange(rows.size, dtype=np.int16).reshape(rows.shape)
    private = np.arange(10)
    message = {"rows": rows[3:40], "column": rows[:, 5], "private": private, "reversed": rows[::-1]}
    assert reference(message["rows"]) is not None and reference(message["column"]) is not None
    assert reference(private) is None and reference(message["reversed"]) is None and reference(rows[:0]) is None

    def pickled(what: dict[str, np.ndarray]) -> tuple[bytes, list[pickle.PickleBuffer]]:
        buffers: list[pickle.PickleBuffer] = []
        return dumps_sharing(what, buffers.append), buffers

    def size(head: bytes, buffers: list[pickle.PickleBuffer]) -> int:
        return len(head) + sum(b.raw().nbytes for b in buffers)

    head, buffers = pickled(message)
    bytes_only = size(*pickled({"private": private, "reversed": message["reversed"]}))
    assert bytes_only > private.nbytes + rows.nbytes  # those two cross as bytes
    assert size(head, buffers) - bytes_only < 512  # the two shared ones add their places only
    back = SharedMaps().loads(head, [bytearray(b.raw()) for b in buffers])
    for name, array in message.items():
        np.testing.assert_array_equal(back[name], array)
    assert not back["rows"].flags.writeable  # the child reads the engine's memory, never writes it
    rows[3, 0] = -7  # the same pages: what the engine writes, the mapping sees
    assert back["rows"][0, 0] == -7


@pytest.mark.parametrize("mode", ["per_token", "stat"])
def test_the_rows_handed_off_stay_out_of_the_pipe(tmp_path, monkeypatch, piped, mode):
    shared_path, fed = record(mode, tmp_path / "shared")
    shared = list(piped)
    piped.clear()
    monkeypatch.setattr(writer_process, "sharing_available", lambda: False)  # the negative control: every row through the pipe
    private_path, _ = record(mode, tmp_path / "private")
    private = list(piped)
    # Per hand-off, the rows it hands: per_token's ids (int16) and each token's other /tokens
    # columns (pass id, int64; position, request and request position, int32; pass phase, int8:
    # 21 bytes), every hand-off alike in both runs (the block policy drops none); or stat's window
    # [W, L, P] (int32) at each checkpoint. Averaged per hand-off: a loaded machine may skip a stat
    # checkpoint (its writer still busy) in either run.
    tokens = fed.shape[0] * TOKENS
    handed = (fed.size * 2 + tokens * 21) / len(shared) if mode == "per_token" else WINDOW * LAYERS * EXPERTS * 4
    per_shared, per_private = sum(shared) / len(shared), sum(private) / len(private)
    references = 200  # what a hand-off's references themselves take, at most
    assert per_private - per_shared >= handed - references, f"pipe per hand-off: {per_shared:.0f} bytes shared, {per_private:.0f} not, for {handed:.0f} bytes of rows"
    counts = np.stack([np.bincount(fed[:, :, layer].ravel(), minlength=EXPERTS) for layer in range(LAYERS)])
    for path in (shared_path, private_path):
        with open_trace(path) as trace:
            np.testing.assert_array_equal(trace.physical_count(), counts)
            if mode == "per_token":
                np.testing.assert_array_equal(np.concatenate([c.topk_ids for c in trace.iter_tokens()]), fed.reshape(-1, LAYERS, TOP_K))


def test_a_writer_that_cannot_map_the_buffers_gets_the_bytes(tmp_path, monkeypatch, piped):
    class Unreachable(SharedBuffer):
        """A probe buffer whose key names no file (as when ``/proc/<pid>/fd`` is closed to the child)."""

        def __init__(self, nbytes: int) -> None:
            super().__init__(nbytes)
            self.key = (self.key[0], 10**6, self.key[2])

    monkeypatch.setattr(writer_process, "SharedBuffer", Unreachable)
    path, fed = record("per_token", tmp_path)
    assert sum(piped) > fed.size * 2
    with open_trace(path) as trace:
        np.testing.assert_array_equal(np.concatenate([c.topk_ids for c in trace.iter_tokens()]), fed.reshape(-1, LAYERS, TOP_K))


@pytest.mark.parametrize("known", [True, False])
def test_a_forked_process_writes_private_memory(known):
    shared = SharedBuffer(1 << 20)
    pages = np.frombuffer(shared.map, dtype=np.uint8)
    pages[:] = 1
    if not known:  # the negative control: the fork hook does not know this buffer
        shared_memory._live.remove(shared.key[2])
    pid = os.fork()
    if pid == 0:  # the child: write every page, then leave without running the parent's cleanup
        pages[:] = 2
        try:
            os.fstat(shared.key[1])
            inherited_file_open = True
        except OSError:
            inherited_file_open = False
        os._exit(0 if pages.min() == 2 and inherited_file_open is not known else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bool((pages == 1).all()) is known, "the child's writes reached the parent's memory" if known else "the control saw no sharing"


@pytest.mark.parametrize("collector_off", [True, False], ids=["collector-off", "negative-control-collector-on"])
def test_a_buffer_garbage_at_the_fork_is_not_freed_while_the_child_copies_it(monkeypatch, collector_off):
    """A buffer in a reference cycle that was garbage but not yet collected at the fork is live in
    the child too; a collection there, set off by the fork hook's own allocations, would free it
    and unmap its pages before the hook copies them (a full-suite run's child died of SIGSEGV so).
    Here every allocation after the hook takes the registry sets one off, and the child leaves
    with 3 where the hook would copy the buffer after it was freed: it does with the collector on
    during the hook (the negative control)."""
    if not collector_off:
        monkeypatch.setattr(shared_memory.gc, "disable", lambda: None)
    take_all, memmove = shared_memory._Registry.take_all, shared_memory.ctypes.memmove

    def take_all_then_collect_often(self):  # type: ignore[no-untyped-def]
        spans = take_all(self)
        gc.set_threshold(1)
        return spans

    monkeypatch.setattr(shared_memory._Registry, "take_all", take_all_then_collect_often)
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10**9)  # nothing collected in this process until the fork
    try:
        buffer = SharedBuffer(1 << 22)
        [address] = [first for first, _, key in shared_memory._live.spans() if key == buffer.key]
        alive = weakref.ref(buffer)

        def memmove_unless_freed(dst, src, count):  # type: ignore[no-untyped-def]
            if src == address and alive() is None:
                os._exit(3)  # about to read the pages of a buffer the collector freed
            return memmove(dst, src, count)

        monkeypatch.setattr(shared_memory.ctypes, "memmove", memmove_unless_freed)
        garbage: list[object] = [buffer]
        garbage.append(garbage)
        del buffer, garbage
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
    assert os.waitstatus_to_exitcode(status) == (0 if collector_off else 3)


class CollectingDict(dict):
    """A registry's storage that runs the collector as an entry goes in (as it may at any
    allocation there)."""

    def __setitem__(self, key, value) -> None:  # type: ignore[no-untyped-def]
        gc.collect()
        super().__setitem__(key, value)


def test_a_buffer_freed_by_the_collector_while_another_registers_does_not_deadlock():
    registry = shared_memory._live
    gc.collect()
    gc.disable()  # no finalizer between the copy and the swap
    registry._spans = collecting = CollectingDict(registry._spans)
    gc.enable()
    try:
        freed = SharedBuffer(4096)
        key = freed.key
        cycle: list[object] = [freed]
        del freed
        cycle.append(cycle)  # only the collector frees it: its finalizer runs inside the next buffer's registration
        del cycle
        made: list[SharedBuffer] = []
        thread = threading.Thread(target=lambda: made.append(SharedBuffer(4096)), daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "registering a shared buffer deadlocked with another one's finalizer"
    finally:
        registry._spans = dict(collecting)  # what was added and removed meanwhile stays
    live = [span[2] for span in registry.spans()]
    assert key not in live and made[0].key in live
    assert reference(np.frombuffer(made[0].map, dtype=np.uint8)) is not None
