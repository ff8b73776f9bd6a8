"""Host buffers in shared memory, and arrays that cross to a child process as references into them.

A recording hands its big host buffers to its writer process at every hand-off: a stream's staged
rows (58 MiB per ``per_token`` hand-off at DeepSeek-V3 size) and a checkpoint's window (67 MB).
Down the pipe, each crossing is a copy on the engine's writer thread, in the engine's process (about
20 ms of a core per ``per_token`` hand-off on a 2-core VM, ``benchmarks/pass_breakdown.py``), and
another in the child. A :class:`SharedBuffer` is instead an anonymous shared-memory file (Linux
``memfd``) mapped here; the child maps the same pages through ``/proc/<pid>/fd/<fd>``, and a message
sent with :func:`~moetrace.trace.child.send` ``(share=True)`` carries, for an array that lies in a
live shared buffer, only where it lies (:func:`reference`); :class:`SharedMaps` rebuilds it there as
a read-only view. Nothing is copied on either side.

That is safe because the writer process's calls are synchronous: the engine gives a buffer back to
its pool only after the child answered, and the child keeps no view of an argument past the call
(it writes the rows into HDF5 and returns). Only those calls share; a dump's one-off child, which
works on after its message is sent, gets the bytes.

The pages are freed when this process has closed the buffer and every child that mapped it has
ended: a killed engine leaves nothing behind in ``/dev/shm`` or elsewhere. Where there is no
``memfd`` (not Linux) no buffer is shared and messages carry the bytes, as before.

A process forked after buffers were made would share their pages with its parent (``MAP_SHARED``
survives ``fork``), and a recorder used in both would write into one memory: at ``fork`` the child
therefore swaps each buffer's mapping for private memory holding the same bytes, at the same
address (so every tensor over it stays valid), and stops sharing it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import itertools
import mmap
import os
import pickle
import weakref
from typing import Any

import numpy as np

__all__ = ["SharedBuffer", "SharedMaps", "dumps_sharing", "reference", "sharing_available"]

_TAG = "moetrace-shared"
_serials = itertools.count()

Key = tuple[int, int, int]  # (pid, fd, serial): where a child finds a buffer, and which one it is
Span = tuple[int, int, Key]  # a buffer's first address, its end address, its key


class _Registry:
    """This process's live buffers, by serial. No lock guards it: a buffer's finalizer runs
    wherever the collector does (inside another thread's critical section too, where a lock would
    deadlock), so every change is one atomic dict operation and readers take a copy."""

    def __init__(self) -> None:
        self._spans: dict[int, Span] = {}

    def add(self, serial: int, span: Span) -> None:
        self._spans[serial] = span

    def remove(self, serial: int) -> None:
        self._spans.pop(serial, None)

    def spans(self) -> list[Span]:
        return list(self._spans.copy().values())

    def take_all(self) -> list[Span]:
        """Every span, the registry emptied."""
        spans = self.spans()
        self._spans.clear()
        return spans


_live = _Registry()


def sharing_available() -> bool:
    """Whether this platform has the anonymous shared memory :class:`SharedBuffer` uses (Linux ``memfd``)."""
    return hasattr(os, "memfd_create")


class SharedBuffer:
    """``nbytes`` (> 0) of an anonymous shared-memory file, mapped read-write here as :attr:`map`
    (a writable buffer: ``torch.frombuffer`` or ``np.frombuffer`` over it share its pages).

    While this object lives, :func:`reference` finds arrays that lie in it; a child maps it by
    :attr:`key` (:class:`SharedMaps`).

    Raises:
        OSError: no shared memory here (:func:`sharing_available` is false) or none left.
    """

    def __init__(self, nbytes: int) -> None:
        if not sharing_available():
            raise OSError("no anonymous shared memory (memfd) on this platform")
        serial = next(_serials)
        fd = os.memfd_create(f"moetrace-{serial}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)  # MAP_SHARED, read-write
        except BaseException:
            os.close(fd)
            raise
        self.key: Key = (os.getpid(), fd, serial)
        view = np.frombuffer(self.map, dtype=np.uint8)
        address = int(view.__array_interface__["data"][0])
        del view  # a live export would keep the map from closing
        _live.add(serial, (address, address + nbytes, self.key))
        weakref.finalize(self, _forget, serial, fd, os.getpid())  # kept by weakref's own registry until it runs


def _forget(serial: int, fd: int, owner: int) -> None:
    """A buffer is gone: no more references into it, and its file closed by the process that
    made it (a child that mapped it keeps its pages; a forked child closed its copy at the fork,
    and the number may name another file there since)."""
    _live.remove(serial)
    if os.getpid() == owner:
        os.close(fd)


def reference(obj: object) -> tuple[Any, ...] | None:
    """Where ``obj`` lies when it is a numpy array wholly inside a live :class:`SharedBuffer`:
    ``(tag, key, offset, shape, dtype, strides)``; ``None`` for anything else (sent as it is)."""
    if type(obj) is not np.ndarray or obj.size == 0 or obj.dtype.kind in "OV":
        return None
    if any(stride < 0 for stride in obj.strides):
        return None
    start = int(obj.__array_interface__["data"][0])
    end = start + sum((n - 1) * stride for n, stride in zip(obj.shape, obj.strides, strict=True)) + obj.itemsize
    for first, last, key in _live.spans():
        if first <= start and end <= last:
            return (_TAG, key, start - first, obj.shape, obj.dtype.str, obj.strides)
    return None


class _SharingPickler(pickle.Pickler):
    """A pickler that writes arrays in live shared buffers as references (:func:`reference`)."""

    def persistent_id(self, obj: Any) -> Any:
        """Pickle's hook: :func:`reference`."""
        return reference(obj)


