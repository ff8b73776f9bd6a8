"""Trace integrity: checksums sealed into every trace, checked when it is read, and the one
boundary that turns every HDF5 failure into a :class:`~moetrace.trace.schema.TraceError`.

What protects what (``docs/trace-format.md``, "Integrity"):

- **Raw data**: every dataset that holds data is chunked with HDF5's Fletcher-32 filter
  (:func:`create_options`). HDF5 checks a chunk's checksum each time the chunk is read, in
  every process and through every API (moetrace's reader, ``merge``, dask workers, plain
  h5py), so a damaged chunk can never be decoded into numbers.
- **Structure**: moetrace writes with ``libver="latest"``, whose superblock, object headers
  (with the attributes and filter pipelines stored in them), chunk indices, B-trees and
  fractal heaps all carry HDF5's own metadata checksums.
- **What neither covers**, sealed by :func:`seal` at commit as 128-bit BLAKE2b digests
  (fixed-length strings, so they live in checksummed object headers):

  - each dataset's ``checksum`` attribute: shape, dtype, its other attributes and, per
    chunk in logical order, the chunk's offset and stored Fletcher-32 value (Fletcher-32
    alone would not notice two chunks swapped on disk); for the few datasets without
    the filter (scalars, empty datasets) and for variable-length strings (kept in
    HDF5's global heap, which has no checksum), their full contents;
  - the root ``checksum`` attribute: every root and group attribute (string attributes
    live in the global heap too) and the name and digest of every dataset (a removed or
    renamed dataset shows).

:func:`check_seal` recomputes the digests without decoding any chunk (a few bytes read
per chunk), so :func:`~moetrace.trace.reader.open_trace` runs it on every open; chunk
contents are then checked by HDF5 as they are read. Traces written before checksums
(no ``integrity`` root attribute) stay readable and are reported as unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import types
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from .schema import (
    CHECKSUM_ATTR,
    INTEGRITY_ATTR,
    INTEGRITY_VERSION,
    TraceDamageError,
    TraceError,
    TraceWriteError,
)

__all__ = [
    "CHECKSUMS",
    "check_seal",
    "create_options",
    "damage_message",
    "datasets",
    "from_hdf5",
    "is_sealed",
    "reading",
    "reseal",
    "seal",
    "sealing",
    "unsealed",
]

#: What each sealed trace carries, in words (``inspect``, ``verify`` and the docs use it).
CHECKSUMS = "Fletcher-32 per chunk (HDF5) + BLAKE2b-128 digests per dataset and of the root"
_FLETCHER32 = h5py.h5z.FILTER_FLETCHER32
_state = types.SimpleNamespace(off=False)  # process-wide: the recorder's writer threads write too


# ----------------------------------------------------------------------------- writing
def create_options(shape: tuple[int, ...], maxshape: tuple[int | None, ...] | None = None, dtype: object = None) -> dict[str, object]:
    """``create_dataset`` keywords that give a dataset of ``shape`` its Fletcher-32 filter.

    Any dataset that can hold data is chunked (HDF5 filters need chunks; h5py picks the
    chunk shape unless the caller passes one). Scalars, empty fixed-shape datasets and
    variable-length strings (HDF5 filters cannot apply to them) get nothing: :func:`seal`
    digests their contents instead.
    """
    if not sealing():
        return {}
    resizable = maxshape is not None and any(m is None for m in maxshape)
    if (dtype is not None and _variable_length(np.dtype(dtype))) or not shape or (int(np.prod(shape)) == 0 and not resizable):
        return {}
    return {"fletcher32": True}


def sealing() -> bool:
    """Whether traces written now get checksums (always, except inside :func:`unsealed`)."""
    return not _state.off


@contextlib.contextmanager
def unsealed() -> Iterator[None]:
    """Traces written in this process while the block runs (by any thread) carry no checksums,
    as before moetrace had them: they read back as unverified. A recording's writer process and a
    dump's child are other processes: they still seal what they write. For the benchmark's
    with/without ratio and the tests of older traces; never needed otherwise."""
    _state.off = True
    try:
        yield
    finally:
        _state.off = False


def seal(file: h5py.File, path: Path) -> None:
    """Write every dataset's ``checksum`` attribute and the root's into ``file`` (open for
    writing, everything else already written; ``path`` is its file on disk).

    Does nothing inside :func:`unsealed`.
    """
    if not sealing():
        return
    file.flush()
    file.attrs[INTEGRITY_ATTR] = INTEGRITY_VERSION
    digests: dict[str, str] = {}
    with open(path, "rb") as raw:
        for name, dset in datasets(file):
            digests[name] = _dataset_digest(dset, raw)
    for name, digest in digests.items():
        file[name].attrs[CHECKSUM_ATTR] = np.bytes_(digest)
    file.attrs[CHECKSUM_ATTR] = np.bytes_(_root_digest(file, digests))


def reseal(path: Path | str) -> None:
    """Seal ``path`` again after a deliberate edit with h5py (e.g. setting root attributes on a
    copy): its digests are recomputed from what the file holds now. Damage inside chunks still
    shows (Fletcher-32 travels with the chunks); use it only on a file you changed on purpose."""
    path = Path(path)
    with h5py.File(path, "r+") as file:
        seal(file, path)


# ----------------------------------------------------------------------------- checking
def is_sealed(file: h5py.File) -> bool:
    """Whether ``file`` was written with checksums (else: an older, unverified trace)."""
    return INTEGRITY_ATTR in file.attrs


def check_seal(file: h5py.File, path: Path) -> dict[str, str]:
    """Recompute the digests of a sealed trace: ``{"/name": what is wrong}``, empty when
    every digest matches (``"/"`` is the root). Chunks are not decoded (see the module
    docstring); :func:`reading` errors surface for damaged metadata."""
    problems: dict[str, str] = {}
    version = int(file.attrs[INTEGRITY_ATTR])
    if version > INTEGRITY_VERSION:
        return {"/": f"its checksums are of integrity version {version}, newer than this moetrace ({INTEGRITY_VERSION}); upgrade moetrace"}
    digests: dict[str, str] = {}
    with open(path, "rb") as raw:
        for name, dset in datasets(file):
            with reading(path, f"/{name}"):
                stored = _stored(dset.attrs)
                if stored is None:
                    problems[f"/{name}"] = "has no checksum although the trace is sealed (the dataset was added or its header rewritten)"
                    continue
                if dset.size and dset.shape and not _variable_length(dset.dtype) and not _has_fletcher(dset):
                    problems[f"/{name}"] = "has lost its Fletcher-32 filter (the dataset was rewritten)"
                actual = _dataset_digest(dset, raw)
            digests[name] = stored
            if actual != stored:
                problems[f"/{name}"] = f"checksum mismatch (stored {stored}, computed {actual}): its chunks were reordered, replaced or its attributes changed"
    with reading(path, "the root attributes"):
        stored = _stored(file.attrs)
        actual = _root_digest(file, digests)
    if stored is None:
        problems["/"] = "the root checksum is missing"
    elif actual != stored:
        problems["/"] = f"root checksum mismatch (stored {stored}, computed {actual}): a root attribute changed or a dataset was added or removed"
    return problems


# ----------------------------------------------------------------------------- the error boundary
def from_hdf5(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside h5py/HDF5 (its traceback passes through h5py)."""
    tb = exc.__traceback__
    while tb is not None:
        if "h5py" in Path(tb.tb_frame.f_code.co_filename).parts:  # h5py's Python and Cython ("h5py/h5d.pyx") frames
            return True
        tb = tb.tb_next
    return isinstance(exc, OSError) and "HDF5" in type(exc).__module__


