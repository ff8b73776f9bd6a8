"""Run every trace-reading CLI command on seeded damaged traces, fast and hang-proof.

A subprocess per (file, command) costs an interpreter start and the imports each time; one
process for everything cannot be stopped when HDF5 loops in C (no Python signal handler runs
while it holds the GIL). So a few long-lived worker processes (``spawn``) each run the typer app
in-process on one case after another, and the parent owns the clock: a worker announces each
command before it runs it, and the parent ``SIGKILL``s a worker whose command passes the bound,
records a hang, and starts a replacement for the rest of the queue.

Each worker damages its own copy of a kind's files (``traces.corrupt`` with the case's seed),
in its own directory, and names every file by a relative path, so that a command's output is
the same bytes whichever worker ran it and can be compared with the undamaged file's.

Used by ``tests/integrity/test_fuzz.py`` (a seeded sample) and ``benchmarks/fuzz_commands.py``
(the full size).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import multiprocessing
import os
import shutil
import time
import traceback
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path

import h5py
import numpy as np

__all__ = ["COMMANDS", "KINDS", "Outcome", "Pool", "Source", "Task", "build_sources", "check", "content", "tasks_for"]

KINDS = ("stat", "per_pass", "per_token", "timing", "routing", "merged", "recovered", "converted", "segment", "checkpoint", "sglang_pt")
COMMANDS = ("analyze", "inspect", "diff", "placement", "plot", "merge", "recover", "verify", "timeline", "report", "why", "convert")
"""Every command that reads a trace (``why`` is ``replicas why``; ``convert`` reads SGLang ``.pt`` dumps)."""
TOP_K = 2
OUT = "out/written.h5"
PRISTINE = "pristine.h5"
"""The undamaged copy beside each kind's files (what ``diff`` compares with)."""
WHY_REQUEST = "5"
"""The request ``replicas why`` explains in the replica trace (the first row of the replay's ``/requests``)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One kind's undamaged files: ``directory`` holds them; ``trace`` and ``run`` are relative to it."""

    kind: str
    directory: Path
    trace: str
    run: str | None
    layout: object  # traces.Layout


@dataclasses.dataclass(frozen=True)
class Task:
    """Commands to run on case ``case`` of ``kind`` (``case`` -1: the undamaged file)."""

    kind: str
    case: int
    mutation: str
    commands: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one command gave: ``code`` the exit status (``None``: it hung, ``-1``: the worker died);
    digests of stdout and of what it wrote; whether it said why it refused (a ``moetrace: error:`` line,
    or verify's report of what is damaged); the tail of its output; a traceback when it raised."""

    code: int | None
    said_why: bool = False
    stdout: str = ""
    written: str = ""
    output: str = ""
    raised: str = ""
    seconds: float = 0.0


def content(path: Path) -> dict[str, object]:
    """What a written trace holds: every dataset's bytes and every attribute except the
    ones that name the moment of writing (``created_unix``, and the root digest over it)."""
    out: dict[str, object] = {}
    with h5py.File(path, "r") as f:
        out["/"] = {k: repr(v) for k, v in f.attrs.items() if k not in ("created_unix", "checksum")}

        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.dtype.str, obj.shape, np.asarray(obj[()]).tobytes() if obj.dtype.kind != "O" else repr(obj[()]))

        f.visititems(visit)
    return out


def build_sources(root: Path, kinds: Iterable[str] = KINDS) -> dict[str, Source]:
    """Write one undamaged trace of each kind under ``root/<kind>`` through moetrace's own writers, with
    its undamaged copy (:data:`PRISTINE`) beside it."""
    from .traces import build, layout_of

    sources = {}
    for kind in kinds:
        directory = Path(root) / kind
        trace, run = build(kind, directory / "files")
        shutil.copy(trace, directory / PRISTINE)
        run_rel = str(run.relative_to(directory)) if run is not None else None
        sources[kind] = Source(kind, directory, str(trace.relative_to(directory)), run_rel, layout_of(trace))
    return sources


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()


def _args(command: str, kind: str, trace: str, run: str | None) -> list[str] | None:
    """The command line of ``command`` on ``trace``; ``None`` where the command does not read this kind."""
    pt = kind == "sglang_pt"
    if pt != (command == "convert") or (command == "recover" and run is None) or (command == "why" and kind != "routing"):
        return None
    return {
        "analyze": ["analyze", trace, "--json", "--no-progress"],
        "inspect": ["inspect", trace, "--json"],
        "diff": ["diff", trace, PRISTINE, "--json"],
        "placement": ["placement", trace, "--gpus", "2", "--json"],
        "plot": ["plot", trace, "-o", "out/written.png", "--no-progress"],
        "merge": ["merge", trace, "-o", OUT],
        "recover": ["recover", str(run), "-o", OUT, "--force"],
        "verify": ["verify", trace, "--json"],
        "timeline": ["timeline", trace, "-o", "out/written.json"],
        "report": ["report", trace, "-o", "out/written.html"],
        "why": ["replicas", "why", trace, WHY_REQUEST, "--json"],
        "convert": ["convert", trace, "-o", OUT, "--top-k", str(TOP_K), "--world-size", "2", "--run-id", "fuzzrun"],
    }[command]


