"""``moetrace verify``: read all of a trace, check every checksum and invariant, say what is intact.

:func:`verify_trace` never raises for a damaged file: it reports, per dataset, whether it is
``intact`` (its digest matches and every chunk decodes with a good Fletcher-32),
``damaged`` (with what failed) or ``unverified`` (readable, but the trace predates
checksums, so nothing proves it unchanged), and, per trace, which invariants fail
(:mod:`.invariants`, including the full cross-check of streamed rows against ``/stat``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from . import integrity, invariants
from .safe_open import open_hdf5
from .schema import SCHEMA_NAME, STREAM_GROUP, Attr, TraceError

__all__ = ["DatasetStatus", "TraceReport", "verify_trace"]

_BLOCK_BYTES = 16 << 20
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclasses.dataclass(frozen=True)
class DatasetStatus:
    """One dataset: ``status`` is ``intact``, ``damaged`` or ``unverified``; ``detail`` says why."""

    name: str
    status: str
    detail: str = ""


@dataclasses.dataclass
class TraceReport:
    """What :func:`verify_trace` found in one file.

    Attributes:
        path: the file.
        found: what the file is: ``trace`` (an HDF5 file: a moetrace trace, possibly damaged), ``missing``
            (no such file) or ``foreign`` (not a moetrace trace: not HDF5, or HDF5 without ``schema="moetrace"``).
        sealed: it carries checksums (``False``: an older trace, read as unverified).
        datasets: every dataset found, in name order.
        problems: what is wrong beyond single datasets (the file, the root, invariants).
    """

    path: Path
    found: str = "trace"
    sealed: bool = False
    datasets: list[DatasetStatus] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def intact(self) -> bool:
        """Everything checked and nothing wrong (an unverified trace is not intact)."""
        return self.sealed and not self.problems and all(d.status == "intact" for d in self.datasets)

    @property
    def damaged(self) -> list[str]:
        """Names of the damaged datasets."""
        return [d.name for d in self.datasets if d.status == "damaged"]

    def as_dict(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "found": self.found,
            "intact": self.intact,
            "sealed": self.sealed,
            "datasets": [dataclasses.asdict(d) for d in self.datasets],
            "problems": list(self.problems),
        }


class _Progress:
    """Bytes read so far of a known total: reading every dataset once, then the streamed rows again for the invariants."""

    def __init__(self, report: Callable[[int, int], None] | None) -> None:
        self.report, self.done, self.total = report, 0, 0
        self.row_bytes: dict[str, int] = {}  # streamed group -> bytes of one row over its datasets

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.report is not None:
            self.report(min(self.done, self.total), self.total)


def _nbytes(dset: h5py.Dataset) -> int:
    return int(dset.size) * dset.dtype.itemsize


def _read_all(dset: h5py.Dataset, progress: _Progress) -> None:
    """Decode every chunk of ``dset`` (HDF5 checks each Fletcher-32 as it goes)."""
    if not dset.shape or dset.shape[0] == 0:
        dset[()]
        progress.advance(_nbytes(dset))
        return
    row = max(1, int(np.prod(dset.shape[1:])) * dset.dtype.itemsize)
    step = max(1, _BLOCK_BYTES // row)
    for start in range(0, dset.shape[0], step):
        dset[start : start + step]
        progress.advance(row * min(step, dset.shape[0] - start))


def verify_trace(path: Path | str, progress: Callable[[int, int], None] | None = None) -> TraceReport:
    """Check everything in ``path`` (see the module docstring); never raises for damage.

    ``progress(done, total)``: bytes read so far (every dataset once, then the streamed rows
    again for the invariants), for a progress bar.
    """
    path = Path(path)
    report = TraceReport(path)
    meter = _Progress(progress)
    if not path.is_file():
        report.found = "missing"
        report.problems.append(f"{path}: no such file")
        return report
    if not _is_hdf5(path):
        report.found = "foreign"
        report.problems.append(f"{path}: not an HDF5 file (it does not start with HDF5's signature)")
        return report
    try:
        file = open_hdf5(path)
    except Exception as exc:
        if not (integrity.from_hdf5(exc) or isinstance(exc, OSError)):
            raise
        report.problems.append(f"the file cannot be opened as HDF5 (truncated, or its superblock is damaged): {' '.join(str(exc).split())}")
        return report
    with file:
        if not _written_by_moetrace(file):
            report.found = "foreign"
            report.problems.append(f"{path}: an HDF5 file without the root attribute schema={SCHEMA_NAME!r}: not written by moetrace")
            return report
        _check_datasets(file, report, meter)
    if report.problems and any(p.startswith("the file") for p in report.problems):
        return report
    _check_invariants(report, meter)
    return report


def _is_hdf5(path: Path) -> bool:
    """The file starts with HDF5's signature (a truncated trace does; a text file does not)."""
    with path.open("rb") as head:
        return head.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE


