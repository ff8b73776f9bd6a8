"""Issue 35, "hot path unchanged": every hook of the recorder, in every mode, with request rows on, under
``assert_no_host_sync()``; and a negative control per hook that proves each one ran inside the guard.

``test_hot_path.py`` runs ``with_forward_pass(batch=)``, ``with_current_layer``, ``on_select_experts`` and
``on_dispatch`` with a batch in every mode. Here the rest of the hot path runs too, with the batch on:
``set_batch`` inside the pass (SGLang's gathered-input path), ``current_batch``, ``set_pass_phase``
outside and inside a pass, ``with_phase`` (timed and untimed), ``disable_this_region``, the hooks with
``layer=``, idle passes, padding rows, a pass whose body raises (discarded), with ``timing`` off and on,
over enough passes to wrap the window and hand chunks and timing rows to the writer. ``HOT_PATH`` names
every hook; a test fails if the recorder grows a public method that is in neither list.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from moetrace import PHASES, ExpertDistributionRecorder, RecorderConfig
from moetrace.batch import PassBatch
from moetrace.testing import HostSyncError, assert_no_host_sync
from moetrace.trace import open_trace

LAYERS, EXPERTS, TOP_K, EP, ROWS = 3, 16, 4, 2, 32
PASSES = 12  # window 4, chunks of 3 passes / 64 tokens: the window wraps and chunks go to the writer

#: what an engine calls while it runs passes (the hot path)
HOT_PATH = ("with_forward_pass", "set_batch", "current_batch", "set_pass_phase", "with_current_layer", "with_phase",
            "disable_this_region", "on_select_experts", "on_dispatch")
#: the rest of the public surface: lifecycle, dumps, reads (never inside a forward pass)
OFF_PATH = ("start_record", "stop_record", "reset", "dump_record", "wait_dumps", "pending_dumps", "last_dump_path", "snapshot", "status",
            "recording", "mode", "run_id", "num_passes", "dropped_passes", "undumped_passes", "id_space")


def test_every_public_name_is_placed():
    public = {n for n in dir(ExpertDistributionRecorder) if not n.startswith("_")}
    assert public == set(HOT_PATH) | set(OFF_PATH), "a new public recorder name: say whether it is on the hot path"


def make(tmp_path, mode: str, timing: bool, cls: type = ExpertDistributionRecorder) -> ExpertDistributionRecorder:
    return cls(RecorderConfig(num_layers=LAYERS, num_physical_experts=EXPERTS, top_k=TOP_K, ep_size=EP, mode=mode, output_dir=tmp_path,
                              window=4, stream_chunk_passes=3, stream_chunk_tokens=64, max_tokens_per_pass=ROWS, timing=timing))


def batches() -> list[PassBatch | None]:
    """The engine's batches (host arrays), one per pass: prefill, decode, mixed with padding rows, idle, none."""
    out: list[PassBatch | None] = []
    for step in range(PASSES):
        kind = step % 4
        if kind == 0:  # chunked prefill of two requests; rows 30-31 belong to none
            out.append(PassBatch.of([f"p{step}", f"q{step}"], [0, 16], [14, 16], prefill=True, num_rows=ROWS))
        elif kind == 1:  # decode of 3 long-running requests, rows not packed from 0
            out.append(PassBatch.of(["a", "b", "c"], [step, step + 5, 40], [1, 1, 1], prefill=False, row=[4, 9, 20], num_rows=ROWS))
        elif kind == 2:  # mixed: a prefill chunk beside two decodes
            out.append(PassBatch.of(["a", f"n{step}", "b"], [step, 0, step + 5], [1, 29, 1], prefill=[False, True, False], num_rows=ROWS))
        else:
            out.append(PassBatch.idle(ROWS) if step % 8 == 3 else None)  # a DP-attention dummy pass; a pass with no batch
    return out


