"""The parallel layout of a trace's rank rows: written with the header, read back as
:class:`~moetrace.layout.RankLayout` objects and as the rows each total counts.

Root attributes :data:`~moetrace.trace.schema.LAYOUT_ATTRS` hold the sizes (the same
on every rank); ``/ranks/<name>`` (:data:`~moetrace.trace.schema.RANK_COORDINATES`)
holds one entry per ``/stat`` rank row, in row order. A trace written before
layouts were recorded has neither, and reads as every row holding its own tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

from ..layout import CountedRows, RankLayout, counted_rows
from .schema import LAYOUT_ATTRS, RANK_COORDINATES, RANKS_GROUP, Attr, TraceError, dataset

_FIELDS = {field.name for field in dataclasses.fields(RankLayout)}

__all__ = ["counted_of", "read_layouts", "write_layouts"]


def write_layouts(writer: Any, layouts: Sequence[RankLayout]) -> None:
    """Root layout attributes and ``/ranks/*`` ``[R]`` of ``layouts`` (one per rank row, row order),
    through ``writer``, a :class:`~moetrace.trace.writer.TraceWriter` (not imported: it imports
    this module), so the datasets get their checksums like every other."""
    if not layouts:
        return
    first = layouts[0]
    for other in layouts[1:]:
        if other.sizes() != first.sizes() or other.source != first.source:
            raise ValueError(f"rank {other.rank} reports layout {other.describe()} but rank {first.rank} reports {first.describe()}; "
                             "every rank of one run must describe the same layout")
    for field, name in LAYOUT_ATTRS.items():
        writer.set_attr(name, getattr(first, field))
    for name in RANK_COORDINATES:
        writer.write(dataset(RANKS_GROUP, name), np.array([getattr(layout, name) for layout in layouts], dtype=np.int32))


def read_layouts(file: h5py.File) -> tuple[RankLayout, ...]:
    """The layouts written by :func:`write_layouts` (empty for traces without them).

    Raises:
        TraceError: the layout is present but inconsistent (names the file).
    """
    if RANKS_GROUP not in file:
        return ()
    attrs = file.attrs
    missing = [name for name in LAYOUT_ATTRS.values() if name not in attrs] + [name for name in RANK_COORDINATES if name not in file[RANKS_GROUP]]
    if missing:
        raise TraceError(f"{file.filename}: /{RANKS_GROUP} is present but {missing} are missing; the trace was damaged or edited")
    rows = {name: np.asarray(file[dataset(RANKS_GROUP, name)][()]) for name in RANK_COORDINATES}
    shared = {field: attrs[name].item() if isinstance(attrs[name], np.generic) else str(attrs[name]) for field, name in LAYOUT_ATTRS.items()}
    inputs = [name for name in RANK_COORDINATES if name in _FIELDS]  # the rest are derived, and checked
    layouts = []
    try:
        for i in range(len(rows[RANK_COORDINATES[0]])):
            layout = RankLayout(ep_size=int(attrs[Attr.EP_SIZE]), **shared, **{name: int(rows[name][i]) for name in inputs})
            wrong = [name for name in RANK_COORDINATES if int(getattr(layout, name)) != int(rows[name][i])]
            if wrong:
                raise ValueError(f"row {i} stores {wrong} that its coordinates do not give")
            layouts.append(layout)
    except ValueError as exc:
        raise TraceError(f"{file.filename}: /{RANKS_GROUP} describes an impossible layout ({exc}); the trace was damaged or edited") from exc
    return tuple(layouts)


def counted_of(layouts: Sequence[RankLayout], num_rows: int, row_ranks: np.ndarray | None = None) -> CountedRows:
    """Which of ``num_rows`` rank rows a total counts (see :func:`moetrace.layout.counted_rows`).

    Without layouts every row counts (old traces). ``row_ranks`` gives each row's
    global rank when the rows are not ``layouts`` in order (default: they are).
    """
    if not layouts:
        everything = np.ones(num_rows, dtype=bool)
        return CountedRows(everything, everything.copy())
    if len(layouts) != num_rows:
        raise TraceError(f"the trace describes {len(layouts)} ranks in /{RANKS_GROUP} but has {num_rows} rank rows; the trace was damaged or edited")
    ranks = np.array([layout.rank for layout in layouts]) if row_ranks is None else row_ranks
    return counted_rows([layout.token_group for layout in layouts], ranks, [layout.pp_rank for layout in layouts])