def tasks_for(kinds: Iterable[str], cases: int, commands: Sequence[str] = COMMANDS, every: dict[str, int] | None = None) -> list[Task]:
    """The undamaged run of every kind, then ``cases`` damaged files per kind, mutations in turn
    (``traces.MUTATIONS``); ``every[command] = n`` runs ``command`` on every n-th case only."""
    from .traces import MUTATIONS

    every = every or {}
    out = [Task(kind, -1, "none", tuple(commands)) for kind in kinds]
    for kind in kinds:
        for case in range(cases):
            chosen = tuple(c for c in commands if case % every.get(c, 1) == 0)
            out.append(Task(kind, case, MUTATIONS[case % len(MUTATIONS)], chosen))
    return out


# ----------------------------------------------------------------------------- worker
def _run_one(command: str, kind: str, trace: str, run: str | None) -> Outcome | None:
    from moetrace.cli.app import app
    from typer.testing import CliRunner

    args = _args(command, kind, trace, run)
    if args is None:
        return None
    out = Path("out")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    start = time.perf_counter()
    result = CliRunner().invoke(app, args, catch_exceptions=True)
    seconds = time.perf_counter() - start
    raised = ""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raised = "".join(traceback.format_exception(result.exception))
    written: object = None
    if result.exit_code == 0 and command in ("merge", "recover", "convert"):
        written = {p.name: content(p) for p in sorted(out.glob("written*.h5"))}
    elif result.exit_code == 0 and command in ("timeline", "plot", "report"):
        written = {p.name: p.read_bytes() for p in sorted(out.iterdir())} if command != "report" else sorted(p.name for p in out.iterdir())
    said_why = "moetrace: error:" in result.output or (command == "verify" and '"intact": false' in result.stdout)
    return Outcome(result.exit_code, said_why, _digest(result.stdout), _digest(written), result.output[-3000:], raised, seconds)


def _worker(conn: Connection, home: str, sources: dict[str, Source], seed: int) -> None:
    """Serve tasks from ``conn`` until it closes: for each command, send ``("start", command)`` and
    then ``("done", command, Outcome | None)``; ``("end",)`` after the task's last command."""
    import functools

    import typer.testing

    from .traces import corrupt

    # The click command typer builds from the app is the same for every run: build it once per worker
    # (0.8 s of every invocation otherwise, on a loaded 2-core box).
    typer.testing._get_command = functools.cache(typer.testing._get_command)  # type: ignore[attr-defined]
    os.environ.setdefault("MPLBACKEND", "Agg")
    Path(home).mkdir(parents=True, exist_ok=True)
    os.chdir(home)
    pristine: dict[str, bytes] = {}
    while True:
        try:
            task: Task = conn.recv()
        except EOFError:
            return
        source = sources[task.kind]
        if task.kind not in pristine:  # this worker's own copy of the kind's files
            shutil.rmtree(task.kind, ignore_errors=True)
            shutil.copytree(source.directory, task.kind)
            pristine[task.kind] = (source.directory / source.trace).read_bytes()
        os.chdir(task.kind)
        try:
            data = pristine[task.kind]
            if task.case >= 0:
                rng = np.random.default_rng((seed, KINDS.index(task.kind), task.case))
                data = corrupt(data, task.mutation, rng, source.layout)  # type: ignore[arg-type]
            Path(source.trace).write_bytes(data)
            for command in task.commands:
                conn.send(("start", command))
                conn.send(("done", command, _run_one(command, task.kind, source.trace, source.run)))
        finally:
            os.chdir("..")
        conn.send(("end",))


