"""Atomic HDF5 trace writer (schema v1).

A :class:`TraceWriter` writes to a hidden temporary file next to the target and
renames it into place in :meth:`TraceWriter.commit`, after the root attribute
``complete`` is set and the file is flushed to disk. A crash, a full disk or an
exception at any earlier point leaves no file under the target name, and
:meth:`TraceWriter.abort` removes the temporary.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from . import integrity
from .files import temporary_path
from .ranks import write_layouts
from .schema import COMPLETE_ATTR, Data, TraceHeader, TraceWriteError, dataset

__all__ = ["COMPRESSIONS", "TraceWriter", "check_writable_dir", "chunk_rows", "compression_options", "token_id_dtype", "write_json_atomic", "write_text_atomic"]

_COMPRESS = {"compression": "gzip", "compression_opts": 1, "shuffle": True}
#: Accepted ``compression`` specs (``RecorderConfig.compression``); the last two need ``hdf5plugin``.
COMPRESSIONS = ("none", "lzf", "gzip[:level]", "zstd[:level]", "blosc2[:level]")
_PLUGIN_HINT = "install the optional extra: pip install 'moetrace[compression]' (hdf5plugin)"


def compression_options(spec: str) -> dict[str, object]:
    """h5py filter keywords for a compression spec (see :data:`COMPRESSIONS`).

    ``none``: no filter (fastest, largest). ``lzf``: fast, built into h5py
    (readable by h5py everywhere; other HDF5 tools need the LZF plugin).
    ``gzip[:level]`` (default level 1): slow, readable by every HDF5 tool.
    ``zstd[:level]`` and ``blosc2[:level]`` (Blosc2 with zstd and byte shuffle):
    through ``hdf5plugin``, an optional extra; readers need it too (moetrace's
    reader loads it when installed and says so when it is missing).
    Byte shuffle is on for the filters that gain from it.

    Raises:
        ValueError: an unknown spec or level, or a plugin filter without ``hdf5plugin``.
    """
    name, _, level_text = str(spec).strip().lower().partition(":")
    ranges = {"gzip": (0, 9, 1), "zstd": (1, 22, 3), "blosc2": (0, 9, 5)}
    if name in ("none", "lzf") and not level_text:
        return {} if name == "none" else {"compression": "lzf", "shuffle": True}
    if name not in ranges:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}; got {spec!r}")
    low, high, default = ranges[name]
    try:
        level = int(level_text) if level_text else default
    except ValueError:
        level = low - 1
    if not low <= level <= high:
        raise ValueError(f"compression {spec!r}: level must be an integer in [{low}, {high}]")
    if name == "gzip":
        return {"compression": "gzip", "compression_opts": level, "shuffle": True}
    try:
        import hdf5plugin
    except ImportError:
        raise ValueError(f"compression {spec!r} needs hdf5plugin: {_PLUGIN_HINT}, or use lzf or gzip") from None
    if name == "zstd":
        return dict(hdf5plugin.Zstd(clevel=level))
    return dict(hdf5plugin.Blosc2(cname="zstd", clevel=level, filters=hdf5plugin.Blosc2.SHUFFLE))


def token_id_dtype(num_physical_experts: int) -> np.dtype:
    """Smallest signed dtype holding ids ``-2 .. P-1`` (-1 padding, -2 invalid): int8 up to
    128 experts, int16 up to 32768, else int32."""
    for dtype in (np.int8, np.int16):
        if num_physical_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def chunk_rows(row_shape: tuple[int, ...], dtype: np.dtype | type) -> int:
    """Rows per chunk of an appended dataset of ``row_shape`` rows: about 1 MiB, at most 4096,
    a power of two (so that hand-offs of a power-of-two number of rows end on chunk boundaries
    and segments join by copying chunks)."""
    row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    return 1 << (max(1, min(4096, (1 << 20) // row_bytes)).bit_length() - 1)


def check_writable_dir(directory: Path) -> Path:
    """Create ``directory`` if needed and make sure a file can be written there.

    Raises:
        TraceWriteError: naming the directory and what to do.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise TraceWriteError(f"output path {directory} exists and is not a directory; pass a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TraceWriteError(f"cannot create output directory {directory}: {exc.strerror or exc}; pass a writable output_dir") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TraceWriteError(f"output directory {directory} is not writable; pass a writable output_dir")
    return directory



def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary beside it, then a rename.

    A failure leaves ``path`` as it was and removes the temporary. Returns ``path``.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent if str(target.parent) else ".")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the mode open() would give, not mkstemp's private 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _same_storage(a: h5py.Dataset, b: h5py.Dataset) -> bool:
    """Whether two datasets store rows alike: dtype, chunk shape and filter pipeline (with its parameters)."""
    if a.dtype != b.dtype or a.chunks != b.chunks or a.chunks is None:
        return False
    pa, pb = a.id.get_create_plist(), b.id.get_create_plist()
    filters = [pa.get_filter(i)[:3] for i in range(pa.get_nfilters())]
    return filters == [pb.get_filter(i)[:3] for i in range(pb.get_nfilters())]