def _what(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    low = text.lower()
    if "fletcher32" in low or "filter returned failure" in low or ("checksum" in low and "metadata" not in low):
        kind = "its data does not match its checksum"
    elif "metadata checksum" in low:
        kind = "HDF5 metadata does not match its checksum"
    elif "truncat" in low or "eof" in low or "end of file" in low:
        kind = "the file is truncated"
    elif "signature" in low or "version number" in low or "header" in low or "heap" in low:
        kind = "HDF5 structures are corrupt"
    else:
        kind = "HDF5 could not read it"
    return f"{kind} ({text})"


def damage_message(path: Path | str, what: str, detail: str) -> str:
    """One line: the file, the object, the damage, and what to do about it."""
    return (
        f"{path}: {what} is damaged: {detail}. Nothing of it is used. Run `moetrace verify {path}` to see what is intact; "
        "if the recording crashed, `moetrace recover <output_dir>` rebuilds a trace from its intact segments; "
        "otherwise dump the trace again or copy it again from a good source"
    )


@contextlib.contextmanager
def reading(path: Path | str, what: str = "the file") -> Iterator[None]:
    """Turn every h5py/HDF5 failure inside the block into a :class:`TraceDamageError` naming
    ``path``, ``what`` (an object such as ``"/stat/logical_count"``), the damage and the remedy."""
    try:
        yield
    except (TraceError, TraceWriteError):
        raise
    except Exception as exc:
        if not from_hdf5(exc) and not isinstance(exc, OSError):
            raise
        raise TraceDamageError(path, damage_message(path, what, _what(exc))) from exc


# ----------------------------------------------------------------------------- digests
def datasets(file: h5py.File) -> list[tuple[str, h5py.Dataset]]:
    """Every dataset of ``file`` as ``(name, dataset)``, in name order."""
    found: list[tuple[str, h5py.Dataset]] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            found.append((name, obj))

    file.visititems(visit)
    return sorted(found, key=lambda item: item[0])


def _groups(file: h5py.File) -> list[tuple[str, h5py.Group]]:
    found: list[tuple[str, h5py.Group]] = [("", file)]

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Group):
            found.append((name, obj))

    file.visititems(visit)
    return sorted(found, key=lambda item: item[0])