# ----------------------------------------------------------------------------- parent
class Pool:
    """``workers`` long-lived processes that run :class:`Task` s; a command past ``bound_s`` seconds
    kills its worker (recorded as a hang, ``Outcome(code=None)``) and a fresh one takes its place.

    Args:
        sources: each kind's undamaged files.
        scratch: a directory for the workers' copies (one sub-directory per worker process).
        workers: worker processes (each runs one command at a time).
        bound_s: the most one command may take.
        seed: the damage seed (``numpy`` ``default_rng((seed, kind index, case))``).
    """

    def __init__(self, sources: dict[str, Source], scratch: Path, workers: int, bound_s: float, seed: int) -> None:
        self.sources, self.scratch, self.bound_s, self.seed = sources, Path(scratch), bound_s, seed
        self._context = multiprocessing.get_context("spawn")
        self._started = 0
        self._idle: list[tuple[multiprocessing.Process, Connection]] = [self._spawn() for _ in range(workers)]
        self.replaced = 0

    def _spawn(self) -> tuple[multiprocessing.Process, Connection]:
        parent, child = self._context.Pipe()
        home = self.scratch / f"worker{self._started}"
        self._started += 1
        process = self._context.Process(target=_worker, args=(child, str(home), self.sources, self.seed), daemon=True)
        process.start()
        child.close()
        return process, parent

    def run(self, tasks: Iterable[Task]) -> dict[tuple[str, int, str], Outcome]:
        """Every task's outcomes, keyed ``(kind, case, command)`` (commands that do not read the kind: absent)."""
        queue = collections.deque(tasks)
        results: dict[tuple[str, int, str], Outcome] = {}
        busy: dict[Connection, tuple[multiprocessing.Process, Task, list[str], float, str | None]] = {}
        while queue or busy:
            while queue and self._idle:
                process, conn = self._idle.pop()
                task = queue.popleft()
                conn.send(task)
                busy[conn] = (process, task, list(task.commands), float("inf"), None)
            deadline = min(entry[3] for entry in busy.values())
            ready = wait(list(busy), timeout=max(0.0, deadline - time.monotonic()) if deadline != float("inf") else None)
            for conn in ready:
                process, task, left, _, _ = busy[conn]
                try:
                    message = conn.recv()
                except EOFError:  # the worker died (a crash in C): the command it ran gets code -1
                    self._replace(busy, conn, results, Outcome(-1, output=f"worker exit code {process.exitcode}"), queue)
                    continue
                if message[0] == "start":
                    busy[conn] = (process, task, left, time.monotonic() + self.bound_s, message[1])
                elif message[0] == "done":
                    if message[2] is not None:
                        results[(task.kind, task.case, message[1])] = message[2]
                    left.remove(message[1])
                    busy[conn] = (process, task, left, float("inf"), None)
                else:
                    del busy[conn]
                    self._idle.append((process, conn))
            now = time.monotonic()
            for conn in [c for c, entry in busy.items() if entry[3] <= now]:
                self._replace(busy, conn, results, Outcome(None, output=f"still running after {self.bound_s} s"), queue)
        return results

    def _replace(self, busy: dict, conn: Connection, results: dict, outcome: Outcome, queue: collections.deque) -> None:
        """Kill ``conn``'s worker, record ``outcome`` for its running command, queue what it had left, start another."""
        process, task, left, _, command = busy.pop(conn)
        process.kill()
        process.join(60)
        conn.close()
        if command is not None:
            results[(task.kind, task.case, command)] = outcome
            left.remove(command)
        if left:
            queue.appendleft(dataclasses.replace(task, commands=tuple(left)))
        self.replaced += 1
        self._idle.append(self._spawn())

    def close(self) -> None:
        for process, conn in self._idle:
            conn.close()
            process.join(60)
            if process.is_alive():
                process.kill()
                process.join(60)
        self._idle.clear()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check(results: dict[tuple[str, int, str], Outcome]) -> tuple[dict[tuple[str, str], collections.Counter], list[str], dict[str, float]]:
    """``(tally, failures, slowest)``: per ``(kind, command)`` how many damaged cases were refused (exit 2
    with a message) or answered as the undamaged file (exit 0, same stdout and written files); every
    exit 1, traceback, hang, crash or different answer as a failure line; the slowest run per command."""
    tally: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    slowest: dict[str, float] = collections.defaultdict(float)
    for (kind, case, command), got in sorted(results.items()):
        slowest[command] = max(slowest[command], got.seconds)
        where = f"{kind} case {case} {command}"
        if got.raised or got.code not in (0, 2):
            failures.append(f"{where}: {'hung' if got.code is None else f'exit {got.code}'}\n{got.raised or got.output}")
            continue
        if case < 0:
            continue
        want = results.get((kind, -1, command))
        if want is None or want.code is None:
            failures.append(f"{where}: no undamaged answer to compare with")
        elif got.code == 0:
            if (got.code, got.stdout, got.written) != (want.code, want.stdout, want.written):
                failures.append(f"{where}: exit 0 with a different answer\n{got.output}")
            else:
                tally[(kind, command)]["identical"] += 1
        elif got.said_why:
            tally[(kind, command)]["refused"] += 1
        else:
            failures.append(f"{where}: exit 2 without a message\n{got.output}")
    return tally, failures, dict(slowest)
