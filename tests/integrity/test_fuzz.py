"""Seeded fuzz: every kind of trace moetrace writes, damaged as a disk or a copy would, through
the readers and every command, each read under a watchdog.

Kinds: stat, per_pass, per_token, timing, routing ``/requests``, merged, recovered, converted,
a streaming segment, a stat checkpoint, and an SGLang ``.pt`` dump (what ``convert`` reads).
Mutations, in turn (seeded): a bit flip, a 2 KiB zeroed block anywhere, a zeroed block over an
HDF5 metadata structure (superblock, object headers, B-trees, heaps, free-space managers,
found by signature), a zeroed block inside a chunk, a truncation, two chunks of one dataset
swapped on disk (``traces.corrupt``).

Two tiers, so that over 1,000 damaged files fit in CI:

- **Readers** (``READ_CASES`` per kind, env ``MOETRACE_FUZZ_READ_CASES``, default 100): the
  library entry point every command reads through (``open_trace`` and then every dataset it
  holds; ``read_requests`` for replica traces; ``convert_sglang`` for ``.pt``) must raise a
  ``TraceError`` or return exactly what the undamaged file gives.
- **Commands** (``FUZZ_CASES`` per kind, env ``MOETRACE_FUZZ_CASES``, default 4; ``report`` and
  ``plot`` on every ``REPORT_EVERY``-th case): every command that reads a trace (``analyze``,
  ``inspect``, ``diff``, ``placement``, ``plot``, ``merge``, ``recover`` on the run directory,
  ``verify``, ``timeline``, ``report``, ``replicas why`` on the replica trace, ``convert`` of the
  ``.pt``) through the typer app, in ``WORKERS`` long-lived worker processes (``pool.Pool``); the
  parent kills a worker whose command runs past ``COMMAND_BOUND_S`` and records a hang. Each must
  exit 0 with exactly the output (and written files) it gives for the undamaged file, or exit 2
  with a ``moetrace: error:`` line / a verify report. Exit 1, a traceback, a hang, a crash or a
  different answer fails the test. The full size (1,001+ files x every command) is
  ``benchmarks/fuzz_commands.py`` (``make fuzz``).

Every read runs under ``faulthandler.dump_traceback_later(BOUND_S, exit=True)``: HDF5 loops in C
holding the GIL, where no Python timeout reaches, so a hang ends the run with the stack of the loop
instead of stalling CI. ``MOETRACE_FUZZ_TALLY=path.json``
writes the tallies and the slowest case that docs/trace-format.md shows.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import h5py
import numpy as np
import pytest

from moetrace.trace import open_trace
from moetrace.trace.convert import convert_sglang
from moetrace.trace.integrity import reading
from moetrace.trace.replica_requests import read_requests
from moetrace.trace.safe_open import open_hdf5
from moetrace.trace.schema import TraceError

from .pool import COMMANDS, KINDS, Pool, build_sources, check, content, tasks_for
from .traces import MUTATIONS, TOP_K, build, corrupt, layout_of

READ_CASES = int(os.environ.get("MOETRACE_FUZZ_READ_CASES", "100"))
FUZZ_CASES = int(os.environ.get("MOETRACE_FUZZ_CASES", "4"))
REPORT_EVERY = int(os.environ.get("MOETRACE_FUZZ_REPORT_EVERY", "4"))
WORKERS = int(os.environ.get("MOETRACE_FUZZ_WORKERS", "2"))
BOUND_S = 300  # per read or command of these small files: milliseconds each unloaded, seconds on a loaded CI box; only a loop reaches it
COMMAND_BOUND_S = BOUND_S
SEED = 28
TALLY: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
SLOWEST: dict[str, float] = collections.defaultdict(float)


@contextmanager
def watchdog(what: str):
    """Kill the run with every thread's stack if the block runs past :data:`BOUND_S`; record its time."""
    faulthandler.dump_traceback_later(BOUND_S, exit=True)
    start = time.perf_counter()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        SLOWEST[what] = max(SLOWEST[what], time.perf_counter() - start)


def _read(kind: str, path: Path, out: Path) -> object:
    """Everything the library reads from ``path``: the answer a reader gets (raises TraceError)."""
    if kind == "sglang_pt":
        out.unlink(missing_ok=True)
        return content(convert_sglang(path, out, top_k=TOP_K, run_id="fuzzrun", world_size=2))
    if kind == "routing":
        table = read_requests(path)
        return {field.name: _plain(getattr(table, field.name)) for field in dataclasses.fields(table)}
    with open_trace(path) as trace:
        answer: dict[str, object] = {"attrs": repr(sorted(trace.attrs.items())), "layers": trace.layers.tobytes()}
        with reading(path), open_hdf5(path) as f:
            names: list[str] = []
            f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in sorted(names):
            data = trace._read(name)
            answer[name] = data.tobytes() if data.dtype.kind != "O" else repr(data)
        if trace.has("stat/num_tokens"):
            answer["served"] = trace.tokens_served()  # runs the /stat and /window invariants
        return answer


