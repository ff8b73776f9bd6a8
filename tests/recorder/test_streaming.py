"""Streaming: on_overflow="drop" under a throttled writer, compression options, id dtype sizing."""

from __future__ import annotations

import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest
import torch
from moetrace.exporters.catalog import METRICS

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.trace import TraceError, open_trace
from moetrace.trace.segments import SegmentWriter
from moetrace.trace.stream import HostBufferPool
from moetrace.trace.writer import compression_options, token_id_dtype
from tests.faults.recording import EXPERTS, LAYERS, TOKENS, feed, pass_ids
from tests.servers import SUBPROCESS_BOUND_S


def recorder(tmp_path, **changes) -> ExpertDistributionRecorder:
    config = dict(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=2, mode="per_token", output_dir=tmp_path, max_tokens_per_pass=TOKENS, stream_chunk_tokens=8 * TOKENS, segment_seconds=0)
    config.update(changes)
    return ExpertDistributionRecorder(RecorderConfig(**config))


@pytest.fixture
def held_until_a_drop(monkeypatch):
    """The writer thread writes nothing until the forward thread has found no free host buffer (a pass
    dropped), or 120 s passed: passes are dropped whatever the machine's speed (a fixed 40 ms writer delay
    raced the forward thread, which a loaded machine can slow below it). Returns the ``block`` argument of
    every buffer request the forward thread made."""
    original_write, original_acquire = SegmentWriter.write, HostBufferPool.acquire
    asked: list[bool] = []
    forward = threading.get_ident()
    dropped = threading.Event()

    def held_write(self, part):
        dropped.wait(timeout=120)
        return original_write(self, part)

    def acquire(self, block=True):
        got = original_acquire(self, block)
        if threading.get_ident() == forward:
            asked.append(block)
            if got is None:
                dropped.set()
        return got

    monkeypatch.setattr(SegmentWriter, "write", held_write)
    monkeypatch.setattr(HostBufferPool, "acquire", acquire)
    return asked


def token_rows(path):
    with open_trace(path) as trace:
        chunks = list(trace.iter_tokens())
        return (
            np.concatenate([c.pass_id for c in chunks]),
            np.concatenate([c.topk_ids for c in chunks]),
            trace.physical_count(),
            int(trace.dropped_passes().sum()),
            int(trace.num_passes().sum()),
        )


def test_drop_policy_drops_whole_passes_counts_them_and_never_waits(tmp_path, held_until_a_drop):
    rec = recorder(tmp_path, on_overflow="drop")
    rec.start_record()
    passes = 240
    for pass_id in range(passes):
        feed(rec, pass_id)
    assert held_until_a_drop and not any(held_until_a_drop), "the forward thread waited for a host buffer"
    dropped = rec.dropped_passes
    snapshot = rec.snapshot()
    rec.stop_record()
    pid, ids, counts, dropped_in_trace, passes_in_trace = token_rows(rec.dump_record(tmp_path / "t.h5"))
    present = np.unique(pid)
    missing = sorted(set(range(passes)) - set(present.tolist()))
    ranges = rec._sink.overflow.dropped_ranges
    assert dropped > 0 and len(missing) == dropped == dropped_in_trace == snapshot.dropped_passes
    assert missing == [p for first, last in ranges for p in range(first, last + 1)]
    assert passes_in_trace == passes - dropped
    # What is there is whole and exact; /stat counts exactly the passes that are there.
    np.testing.assert_array_equal(pid, np.repeat(present, TOKENS))
    expected = np.concatenate([pass_ids(p) for p in present])
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(counts, np.stack([np.bincount(expected[:, layer].ravel(), minlength=EXPERTS) for layer in range(LAYERS)]))
    # Prometheus (and OTel) read it from the snapshot.
    [spec] = [m for m in METRICS if m.prom_name == "moetrace_dropped_passes_total"]
    assert spec.value(snapshot) == dropped


