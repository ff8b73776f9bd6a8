"""``/tokens/topk_ids`` rows held to ``/stat`` by every full read, not only by ``verify``.

HDF5's Fletcher-32 sums 16-bit words mod 65535, so a word ``0xFFFF`` zeroed on disk keeps its
chunk's checksum, and the trace's digests (which hold each chunk's stored checksum) stay good: in
``/tokens/topk_ids`` a pair of int8 ``-1`` ids (no routing) or one int16 ``-1`` reads as expert 0.
``verify`` always saw it (its full read adds the rows up against ``/stat``); ``analyze`` of a
``per_token`` trace answered exit 0 with another answer (issue 32). Now the reader's token
iteration (:meth:`Trace.iter_tokens`) and the row-range tasks of the distributed analysis add
every row up (:class:`moetrace.trace.invariants.TokenTally`) and refuse the file at the last row.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.analysis.distributed import analyze_traces
from moetrace.analysis.divergence import diff_sources
from moetrace.trace import invariants, open_trace
from moetrace.trace.merge import merge_traces
from moetrace.trace.schema import Data, TraceDamageError

runner = CliRunner()
IDS = torch.tensor([[3, 4], [5, -1], [6, 7]])  # token 1 routes once in each layer: one -1 id


def _record(directory: Path, experts: int) -> Path:
    """3 passes of :data:`IDS` in 2 layers; pass 1 skips layer 1 (its rows hold ``[-1, -1]`` there).
    Uncompressed, so a word of ids is a word on disk."""
    rec = ExpertDistributionRecorder(RecorderConfig(num_layers=2, num_physical_experts=experts, top_k=2, mode="per_token",
                                                    output_dir=directory, max_tokens_per_pass=4, compression="none"))
    rec.start_record()
    for pass_id in range(3):
        with rec.with_forward_pass(pass_id):
            for layer in range(2 if pass_id != 1 else 1):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(IDS)
    rec.stop_record()
    return rec.dump_record(directory / f"experts{experts}.h5")


def _zero_word(path: Path, row: int, layer: int, slot: int) -> None:
    """Zero the 16-bit word on disk that holds id ``[row, layer, slot]`` (``0xFFFF`` before); nothing resealed."""
    with h5py.File(path, "r") as f:
        ids = f[Data.TOKENS_TOPK_IDS]
        rows_per_chunk = ids.chunks[0]
        info = ids.id.get_chunk_info_by_coord((row // rows_per_chunk * rows_per_chunk, 0, 0))
        assert ids.compression is None and ids.fletcher32
        at = info.byte_offset + ((row % rows_per_chunk * ids.shape[1] + layer) * ids.shape[2] + slot) * ids.dtype.itemsize
    with path.open("r+b") as raw:
        raw.seek(at)
        assert raw.read(2) == b"\xff\xff"
        raw.seek(at)
        raw.write(b"\x00\x00")


def _cli(*args: object) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout


# (experts, dtype, the word zeroed: row, layer, slot, the ids it held)
CASES = {"int8 pair": (16, np.int8, (3, 1, 0), [-1, -1]), "int16 single": (200, np.int16, (1, 0, 1), [-1])}


@pytest.mark.parametrize("case", list(CASES))
def test_zeroed_no_routing_ids_are_refused_by_every_full_read(tmp_path, monkeypatch, case):
    experts, dtype, (row, layer, slot), held = CASES[case]
    path = _record(tmp_path, experts)
    honest = tmp_path / "honest.h5"
    honest.write_bytes(path.read_bytes())
    with open_trace(path) as trace:
        ids = trace.read_tokens("topk_ids")
        assert ids.dtype == dtype and ids[row, layer, slot : slot + len(held)].tolist() == held
    code, answer = _cli("analyze", path, "--json")
    assert code == 0 and _cli("verify", path)[0] == 0

    _zero_word(path, row, layer, slot)
    with h5py.File(path, "r") as f:  # Fletcher-32 passes by itself: the ids read as expert 0
        assert f[Data.TOKENS_TOPK_IDS][row, layer, slot : slot + len(held)].tolist() == [0] * len(held)
    assert _cli("verify", path)[0] == 2  # as before
    code, damaged = _cli("analyze", path, "--json")
    assert code == 2 and damaged == ""
    with open_trace(path) as trace:
        assert trace.read_tokens("topk_ids", 0, row + 1)[row, layer, slot] == 0  # a range cannot check and does not pretend to
        with pytest.raises(TraceDamageError, match=rf"/stat/physical_count .*rank row 0, layer {layer}, expert slot 0: total \d+, but the /tokens rows add up to"):
            list(trace.iter_tokens(chunk=2))
    with pytest.raises(TraceDamageError, match="physical_count"):
        analyze_traces([path], task_rows=4, chunk_tokens=2)  # row-range tasks, added up across tasks
    with pytest.raises(TraceDamageError, match="physical_count"):
        diff_sources(path, honest)
    with pytest.raises(TraceDamageError, match="physical_count"):
        merge_traces([path], tmp_path / "merged.h5")  # moves the rows without the reader
    assert not (tmp_path / "merged.h5").exists()

    # Negative control: without the tally's check, analyze answers exit 0 with another answer.
    monkeypatch.setattr(invariants.TokenTally, "check", lambda self, trace: None)
    code, patched = _cli("analyze", path, "--json")
    assert code == 0 and patched != answer