def _plain(value: object) -> object:
    """Arrays as their bytes (``repr`` would elide the middle of long ones), dicts and tuples inside out."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes() if value.dtype.kind != "O" else repr(value.tolist()))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


@pytest.fixture(scope="module", params=KINDS)
def built(request, tmp_path_factory):
    """``(kind, trace, run directory, pristine copy, its bytes, its layout, scratch output)``."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    trace, run_dir = build(kind, tmp / kind)
    pristine = tmp / f"pristine{trace.suffix}"
    shutil.copy(trace, pristine)
    out = tmp / "out" / "written.h5"
    out.parent.mkdir()
    return kind, trace, run_dir, pristine, pristine.read_bytes(), layout_of(pristine), out


def test_damaged_files_are_refused_or_read_identically_by_the_readers(built):
    kind, trace, _, _, pristine_bytes, layout, out = built
    with watchdog("read"):
        want = _read(kind, trace, out)
    for case in range(READ_CASES):
        mutation = MUTATIONS[case % len(MUTATIONS)]
        rng = np.random.default_rng((SEED, KINDS.index(kind), case, 1))
        trace.write_bytes(corrupt(pristine_bytes, mutation, rng, layout))
        try:
            with watchdog("read"):
                got = _read(kind, trace, out)
        except TraceError:
            TALLY[(kind, "read")]["refused"] += 1
        else:
            assert got == want, f"{kind}/{mutation}#{case}: read without error but differently"
            TALLY[(kind, "read")]["identical"] += 1
    trace.write_bytes(pristine_bytes)


def test_damaged_files_are_refused_or_answered_identically_by_every_command(tmp_path_factory):
    """Every trace-reading command on ``FUZZ_CASES`` damaged files of every kind, in ``WORKERS``
    long-lived worker processes (``pool.Pool``): each run must exit 0 with the undamaged file's
    answer or exit 2 saying why, within ``COMMAND_BOUND_S`` (the parent kills a worker past it)."""
    root = tmp_path_factory.mktemp("commands")
    sources = build_sources(root / "sources")
    tasks = tasks_for(KINDS, FUZZ_CASES, every={"report": REPORT_EVERY, "plot": REPORT_EVERY})
    with Pool(sources, root / "workers", workers=WORKERS, bound_s=COMMAND_BOUND_S, seed=SEED) as pool:
        results = pool.run(tasks)
    tally, failures, slowest = check(results)
    for key, counts in tally.items():
        TALLY[key].update(counts)
    for command, seconds in slowest.items():
        SLOWEST[command] = max(SLOWEST[command], seconds)
    assert not failures, f"{len(failures)} of {len(results)} runs failed:\n" + "\n\n".join(failures[:10])
    # every command ran on every kind it reads, the undamaged file answered (exit 0) by the first command
    assert {c for (_, _, c) in results} == set(COMMANDS)
    assert all(results[(kind, -1, "convert" if kind == "sglang_pt" else "analyze")].code == 0 for kind in KINDS)
    assert results[("routing", -1, "why")].code == 0, "replicas why must explain the undamaged trace's request"


def test_zz_tallies():
    """Print (and with MOETRACE_FUZZ_TALLY write) refused / identical per kind and command, and the slowest run."""
    if not TALLY:
        pytest.skip("no fuzz case ran in this session")
    rows = {f"{k}/{c}": dict(v) for (k, c), v in sorted(TALLY.items())}
    if os.environ.get("MOETRACE_FUZZ_TALLY"):
        Path(os.environ["MOETRACE_FUZZ_TALLY"]).write_text(json.dumps(
            {"read_cases_per_kind": READ_CASES, "command_cases_per_kind": FUZZ_CASES, "report_and_plot_every": REPORT_EVERY, "workers": WORKERS,
             "seed": SEED, "bound_s": BOUND_S, "slowest_s": {k: round(v, 3) for k, v in sorted(SLOWEST.items())}, "tally": rows}, indent=1))
    print("\nkind/command: refused (exit 2 / TraceError) / identical")
    for key, value in rows.items():
        print(f"{key}: {value}")
    assert all(set(v) <= {"refused", "identical"} for v in rows.values())
