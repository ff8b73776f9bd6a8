"""Open HDF5 files for reading so that damaged metadata is refused instead of looping forever.

Every structure HDF5 reads from a file written with ``libver="latest"`` carries a metadata
checksum (superblock, object headers, B-trees, fractal heaps: a damaged one is refused by
HDF5 itself) except one: the **global heap collection** (signature ``GCOL``), where HDF5 keeps
variable-length data, i.e. every string attribute moetrace writes (``engine``, ``model``,
``run_id``...) and variable-length string datasets. HDF5 walks a collection's objects by
their stored sizes; an object whose size is zero (a zeroed block over the collection: the
signature and the collection's size intact, the objects after them gone) never advances the
walk, and HDF5 spins in C code forever, holding the GIL, so no Python timeout can stop it.

:func:`open_hdf5` opens the file through h5py's file-object driver with a raw file that looks
at every block HDF5 reads: a read that starts a global heap collection (HDF5 reads each
collection from its first byte, outside the metadata accumulator) is checked first, by
walking its objects the way HDF5 will (:func:`collection_damage`), and a collection HDF5
could not walk to its end is refused: the read fails and HDF5 raises, which
:func:`~moetrace.trace.integrity.reading` turns into a :class:`TraceDamageError`.

With that guard every read of a trace does work linear in the bytes it reads: no loop in
HDF5 is left whose bound comes from unchecked bytes (``docs/trace-format.md``, "Time
bound on damaged input"). The check costs one comparison of 4 bytes per block read and a
walk of each collection once per open file (a few hundred bytes for a trace's attributes).
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import struct
from pathlib import Path

import h5py

__all__ = ["GuardedFile", "collection_damage", "open_hdf5"]

_SIGNATURE = b"GCOL"
_HEADER = 16  # signature 4, version 1, reserved 3, collection size 8 (moetrace files: 8-byte lengths)
_OBJECT_HEADER = 16  # heap object index 2, reference count 2, reserved 4, object size 8


def collection_damage(block: bytes, at: int, file_size: int) -> str | None:
    """What makes the global heap collection ``block`` (its bytes, starting at byte ``at`` of a
    file of ``file_size`` bytes) unreadable, or ``None`` when HDF5 can walk it to its end.

    Mirrors HDF5's walk (``H5HG__cache_heap_deserialize``): objects follow the 16-byte header;
    object 0 is the free space and its size counts its own header; any other object takes its
    16-byte header plus its size rounded up to 8 bytes; fewer than 16 bytes left end the walk.
    """
    if len(block) < _HEADER:
        return f"the global heap collection at byte {at} is cut short"
    version = block[4]
    size = struct.unpack_from("<Q", block, 8)[0]
    if version != 1:
        return f"the global heap collection at byte {at} has version {version} (only 1 exists)"
    if size < _HEADER or at + size > file_size:
        return f"the global heap collection at byte {at} claims {size} bytes, the file holds {file_size - at} from there"
    if len(block) < size:
        return f"the global heap collection at byte {at} is cut short"
    offset = _HEADER
    while size - offset >= _OBJECT_HEADER:
        index, _, _, length = struct.unpack_from("<HHIQ", block, offset)
        need = length if index == 0 else _OBJECT_HEADER + (length + 7) // 8 * 8
        if need == 0 or need > size - offset:
            return (f"the global heap collection at byte {at} has object {index} at byte {at + offset} of {length} bytes, "
                    f"which {'never ends' if need == 0 else 'runs past the collection'}")
        offset += need
    return None


class GuardedFile(io.FileIO):
    """A raw file that refuses to hand HDF5 a global heap collection it could not walk
    (see the module docstring); every other read passes through unchanged."""

    def __init__(self, path: Path | str, locking: bool = True) -> None:
        super().__init__(path, "r")
        self._size = os.fstat(self.fileno()).st_size
        self._checked: set[int] = set()
        if locking and os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() != "FALSE":
            self._lock_shared(path)
        self._refuse_open_for_write(path)

    def _refuse_open_for_write(self, path: Path | str) -> None:
        """HDF5's own driver refuses a file whose superblock (v2/v3) still says a writer has it
        open (consistency flags: write or SWMR-write access; a running writer, or one killed
        before it closed the file); through the file-object driver HDF5 skips that check."""
        head = os.pread(self.fileno(), 12, 0)
        if len(head) == 12 and head[:8] == b"\x89HDF\r\n\x1a\n" and head[8] >= 2 and head[11] & 0b101:
            self.close()
            raise OSError(errno.EBUSY, f"unable to open {path}: its superblock says a writer has it open (the writer is running, or was killed before closing it)")

    def _lock_shared(self, path: Path | str) -> None:
        """Take the shared ``flock`` HDF5's own driver takes on a file it reads (the file-object
        driver takes none): a writer's exclusive lock refuses the open, as with plain h5py, and
        retention (:func:`~moetrace.trace.files.exclusively`) sees the reader."""
        try:
            fcntl.flock(self.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno == errno.ENOSYS:  # a file system without locks: HDF5 goes on without too
                return
            self.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise OSError(exc.errno, f"unable to lock file {path}: another process is writing it") from None
            raise

    def readinto(self, buffer: object) -> int:  # type: ignore[override]
        at = self.tell()
        count = super().readinto(buffer)  # type: ignore[arg-type]
        if count and count >= 4 and at not in self._checked and bytes(memoryview(buffer)[:4]) == _SIGNATURE:  # type: ignore[arg-type]
            self._check(at)
        return count  # type: ignore[return-value]

    def _check(self, at: int) -> None:
        header = os.pread(self.fileno(), _HEADER, at)
        size = struct.unpack_from("<Q", header, 8)[0] if len(header) == _HEADER else 0
        block = os.pread(self.fileno(), min(size, max(self._size - at, 0)), at) if 0 < size <= self._size - at else header
        problem = collection_damage(block, at, self._size)
        if problem is not None:
            raise OSError(f"{problem}; HDF5 would loop over it")
        self._checked.add(at)


class _File(h5py.File):
    """An :class:`h5py.File` over a :class:`GuardedFile`; closing it closes the raw file too."""

    def __init__(self, path: Path, locking: bool = True, **options: object) -> None:
        self._raw = GuardedFile(path, locking)
        self._path = str(path)
        try:
            super().__init__(self._raw, "r", **options)
        except BaseException:
            self._raw.close()
            raise

    @property
    def filename(self) -> str:
        """The path the file was opened from (h5py would name the raw file object)."""
        return self._path

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def open_hdf5(path: Path | str, locking: bool = True, **options: object) -> h5py.File:
    """``h5py.File(path, "r", locking=locking, **options)`` with the global heap guard: use it for
    every file moetrace reads. HDF5 failures (damage included) raise as they would from h5py;
    ``locking=False`` skips the shared lock (a caller that holds the file's exclusive lock itself)."""
    return _File(Path(path), locking, **options)