def write_json_atomic(path: Path | str, document: object) -> Path:
    """Write ``document`` as JSON to ``path`` atomically (:func:`write_text_atomic`). Returns ``path``."""
    return write_text_atomic(path, json.dumps(document))

class TraceWriter:
    """Write one trace file atomically.

    Args:
        path: final file name; the parent directory must be writable.
        header: root attributes and static datasets.
        compression: h5py filter keywords (:func:`compression_options`) for
            appended datasets and ``write(..., compress=True)``; ``None`` is
            gzip level 1 with shuffle.

    The temporary is ``.<name>.tmp-<host>-<pid>-<random>`` so that
    :func:`~moetrace.trace.files.sweep_dead_temporaries` can tell a dead
    writer's leftovers from a live one's.

    As a context manager it is the one commit/abort path of every writer:
    ``with TraceWriter(out, header) as writer: ...; return writer.commit()``
    aborts (removes the temporary, leaves the target untouched) when the body raises.
    """

    def __init__(self, path: Path | str, header: TraceHeader, compression: Mapping[str, object] | None = None) -> None:
        self.path = Path(path)
        self.header = header
        self._compression = dict(_COMPRESS if compression is None else compression)
        check_writable_dir(self.path.parent)
        self._tmp = temporary_path(self.path)
        try:
            self._file = h5py.File(self._tmp, "w", libver="latest")
            self._write_header()
        except Exception as exc:
            self.abort()
            # The reason, not h5py's sentence (it names the temporary, which is gone).
            reason = os.strerror(exc.errno).lower() if isinstance(exc, OSError) and exc.errno else str(exc)
            raise TraceWriteError(f"could not write trace {self.path}: {reason} (creating a file in {self.path.parent}/); "
                                  "write it to a folder you can create files in") from exc

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is not None:
            self.abort()

    # -- header ---------------------------------------------------------------
    def _write_header(self) -> None:
        h, f = self.header, self._file
        for key, value in h.attrs().items():
            f.attrs[key] = value
        self._create(Data.LAYERS, data=np.asarray(h.layer_ids, dtype=np.int32))
        self._create(Data.PHYSICAL_TO_LOGICAL, data=np.asarray(h.physical_to_logical, dtype=np.int32))
        write_layouts(self, h.layouts)

    def _create(self, name: str, data: np.ndarray | None = None, **options: object) -> h5py.Dataset:
        """The one place a dataset is created: with its checksum filter (:mod:`.integrity`)."""
        shape = tuple(data.shape) if data is not None else tuple(options["shape"])  # type: ignore[arg-type]
        dtype = options.get("dtype", data.dtype if data is not None else None)
        return self._file.create_dataset(name, data=data, **options, **integrity.create_options(shape, options.get("maxshape"), dtype))  # type: ignore[arg-type]

    # -- whole datasets ---------------------------------------------------------
    def write(self, name: str, data: np.ndarray, compress: bool = False) -> None:
        """Write a complete dataset ``name`` (e.g. ``"stat/physical_count"``)."""
        self._guard(lambda: self._create(name, data=data, **(self._compression if compress and data.size > 1024 else {})))

    def write_pieces(self, name: str, pieces: list[np.ndarray], axis: int, length: int, compress: bool = False) -> None:
        """Write dataset ``name`` as the first ``length`` entries along ``axis`` of ``pieces``
        laid end to end, without joining them in memory first."""
        first = pieces[0]
        shape = list(first.shape)
        shape[axis] = length
        options = self._compression if compress and int(np.prod(shape)) > 1024 else {}

        def do() -> None:
            dset = self._create(name, shape=tuple(shape), dtype=first.dtype, **options)
            at = 0
            for piece in pieces:
                take = min(piece.shape[axis], length - at)
                if take <= 0:
                    break
                index = [slice(None)] * len(shape)
                index[axis] = slice(at, at + take)
                source = [slice(None)] * len(shape)
                source[axis] = slice(0, take)
                dset[tuple(index)] = piece[tuple(source)]
                at += take

        self._guard(do)

    # -- streamed datasets --------------------------------------------------------
    def append(self, name: str, data: np.ndarray) -> None:
        """Append rows ``[n, ...]`` to a dataset resizable along axis 0, creating it on first use.

        Chunks hold :func:`chunk_rows` rows, sized from the row shape (so a first append of
        zero rows gives the same chunks). Rows are written a chunk's worth per HDF5
        call: h5py holds the GIL through each call, so a background writer never keeps the
        forward thread waiting longer than one chunk's write.
        """
        data = np.ascontiguousarray(data)

        def do() -> None:
            dset = self._streamed(name, data.shape[1:], data.dtype)
            start = dset.shape[0]
            dset.resize(start + data.shape[0], axis=0)
            step = dset.chunks[0]
            at = 0
            while at < data.shape[0]:
                end = min(data.shape[0], at + step - (start + at) % step)  # up to the next chunk boundary
                dset[start + at : start + end] = data[at:end]
                at = end

        self._guard(do)

    def _streamed(self, name: str, row_shape: tuple[int, ...], dtype: np.dtype) -> h5py.Dataset:
        """Dataset ``name`` resizable along axis 0 (created, chunked and filtered, when missing)."""
        if name not in self._file:
            rows = chunk_rows(row_shape, dtype)
            self._create(name, shape=(0, *row_shape), maxshape=(None, *row_shape), dtype=dtype, chunks=(rows, *row_shape), **self._compression)
        return self._file[name]

    def append_from(self, name: str, source: h5py.Dataset, block_bytes: int = 4 << 20) -> None:
        """Append every row of ``source`` (a dataset resizable along axis 0 of another trace) to ``name``.

        When both have the same chunk shape and filters and ``name``'s rows end on a chunk
        boundary, the stored chunks are copied as they are (``read_direct_chunk`` /
        ``write_direct_chunk``: nothing decoded or re-encoded; the Fletcher-32 checksums
        travel with them). Otherwise rows are decoded and appended, ``block_bytes`` at a time.
        """

        def do() -> None:
            dset = self._streamed(name, source.shape[1:], source.dtype)
            start, rows = dset.shape[0], source.shape[0]
            step = dset.chunks[0]
            if rows and start % step == 0 and _same_storage(source, dset):
                dset.resize(start + rows, axis=0)
                tail = (0,) * (source.ndim - 1)
                for at in range(0, rows, step):
                    mask, chunk = source.id.read_direct_chunk((at, *tail))
                    dset.id.write_direct_chunk((start + at, *tail), chunk, mask)
                return
            row_bytes = max(1, source.dtype.itemsize * int(np.prod(source.shape[1:], dtype=np.int64)))
            block = max(1, block_bytes // row_bytes)
            for at in range(0, rows, block):
                self.append(name, np.asarray(source[at : at + block]))

        self._guard(do)

    def ensure_empty(self, name: str, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Create an empty resizable dataset if nothing was appended under ``name``."""
        self._guard(lambda: self._streamed(name, tuple(row_shape), np.dtype(dtype)))

    def copy_group(self, source: TraceWriter | h5py.File, group: str, block_rows: int = 1 << 18) -> None:
        """Copy ``group`` of another open trace (writer or h5py file) into this one.

        A sealed source's chunks are copied as they are (not re-encoded; the Fletcher-32
        checksums travel with them). A source written before checksums is rewritten
        through :meth:`append` / :meth:`write` so that the copy gets them.
        """
        file = source._file if isinstance(source, TraceWriter) else source
        if integrity.is_sealed(file) or not integrity.sealing():
            self._guard(lambda: file.copy(file[group], self._file, name=group))
            return

        def rewrite(name: str, obj: object) -> None:
            if not isinstance(obj, h5py.Dataset):
                return
            target = dataset(group, name)
            if obj.maxshape and obj.maxshape[0] is None:
                self.ensure_empty(target, obj.shape[1:], obj.dtype)
                for start in range(0, obj.shape[0], block_rows):
                    self.append(target, np.asarray(obj[start : start + block_rows]))
            else:
                self.write(target, np.asarray(obj[()]), compress=obj.compression is not None)

        file[group].visititems(rewrite)

    def flush(self) -> None:
        """Push what was written so far to the file (it stays open and incomplete)."""
        self._guard(self._file.flush)

    def set_attr(self, key: str, value: object) -> None:
        self._guard(lambda: self._file.attrs.__setitem__(key, value))

    def _guard(self, action) -> None:  # type: ignore[no-untyped-def]
        try:
            action()
        except Exception as exc:
            raise TraceWriteError(f"writing trace {self.path} failed: {exc}") from exc

    # -- end ----------------------------------------------------------------------
    def commit(self) -> Path:
        """Mark complete, flush, fsync and rename into place; returns the final path."""
        try:
            self._file.attrs[COMPLETE_ATTR] = True
            integrity.seal(self._file, self._tmp)
            self._file.flush()
            self._file.close()
            with open(self._tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(self._tmp, self.path)
        except Exception as exc:
            self.abort()
            raise TraceWriteError(f"finishing trace {self.path} failed: {exc}; nothing was left under that name") from exc
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file; the target name is untouched."""
        file = getattr(self, "_file", None)
        if file is not None:
            try:
                file.close()
            except Exception:
                pass
        try:
            self._tmp.unlink(missing_ok=True)
        except OSError:
            pass