def dumps_sharing(message: object, buffer_callback: Any) -> bytes:
    """``pickle.dumps(message, protocol=5, buffer_callback=...)``, arrays in shared buffers as references."""
    out = io.BytesIO()
    _SharingPickler(out, protocol=5, buffer_callback=buffer_callback).dump(message)
    return out.getvalue()


class SharedMaps:
    """A child's side: the parents' shared buffers it has mapped (read-only, by key, each once)
    and the unpickler that rebuilds references as arrays over them."""

    def __init__(self) -> None:
        self._maps: dict[Key, mmap.mmap] = {}

    def map(self, key: Key) -> mmap.mmap:
        """Buffer ``key`` mapped read-only here.

        Raises:
            OSError: it cannot be opened (its process or file is gone, or ``/proc/<pid>/fd`` is not ours to read).
        """
        mapped = self._maps.get(tuple(key))  # type: ignore[arg-type]
        if mapped is None:
            pid, fd, _ = key
            opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
            try:
                mapped = self._maps[tuple(key)] = mmap.mmap(opened, 0, access=mmap.ACCESS_READ)  # type: ignore[index]
            finally:
                os.close(opened)
        return mapped

    def probe(self, key: Key, size: int) -> bytes:
        """The first ``size`` bytes of buffer ``key`` (the parent checks them before it shares)."""
        return bytes(self.map(key)[:size])

    def loads(self, head: bytes | bytearray, buffers: list[bytearray]) -> object:
        """Unpickle ``head`` (out-of-band ``buffers``), references rebuilt as read-only arrays."""
        maps = self

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                tag, key, offset, shape, dtype, strides = pid
                if tag != _TAG:
                    raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
                return np.ndarray(shape, dtype=np.dtype(dtype), buffer=maps.map(key), offset=offset, strides=strides)

        return _Unpickler(io.BytesIO(head), buffers=buffers).load()


_PROT_READ_WRITE = 0x1 | 0x2
_MAP_PRIVATE_ANONYMOUS_FIXED = 0x02 | 0x20 | 0x10


def _privatize_after_fork() -> None:
    """In a forked child: each live buffer becomes private memory with the same bytes at the same
    address (see the module docstring), and is no longer shared.

    The collector is off meanwhile: buffers that were garbage in reference cycles at the fork, not
    yet collected, are live here too, and a collection set off by this hook's own allocations
    would free them, unmapping pages while they are copied (the child died of SIGSEGV)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        _privatize(_live.take_all())
    finally:
        if collecting:
            gc.enable()


def _privatize(inherited: list[Span]) -> None:
    """Each of the ``inherited`` spans swapped for private memory holding the same bytes, its file closed."""
    if not inherited:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for first, last, key in inherited:
        size = last - first
        saved = ctypes.create_string_buffer(size)
        ctypes.memmove(saved, first, size)
        if libc.mmap(first, size, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS_FIXED, -1, 0) != first:
            raise OSError(ctypes.get_errno(), f"could not give the forked process a private copy of shared buffer {key}")
        ctypes.memmove(first, saved, size)
        with contextlib.suppress(OSError):
            os.close(key[1])  # the inherited file: this process no longer uses it


if sharing_available():
    os.register_at_fork(after_in_child=_privatize_after_fork)