def run_passes(rec: ExpertDistributionRecorder, plan: list[PassBatch | None], ids: torch.Tensor, send: torch.Tensor) -> int:
    """Every hot-path hook, pass after pass, as adapters call them. Returns the passes that ended (not discarded)."""
    ended = 0
    for step, batch in enumerate(plan):
        rec.set_pass_phase("decode", num_requests=3)  # before the pass: names the next one (a batch wins over it)
        given_late = step % 3 == 1  # SGLang's gathered input: the batch is known only inside the pass
        with contextlib.suppress(RuntimeError), rec.with_forward_pass(batch=None if given_late else batch):
            if given_late:
                rec.set_batch(PassBatch.idle(ROWS))  # replaced by the real one below
                rec.set_batch(batch)
            assert rec.current_batch is batch
            if batch is None:
                rec.set_pass_phase("mixed", num_requests=2)  # inside the pass, no batch: this names it
            for layer in range(LAYERS - 1):
                with rec.with_current_layer(layer):
                    with rec.with_phase(PHASES[0]):
                        rec.on_select_experts(ids)
                    with rec.with_phase(PHASES[1]):
                        rec.on_dispatch(send, send, dropped=torch.tensor(0))
                    with rec.with_phase(PHASES[2]), rec.disable_this_region():
                        rec.on_select_experts(ids)  # a draft model's routing: counts nothing
                        rec.on_dispatch(send, send)
                    with rec.with_phase(PHASES[3]):
                        pass
            rec.on_select_experts(ids, layer=LAYERS - 1)  # the last layer by index, outside with_current_layer
            rec.on_dispatch(send, layer=LAYERS - 1)
            if step == 5:
                raise RuntimeError("the engine's forward failed: the partial pass is discarded")
            ended += 1
    return ended


@pytest.fixture(scope="module")
def routing():
    gen = torch.Generator().manual_seed(35)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(ROWS)])
    ids[-1] = -1  # the static batch's last row is padding: it routes nowhere (and is not stored)
    return ids, torch.tensor([3, 5])


@pytest.mark.parametrize("timing", [False, True], ids=["untimed", "timed"])
@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_every_hook_in_every_mode_with_request_rows_has_no_host_sync(tmp_path, mode, timing, routing):
    ids, send = routing
    rec = make(tmp_path, mode, timing)
    plan = batches()
    rec.start_record()
    with assert_no_host_sync():
        ended = run_passes(rec, plan, ids, send)
    assert ended == PASSES - 1 and rec.num_passes == ended
    snap = rec.snapshot()
    valid = int((ids >= 0).sum())  # per layer per counted call
    assert int(snap.physical_count.sum()) == ended * LAYERS * valid  # the disabled regions counted nothing
    rec.stop_record()
    if mode != "per_token":
        rec.reset()  # nothing left behind to recover
        return
    kept = [b for step, b in enumerate(plan) if step != 5]
    with open_trace(rec.dump_record(tmp_path / "rows.h5")) as trace:
        table = trace.request_table()
        rows = list(trace.iter_tokens())
    request = np.concatenate([c.request for c in rows])
    position = np.concatenate([c.request_position for c in rows])
    pass_id = np.concatenate([c.pass_id for c in rows])
    row = np.concatenate([c.position for c in rows])
    pass_ids = [p for p in range(PASSES) if p != 5]
    for p, batch in zip(pass_ids, kept, strict=True):
        mine = pass_id == p
        if batch is None:
            assert (request[mine] == -1).all()
            continue
        np.testing.assert_array_equal(row[mine], np.arange(ROWS - 1))  # every row but the padding one
        want_request, want_position = (a[: ROWS - 1] for a in batch.row_requests())
        got_ids = np.where(request[mine] >= 0, table[np.maximum(request[mine], 0)], None)
        want_ids = np.where(want_request >= 0, np.asarray((*batch.request_ids, ""), dtype=object)[want_request], None)
        assert list(got_ids) == list(want_ids), f"pass {p}"
        np.testing.assert_array_equal(position[mine], want_position)
        assert (want_request >= 0).any() == (batch.phase != "idle")


def _sync() -> None:
    torch.ones(1).sum().item()  # a host read of a tensor value: what the guard must name


def _injected(name: str) -> type:
    """A recorder whose hook ``name`` reads a tensor value on the host before doing its work."""
    original = getattr(ExpertDistributionRecorder, name)
    if isinstance(original, property):
        def getter(self):  # type: ignore[no-untyped-def]
            _sync()
            return original.fget(self)

        member: object = property(getter)
    else:
        def method(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            _sync()
            return original(self, *args, **kwargs)

        member = method
    return type(f"Syncing_{name}", (ExpertDistributionRecorder,), {name: member})


@pytest.mark.parametrize("name", HOT_PATH)
def test_a_sync_in_any_hook_is_caught(tmp_path, name, routing):
    """Negative control, hook by hook: the same passes with one hook made to read a value on the host fail
    the guard; so every hook above ran inside it, with the batch on."""
    ids, send = routing
    rec = make(tmp_path, "per_token", timing=False, cls=_injected(name))
    rec.start_record()
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), assert_no_host_sync():
        run_passes(rec, batches(), ids, send)
    rec.stop_record()
    rec.reset()