def _written_by_moetrace(file: h5py.File) -> bool:
    """The root says ``schema="moetrace"`` or carries moetrace's checksums (a root too damaged to read: yes, and
    :func:`_check_datasets` says what is damaged)."""
    try:
        return file.attrs.get(Attr.SCHEMA) == SCHEMA_NAME or integrity.is_sealed(file)
    except Exception as exc:
        if not integrity.from_hdf5(exc):
            raise
        return True


def _check_datasets(file: h5py.File, report: TraceReport, meter: _Progress) -> None:
    path = report.path
    try:
        with integrity.reading(path):
            report.sealed = integrity.is_sealed(file)
            names = [name for name, _ in integrity.datasets(file)]
            meter.total = sum(_nbytes(file[name]) for name in names)
            for name in names:  # the invariants read the streamed rows again
                group = name.split("/")[0]
                if group in STREAM_GROUP.values() and file[name].ndim:
                    meter.total += _nbytes(file[name])
                    meter.row_bytes[group] = meter.row_bytes.get(group, 0) + _nbytes(file[name]) // max(1, file[name].shape[0])
    except TraceError as exc:
        report.problems.append(f"the file structure is damaged: {exc}")
        return
    seal_problems: dict[str, str] = {}
    if report.sealed:
        try:
            seal_problems = integrity.check_seal(file, path)
        except TraceError as exc:
            report.problems.append(f"the checksums cannot be checked: {exc}")
    if "/" in seal_problems:
        report.problems.append(f"root: {seal_problems['/']}")
    for name in names:
        key = f"/{name}"
        try:
            with integrity.reading(path, key):
                _read_all(file[name], meter)
        except TraceError as exc:
            report.datasets.append(DatasetStatus(key, "damaged", str(exc).split(" is damaged: ", 1)[-1].split(". Nothing of it")[0]))
            continue
        if key in seal_problems:
            report.datasets.append(DatasetStatus(key, "damaged", seal_problems[key]))
        elif report.sealed:
            report.datasets.append(DatasetStatus(key, "intact"))
        else:
            report.datasets.append(DatasetStatus(key, "unverified", "readable; written before checksums, so nothing proves it unchanged"))


def _check_invariants(report: TraceReport, meter: _Progress) -> None:
    from .reader import open_trace
    from .replica_requests import is_replica_trace, read_requests

    try:
        with open_trace(report.path) as trace:
            if trace.mode == "routing" or is_replica_trace(report.path):
                read_requests(report.path)
                return
            invariants.check_stat(trace)
            row = meter.row_bytes.get(STREAM_GROUP.get(trace.mode, ""), 0)
            invariants.check_rows_against_stat(trace, progress=lambda rows: meter.advance(rows * row))
            if trace.has_timing:
                trace.timing_rows()
    except TraceError as exc:
        text = str(exc)
        if not any(d.status == "damaged" and d.name in text for d in report.datasets) and text not in report.problems:
            report.problems.append(text)
