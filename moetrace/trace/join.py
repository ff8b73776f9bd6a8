"""Joining consecutive segment files of one rank into one trace (``dump_record``, ``moetrace recover``).

:func:`concat_segments` sits beside :mod:`moetrace.trace.merge` (which joins
*ranks*); both write through one :class:`~moetrace.trace.writer.TraceWriter`
used as a context manager, so a failure at any point leaves nothing under the
target name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from .integrity import reading
from .pass_requests import check_stored_requests
from .ranks import read_layouts
from .reader import open_trace
from .request_table import append_request_tables, check_rows, shift_requests
from .safe_open import open_hdf5
from .schema import RANKS_GROUP, SAME_SEGMENT_ATTRS, Data, TraceError, TraceHeader
from .writer import TraceWriter

__all__ = ["concat_segments"]

#: Stat datasets that are per-rank totals: summed when segments are joined.
_ADDITIVE = Data.STAT


def _check_same(paths: Sequence[Path], files: Sequence[h5py.File]) -> None:
    first = files[0].attrs
    for path, f in zip(paths[1:], files[1:], strict=True):
        for key in SAME_SEGMENT_ATTRS:
            if f.attrs.get(key) != first.get(key):
                raise TraceError(f"{path}: {key}={f.attrs.get(key)!r} differs from {paths[0]}'s {first.get(key)!r}; segments of one run and rank only")


def concat_segments(
    paths: Sequence[Path],
    out: Path,
    *,
    attrs: Mapping[str, object] | None = None,
    extra: Callable[[TraceWriter], None] | None = None,
    compression: Mapping[str, object] | None = None,
    block_bytes: int = 4 << 20,
) -> Path:
    """Join consecutive segments of one rank into one trace at ``out`` (atomically).

    One segment is copied as it is (compressed chunks are not re-encoded).
    Several: ``/stat`` datasets are summed (each segment's totals cover its own
    passes), datasets resizable along axis 0 (``/passes``, ``/tokens``,
    ``/timing`` ...) are concatenated in segment order (their stored chunks copied
    as they are where the chunk grids line up, else decoded ``block_bytes`` at a
    time: :meth:`~moetrace.trace.writer.TraceWriter.append_from`), and other datasets are taken from the last segment. ``attrs`` are
    added to the root; ``extra(writer)`` may write more before the commit.

    Raises:
        TraceError: no segment, or one is unreadable or of another run/rank.
    """
    if not paths:
        raise TraceError("no segments to join")
    for path in paths:
        open_trace(path).close()  # validates: complete, schema, version, checksums, layout
    files = [open_hdf5(p) for p in paths]
    try:
        _check_same(paths, files)
        for f in files:  # copied without the reader's checks
            check_stored_requests(f)
        first = files[0]
        with reading(paths[0], "/layers, /physical_to_logical and /ranks"):
            header = TraceHeader.of_attrs(dict(first.attrs), np.asarray(first[Data.LAYERS][()]), np.asarray(first[Data.PHYSICAL_TO_LOGICAL][()]), layouts=read_layouts(first))
        with TraceWriter(out, header, compression=compression) as writer:
            if len(files) == 1:
                with reading(paths[0]):
                    for group in first:
                        if isinstance(first[group], h5py.Group) and group != RANKS_GROUP:  # /ranks is part of the header
                            writer.copy_group(first, group)
            else:
                _join(files, writer, block_bytes)
            if extra is not None:
                extra(writer)
            for key, value in (attrs or {}).items():
                writer.set_attr(key, value)
            return writer.commit()
    finally:
        for f in files:
            f.close()


def _join(files: Sequence[h5py.File], writer: TraceWriter, block_bytes: int) -> None:
    names: dict[str, h5py.Dataset] = {}  # every dataset of any segment, first seen first

    def collect(name: str, obj: object) -> None:  # returns None: visititems stops at a non-None return
        if isinstance(obj, h5py.Dataset):
            names.setdefault(name, obj)

    for f in files:
        f.visititems(collect)
    offsets = append_request_tables(files, writer)
    for name, ds in names.items():
        if name in (Data.LAYERS, Data.PHYSICAL_TO_LOGICAL, Data.REQUEST_TABLE_ID) or name.split("/", 1)[0] == RANKS_GROUP:  # header / table: written already
            continue
        if name == Data.TOKENS_REQUEST and offsets:  # indices into each segment's own table: shifted, not copied
            writer.ensure_empty(name, (), np.dtype(np.int32))
            for f, offset in zip(files, offsets, strict=True):
                if name in f:
                    _append_shifted(f, writer, offset, block_bytes)
            continue
        if name.split("/", 1)[0] == _ADDITIVE:
            total = sum(_whole(f, name) for f in files if name in f)
            writer.write(name, np.asarray(total).astype(ds.dtype), compress=ds.compression is not None)
        elif ds.maxshape and ds.maxshape[0] is None:
            writer.ensure_empty(name, ds.shape[1:], ds.dtype)
            for f in files:
                if name in f:
                    with reading(f.filename, f"/{name}"):
                        writer.append_from(name, f[name], block_bytes)
        else:
            writer.write(name, _whole([f for f in files if name in f][-1], name))


def _append_shifted(file: h5py.File, writer: TraceWriter, offset: int, block_bytes: int) -> None:
    source, positions = file[Data.TOKENS_REQUEST], file.get(Data.TOKENS_REQUEST_POSITION)
    block = max(1, block_bytes // 8)
    for at in range(0, source.shape[0], block):
        with reading(file.filename, f"/{Data.TOKENS_REQUEST}"):
            column = np.asarray(source[at : at + block])
            position = None if positions is None else np.asarray(positions[at : at + block])
        check_rows(file, at, column, position)
        writer.append(Data.TOKENS_REQUEST, shift_requests(column, offset))


def _whole(file: h5py.File, name: str) -> np.ndarray:
    with reading(file.filename, f"/{name}"):
        return np.asarray(file[name][()])
