"""Multi-rank launcher: spawn one process per rank, set up torch.distributed, return results.

``launch(fn, world_size, *args)`` starts ``world_size`` processes with the
``spawn`` method, initialises a process group in each (gloo on CPU, NCCL when
CUDA is available, on a free port of 127.0.0.1), calls
``fn(rank, world_size, *args)`` and returns the list of per-rank return values
(they must be picklable). An exception in any worker is re-raised in the
parent as :class:`WorkerError` with the rank and the worker's traceback.

With ``tolerate_deaths=True`` a rank that dies (a signal, ``os._exit``) does not
fail the run: the others finish, and the dead rank's entry in the result is a
:class:`RankDeath` saying how it died (also logged as a warning). A rank that
*raises* still fails the run.

``fn`` must be importable by the children (a module-level function), as
``spawn`` requires. Time steady state inside ``fn`` with :func:`timed_steps`,
which excludes spawn and process-group set-up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankDeath", "WorkerError", "default_backend", "describe_exit", "free_port", "launch", "timed_steps"]

_log = logging.getLogger("moetrace")


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from its exit code: ``"killed by signal SIGKILL (9)"``, ``"exited with code 3"``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by signal {name} ({-exitcode})"
    return f"exited with code {exitcode}"


@dataclasses.dataclass(frozen=True)
class RankDeath:
    """A rank that died without reporting (``launch(..., tolerate_deaths=True)``)."""

    rank: int
    exitcode: int

    @property
    def how(self) -> str:
        return describe_exit(self.exitcode)

    def __str__(self) -> str:
        return f"rank {self.rank} died: {self.how}"


class WorkerError(RuntimeError):
    """A worker raised (or died); carries the rank and its traceback text."""

    def __init__(self, rank: int, details: str) -> None:
        super().__init__(f"rank {rank} failed:\n{details}")
        self.rank = rank
        self.details = details


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_nccl_devices(world_size: int, devices: int) -> None:
    """NCCL needs a GPU of its own per rank (it refuses two ranks on one device: "Duplicate GPU detected")."""
    if devices == 0:
        raise ValueError("backend='nccl' needs CUDA devices; use backend='gloo' on CPU")
    if world_size > devices:
        raise ValueError(
            f"backend='nccl' with world_size={world_size} needs {world_size} GPUs (one per rank) but {devices} "
            f"{'is' if devices == 1 else 'are'} visible; use world_size<={devices}, or backend='gloo' for more ranks"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, backend: str, port: int, threads: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # launch() checked there is one device per rank
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # ``fn`` may have torn it down itself (as vLLM's workers do before exit)
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    threads_per_rank: int | None = None,
    timeout: float = 300.0,
    tolerate_deaths: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results by rank.

    Args:
        fn: module-level function (picklable by reference).
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``; default :func:`default_backend`.
        threads_per_rank: torch intra-op threads per rank; default splits the
            machine's cores evenly (at least 1).
        timeout: seconds to wait for all ranks before failing.
        tolerate_deaths: a rank that dies without reporting becomes a
            :class:`RankDeath` in the result instead of failing the run.

    Raises:
        WorkerError: a rank raised, died (without ``tolerate_deaths``), or the
            run exceeded ``timeout``.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    backend = backend or default_backend()
    if backend == "nccl":
        _check_nccl_devices(world_size, torch.cuda.device_count())
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, backend, port, threads, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    failed = True
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead and not tolerate_deaths:
                    raise WorkerError(dead[0][0], f"process {describe_exit(dead[0][1])} before reporting") from None
                for i, code in dead:
                    values[i] = RankDeath(i, code)
                    _log.warning("moetrace launcher: %s", values[i])
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise WorkerError(missing[0], f"no result after {timeout:.0f} s (ranks {missing} still running)") from None
                continue
            if not ok:
                raise WorkerError(rank, value)
            values[rank] = value
        failed = False
    finally:
        # After a failure the other ranks may wait forever in a collective: end them at once.
        for proc in procs:
            proc.join(timeout=0.1 if failed else 30.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return [values[rank] for rank in range(world_size)]


def timed_steps(step: Callable[[], Any], *, warmup: int = 3, iters: int = 10, barrier: bool = True) -> float:
    """Seconds per call of ``step`` in steady state (after ``warmup`` calls).

    With ``barrier`` and an initialised process group, ranks start and stop the
    clock together, so the figure is the slowest rank's.
    """
    sync = barrier and dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if sync:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if sync:
        dist.barrier()
    return (time.perf_counter() - start) / iters
