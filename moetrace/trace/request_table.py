"""The request table of a ``per_token`` trace: joining tables when segments or ranks are joined.

``/tokens/request`` indexes ``/request_table/id`` (the engine's request ids; ``-1``: no
known request). Each segment's table holds the ids its own rows reference; joining
segments (:mod:`.join`) or merging ranks (:mod:`.merge`) concatenates the tables and
moves each input's indices by its table's offset. One id may therefore sit at several
indices of a joined table (once per segment or rank it spans); readers group rows by
the id, never by the index (:mod:`.routes`). Memory stays bounded: tables are copied
``block`` ids at a time and index columns are shifted chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import h5py
import numpy as np

from .integrity import reading
from .invariants import check_request_rows, violation
from .schema import STRING_DTYPE, Data
from .writer import TraceWriter

__all__ = ["append_request_tables", "check_rows", "has_request_table", "read_request_table", "shift_requests", "table_size"]


def has_request_table(file: h5py.File) -> bool:
    """Whether ``file``'s token rows carry requests (``per_token`` traces since request rows)."""
    return Data.REQUEST_TABLE_ID in file and Data.TOKENS_REQUEST in file


def table_size(file: h5py.File) -> int:
    """Ids in ``file``'s ``/request_table/id`` (0 without a table)."""
    return int(file[Data.REQUEST_TABLE_ID].shape[0]) if Data.REQUEST_TABLE_ID in file else 0


def check_rows(file: h5py.File, row: int, request: np.ndarray, position: np.ndarray | None) -> None:
    """``request [n]`` / ``position [n]``, ``file``'s token rows ``row ..``, checked against its own table
    before a join or merge moves them: HDF5's Fletcher-32 cannot tell a run of ``-1`` from one of ``0``
    (a chunk of each swapped keeps both checksums), so the rows' own rule is the check that sees it.

    Raises:
        TraceDamageError: naming the first row that breaks the rule, or the missing position column.
    """
    if position is None:
        raise violation(file.filename, f"/{Data.TOKENS_REQUEST_POSITION}", f"missing beside /{Data.TOKENS_REQUEST}")
    check_request_rows(file.filename, row, request, position, table_size(file))


def read_request_table(file: h5py.File, start: int = 0, stop: int | None = None) -> np.ndarray:
    """``[Q]`` the ids of ``/request_table/id[start:stop]`` as a numpy array of ``str`` (object dtype)."""
    with reading(file.filename, f"/{Data.REQUEST_TABLE_ID}"):
        return np.asarray(file[Data.REQUEST_TABLE_ID].asstr()[start:stop], dtype=object)


def append_request_tables(files: Sequence[h5py.File], writer: TraceWriter, block: int = 1 << 16) -> list[int]:
    """Append every file's request table to ``writer``'s, in order; returns each file's offset.

    ``[]`` when no file has request rows (nothing is written then). A file without a table
    (written before request rows) adds no ids, and its rows read ``-1``.
    """
    if not any(has_request_table(f) for f in files):
        return []
    writer.ensure_empty(Data.REQUEST_TABLE_ID, (), np.dtype(STRING_DTYPE))
    offsets, total = [], 0
    for f in files:
        offsets.append(total)
        size = table_size(f)
        for start in range(0, size, block):
            writer.append(Data.REQUEST_TABLE_ID, np.array(read_request_table(f, start, start + block), dtype=STRING_DTYPE))
        total += size
    return offsets


def shift_requests(column: np.ndarray, offset: int) -> np.ndarray:
    """``[n]`` int32 request indices moved by ``offset`` (``-1`` stays ``-1``)."""
    column = np.asarray(column, dtype=np.int32)
    if offset == 0:
        return column
    return np.where(column >= 0, column + np.int32(offset), np.int32(-1)).astype(np.int32)
