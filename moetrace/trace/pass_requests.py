"""Each pass's stored request count checked against its pass phase, straight from an open HDF5 file.

``merge`` and the segment join move ``/window`` and ``/passes`` rows without the reader's
checks (the merge restacks the window and streams the passes; the join copies both), so
they check the counts here first: :func:`moetrace.trace.invariants.check_pass_requests`
on ``/window/num_requests [1, W]`` and on ``/passes/num_requests [N]``, ``block_rows`` pass
rows at a time. A run of ``-1`` turned into ``0`` keeps HDF5's Fletcher-32 (16-bit words
summed mod 65535: ``0xFFFF`` and ``0x0000`` are the same), so this rule is what sees it.
"""

from __future__ import annotations

import h5py
import numpy as np

from .integrity import reading
from .invariants import check_pass_requests
from .schema import Data

__all__ = ["check_stored_requests"]


def check_stored_requests(file: h5py.File, block_rows: int = 1 << 20) -> None:
    """``file``'s window slots and pass rows (those it holds) against the request rule.

    Raises:
        TraceDamageError: naming the dataset and the first pass or slot that breaks it.
    """
    if Data.WINDOW_NUM_REQUESTS in file:
        with reading(file.filename, f"/{Data.WINDOW_NUM_REQUESTS}"):
            requests = np.asarray(file[Data.WINDOW_NUM_REQUESTS][()])
            pass_id = np.asarray(file[Data.WINDOW_PASS_ID][()])
            phase = np.asarray(file[Data.WINDOW_PASS_PHASE][()]) if Data.WINDOW_PASS_PHASE in file else np.zeros(pass_id.shape, np.int8)
        check_pass_requests(file.filename, Data.WINDOW_NUM_REQUESTS, phase, requests, pass_id)
    if Data.PASSES_NUM_REQUESTS not in file:
        return
    column, phases = file[Data.PASSES_NUM_REQUESTS], file.get(Data.PASSES_PASS_PHASE)
    for at in range(0, column.shape[0], block_rows):
        with reading(file.filename, f"/{Data.PASSES_NUM_REQUESTS}"):
            requests = np.asarray(column[at : at + block_rows])
            phase = np.zeros(len(requests), np.int8) if phases is None else np.asarray(phases[at : at + block_rows])
        check_pass_requests(file.filename, Data.PASSES_NUM_REQUESTS, phase, requests, row=at)