def _stored(attrs: h5py.AttributeManager) -> str | None:
    if CHECKSUM_ATTR not in attrs:
        return None
    value = attrs[CHECKSUM_ATTR]
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def _variable_length(dtype: np.dtype) -> bool:
    """Variable-length strings or sequences: kept in HDF5's global heap, which filters cannot reach."""
    string = h5py.check_string_dtype(dtype)
    return dtype.kind == "O" or h5py.check_vlen_dtype(dtype) is not None or (string is not None and string.length is None)


def _has_fletcher(dset: h5py.Dataset) -> bool:
    plist = dset.id.get_create_plist()
    return any(plist.get_filter(i)[0] == _FLETCHER32 for i in range(plist.get_nfilters()))


def _canonical(value: object) -> bytes:
    """Bytes that stand for an attribute value exactly as h5py reads it back."""
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    array = np.asarray(value)
    if array.dtype.kind == "O":
        return b"o" + b"\x00".join(_canonical(v) for v in array.ravel()) + repr(array.shape).encode()
    return array.dtype.str.encode() + repr(array.shape).encode() + np.ascontiguousarray(array).tobytes()


def _hash_attrs(h: hashlib._Hash, attrs: h5py.AttributeManager) -> None:
    for key in sorted(k for k in attrs.keys() if k != CHECKSUM_ATTR):
        h.update(key.encode("utf-8") + b"=" + _canonical(attrs[key]) + b";")


def _dataset_digest(dset: h5py.Dataset, raw: object) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(dset.shape).encode() + b"|" + str(dset.dtype).encode() + b"|" + dset.dtype.str.encode())
    _hash_attrs(h, dset.attrs)
    vlen = _variable_length(dset.dtype)
    if dset.chunks is not None and _has_fletcher(dset) and not vlen:
        chunks: list[tuple[tuple[int, ...], int, int]] = []
        dset.id.chunk_iter(lambda info: chunks.append((tuple(info.chunk_offset), int(info.byte_offset), int(info.size))))
        for offset, at, size in sorted(chunks):
            raw.seek(at + size - 4)  # type: ignore[attr-defined]
            h.update(repr(offset).encode() + raw.read(4))  # type: ignore[attr-defined]
    elif dset.size:
        data = dset[()]
        h.update(_canonical(data) if vlen else np.ascontiguousarray(data).tobytes())
    return h.hexdigest()


def _root_digest(file: h5py.File, digests: dict[str, str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, group in _groups(file):
        h.update(b"group /" + name.encode("utf-8") + b":")
        _hash_attrs(h, group.attrs)
    for name in sorted(digests):
        h.update(b"dataset /" + name.encode("utf-8") + b"=" + digests[name].encode() + b";")
    return h.hexdigest()