@pytest.fixture
def held_writer(monkeypatch):
    """The writer thread writes nothing until the forward thread has had to wait for a host buffer
    (a non-blocking try found none free), or 120 s passed. So the pool runs dry whatever the
    machine's speed: a fixed writer delay raced the forward thread, and a loaded machine, slow
    to feed, never made it wait. Returns the event that says it waited."""
    original_write, original_acquire = SegmentWriter.write, HostBufferPool.acquire
    forward = threading.get_ident()
    waited = threading.Event()

    def held_write(self, part):
        waited.wait(timeout=120)
        return original_write(self, part)

    def acquire(self, block=True):
        if block and threading.get_ident() == forward:
            free = original_acquire(self, False)
            if free is not None:
                return free
            waited.set()
        return original_acquire(self, block)

    monkeypatch.setattr(SegmentWriter, "write", held_write)
    monkeypatch.setattr(HostBufferPool, "acquire", acquire)
    return waited


def test_block_policy_waits_for_the_writer_and_keeps_every_pass(tmp_path, held_writer):
    rec = recorder(tmp_path, on_overflow="block")
    rec.start_record()
    for pass_id in range(80):
        feed(rec, pass_id)
    assert held_writer.is_set(), "the forward thread never had to wait for a host buffer"
    rec.stop_record()
    pid, _, _, dropped, passes = token_rows(rec.dump_record(tmp_path / "t.h5"))
    assert rec.dropped_passes == 0 and dropped == 0 and passes == 80
    np.testing.assert_array_equal(np.unique(pid), np.arange(80))


@pytest.mark.parametrize(("spec", "code"), [("none", None), ("lzf", 32000), ("gzip:6", 1), ("zstd:3", 32015), ("blosc2", 32026)])
def test_compression_options_round_trip(tmp_path, spec, code):
    rec = recorder(tmp_path, compression=spec, segment_bytes=4096)  # several segments: the dump joins them
    rec.start_record()
    for pass_id in range(40):
        feed(rec, pass_id)
    path = rec.dump_record(tmp_path / "t.h5")
    _, ids, *_ = token_rows(path)
    np.testing.assert_array_equal(ids, np.concatenate([pass_ids(p) for p in range(40)]))
    with open_trace(path) as trace:
        plist = trace._file["tokens/topk_ids"].id.get_create_plist()
        codes = {plist.get_filter(i)[0] for i in range(plist.get_nfilters())} - {h5py.h5z.FILTER_FLETCHER32}  # the checksum, always there
    assert (code in codes) if code else not codes


def test_plugin_filters_need_hdf5plugin_with_clear_errors(tmp_path, monkeypatch):
    rec = recorder(tmp_path, compression="zstd")
    rec.start_record()
    feed(rec, 0)
    path = rec.dump_record(tmp_path / "t.h5")
    code = f"import sys; sys.modules['hdf5plugin'] = None\nfrom moetrace.trace import open_trace\nopen_trace({str(path)!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_BOUND_S)
    assert result.returncode != 0 and "install hdf5plugin" in result.stderr and "32015" in result.stderr
    monkeypatch.setitem(sys.modules, "hdf5plugin", None)
    with pytest.raises(ValueError, match="needs hdf5plugin"):
        compression_options("blosc2:5")
    with pytest.raises(ValueError, match="compression must be one of"):
        RecorderConfig(num_layers=1, num_physical_experts=4, top_k=1, compression="snappy")
    with pytest.raises(ValueError, match="level must be"):
        compression_options("gzip:12")
    assert isinstance(TraceError("x"), ValueError)


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.int8), (128, np.int8), (129, np.int16), (32768, np.int16), (40000, np.int32)])
def test_token_ids_are_sized_to_the_expert_count(tmp_path, experts, dtype):
    assert token_id_dtype(experts) == np.dtype(dtype)
    if experts > 200:
        return
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=1, num_physical_experts=experts, top_k=3, mode="per_token", output_dir=tmp_path, max_tokens_per_pass=4, stream_chunk_tokens=4))
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(0):
        rec.on_select_experts(torch.tensor([[experts - 1, -1, experts], [0, -5, 1]]))
    with open_trace(rec.dump_record(tmp_path / "t.h5")) as trace:
        [chunk] = list(trace.iter_tokens())
    assert chunk.topk_ids.dtype == np.dtype(dtype)
    assert chunk.topk_ids[:, 0].tolist() == [[experts - 1, -1, -2], [0, -2, 1]]
