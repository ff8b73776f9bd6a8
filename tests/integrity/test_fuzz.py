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
  holds; ``read_requests`` for routing traces; ``convert_sglang`` for ``.pt``) must raise a
  ``TraceError`` or return exactly what the undamaged file gives.
- **Commands** (``FUZZ_CASES`` per kind, env ``MOETRACE_FUZZ_CASES``, default 4; ``report``, which
  writes a 5 MB page, on the first ``REPORT_CASES`` of them): ``analyze``, ``inspect``, ``diff``,
  ``placement``, ``merge``, ``recover`` (on the run directory, for the kinds it reads),
  ``verify``, ``timeline``, ``report`` and ``convert`` (``.pt``) run in-process through the typer
  app. Each must exit 0 with exactly the output (and written trace) it gives for the undamaged
  file, or exit 2 with a ``moetrace: error:`` line / a verify report. Exit 1, a traceback or a
  different answer fails the test.

Every read and every command runs under ``faulthandler.dump_traceback_later(BOUND_S,
exit=True)``: HDF5 loops in C holding the GIL, where no Python timeout reaches, so a hang ends
the run with the stack of the loop instead of stalling CI. ``MOETRACE_FUZZ_TALLY=path.json``
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
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.trace import open_trace
from moetrace.trace.convert import convert_sglang
from moetrace.trace.guarded import open_hdf5
from moetrace.trace.integrity import reading
from moetrace.trace.requests import read_requests
from moetrace.trace.schema import TraceError

from .traces import MUTATIONS, TOP_K, build, corrupt, layout_of

READ_CASES = int(os.environ.get("MOETRACE_FUZZ_READ_CASES", "100"))
FUZZ_CASES = int(os.environ.get("MOETRACE_FUZZ_CASES", "4"))
REPORT_CASES = int(os.environ.get("MOETRACE_FUZZ_REPORT_CASES", "1"))
BOUND_S = 300  # per read or command of these small files: milliseconds each unloaded, seconds on a loaded CI box; only a loop reaches it
KINDS = ("stat", "per_pass", "per_token", "timing", "routing", "merged", "recovered", "converted", "segment", "checkpoint", "sglang_pt")
COMMANDS = ("analyze", "inspect", "diff", "placement", "merge", "recover", "verify", "timeline", "report", "convert")
SEED = 28
_runner = CliRunner()
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


def _content(path: Path) -> dict[str, object]:
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


def _read(kind: str, path: Path, out: Path) -> object:
    """Everything the library reads from ``path``: the answer a reader gets (raises TraceError)."""
    if kind == "sglang_pt":
        out.unlink(missing_ok=True)
        return _content(convert_sglang(path, out, top_k=TOP_K, run_id="fuzzrun", world_size=2))
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


def _run(command: str, kind: str, trace: Path, pristine: Path, run_dir: Path | None, out: Path) -> tuple[int, str, object] | None:
    """Run ``command`` on ``trace``: ``(exit code, stdout, written content)``; ``None`` when
    the command does not apply to this kind (recover without a run directory, convert of a trace)."""
    for stale in out.parent.glob(f"{out.stem}*"):
        stale.unlink()
    pt = kind == "sglang_pt"
    args = {
        "analyze": ["analyze", str(trace), "--json", "--no-progress"],
        "inspect": ["inspect", str(trace), "--json"],
        "diff": ["diff", str(trace), str(pristine), "--json"],
        "placement": ["placement", str(trace), "--gpus", "2", "--json"],
        "merge": ["merge", str(trace), "-o", str(out)],
        "recover": ["recover", str(run_dir), "-o", str(out), "--force"] if run_dir is not None else None,
        "verify": ["verify", str(trace), "--json"],
        "timeline": ["timeline", str(trace), "-o", str(out.with_suffix(".json"))],
        "report": ["report", str(trace), "-o", str(out.with_suffix(".html"))],
        "convert": ["convert", str(trace), "-o", str(out), "--top-k", str(TOP_K), "--world-size", "2", "--run-id", "fuzzrun"] if pt else None,
    }[command]
    if args is None or (pt and command != "convert"):
        return None
    with watchdog(command):
        result = _runner.invoke(app, args, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError(f"{command} raised on {trace}:\n{''.join(traceback.format_exception(result.exception))}")
    written = None
    if result.exit_code == 0 and command in ("merge", "recover", "convert"):
        written = {p.name: _content(p) for p in sorted(out.parent.glob(f"{out.stem}*.h5"))}
    elif result.exit_code == 0 and command == "timeline":
        written = out.with_suffix(".json").read_text()
    return result.exit_code, result.stdout, (written, result.output)


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


def test_damaged_files_are_refused_or_answered_identically_by_every_command(built):
    kind, trace, run_dir, pristine, pristine_bytes, layout, out = built
    baseline = {c: _run(c, kind, trace, pristine, run_dir, out) for c in COMMANDS}
    assert all(b is None or b[0] in (0, 2) for b in baseline.values()), baseline
    first = "convert" if kind == "sglang_pt" else "analyze"
    assert baseline[first] is not None and baseline[first][0] == 0, baseline[first]
    for case in range(FUZZ_CASES):
        mutation = MUTATIONS[case % len(MUTATIONS)]
        rng = np.random.default_rng((SEED, KINDS.index(kind), case))
        trace.write_bytes(corrupt(pristine_bytes, mutation, rng, layout))
        for command in COMMANDS:
            if command == "report" and case >= REPORT_CASES:
                continue
            got, want = _run(command, kind, trace, pristine, run_dir, out), baseline[command]
            if got is None or want is None:
                continue
            code, stdout, (written, output) = got
            where = f"{kind}/{mutation}#{case} {command}"
            assert code in (0, 2), f"{where}: exit {code}\n{output}"
            if code == 0:
                assert (code, stdout, written) == (want[0], want[1], want[2][0]), f"{where}: exit 0 with a different answer\n{output[:2000]}"
                TALLY[(kind, command)]["identical"] += 1
            else:
                assert "moetrace: error:" in output or (command == "verify" and '"intact": false' in stdout), f"{where}: exit 2 without a message\n{output[:2000]}"
                TALLY[(kind, command)]["refused"] += 1
    trace.write_bytes(pristine_bytes)


def test_zz_tallies():
    """Print (and with MOETRACE_FUZZ_TALLY write) refused / identical per kind and command, and the slowest run."""
    if not TALLY:
        pytest.skip("no fuzz case ran in this session")
    rows = {f"{k}/{c}": dict(v) for (k, c), v in sorted(TALLY.items())}
    if os.environ.get("MOETRACE_FUZZ_TALLY"):
        Path(os.environ["MOETRACE_FUZZ_TALLY"]).write_text(json.dumps(
            {"read_cases_per_kind": READ_CASES, "command_cases_per_kind": FUZZ_CASES, "report_cases_per_kind": REPORT_CASES,
             "seed": SEED, "bound_s": BOUND_S, "slowest_s": {k: round(v, 3) for k, v in sorted(SLOWEST.items())}, "tally": rows}, indent=1))
    print("\nkind/command: refused (exit 2 / TraceError) / identical")
    for key, value in rows.items():
        print(f"{key}: {value}")
    assert all(set(v) <= {"refused", "identical"} for v in rows.values())
