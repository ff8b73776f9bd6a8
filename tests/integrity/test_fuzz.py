"""Seeded fuzz: every kind of trace moetrace writes, damaged as a disk or a copy would, through every command.

For each kind (stat, per_pass, per_token, timing, routing ``/requests``, merged,
recovered, converted, a streaming segment, a stat checkpoint) the trace is damaged
``FUZZ_CASES`` times (bit flips, zeroed 2 KiB blocks, truncations, two chunks of one
dataset swapped on disk, in turn; seeded) and ``analyze``, ``inspect``, ``diff``,
``placement``, ``merge``, ``recover`` (on the run directory, for the kinds it reads)
and ``verify`` run on it in-process through the typer app. Each must either exit 0
with exactly the output (and written trace) it gives for the undamaged file, or exit 2
with a ``moetrace: error:`` line / a verify report. Exit 1, a traceback or a different
answer fails the test.

``FUZZ_CASES`` (env ``MOETRACE_FUZZ_CASES``, default 6) is sized to keep the module within
about a minute on a 2-core CI machine; ``MOETRACE_FUZZ_TALLY=path.json`` writes the tallies
that docs/trace-format.md shows.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from .traces import MUTATIONS, build, corrupt

FUZZ_CASES = int(os.environ.get("MOETRACE_FUZZ_CASES", "6"))
KINDS = ("stat", "per_pass", "per_token", "timing", "routing", "merged", "recovered", "converted", "segment", "checkpoint")
COMMANDS = ("analyze", "inspect", "diff", "placement", "merge", "recover", "verify")
SEED = 28
_runner = CliRunner()
TALLY: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)


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


def _run(command: str, trace: Path, pristine: Path, run_dir: Path | None, out: Path) -> tuple[int, str, object] | None:
    """Run ``command`` on ``trace``: ``(exit code, stdout, written content)``; ``None`` when
    the command does not apply to this kind (recover without a run directory)."""
    out.unlink(missing_ok=True)
    for stale in out.parent.glob(f"{out.stem}*"):
        stale.unlink()
    args = {
        "analyze": ["analyze", str(trace), "--json", "--no-progress"],
        "inspect": ["inspect", str(trace), "--json"],
        "diff": ["diff", str(trace), str(pristine), "--json"],
        "placement": ["placement", str(trace), "--gpus", "2", "--json"],
        "merge": ["merge", str(trace), "-o", str(out)],
        "recover": ["recover", str(run_dir), "-o", str(out), "--force"] if run_dir is not None else None,
        "verify": ["verify", str(trace), "--json"],
    }[command]
    if args is None:
        return None
    result = _runner.invoke(app, args, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError(f"{command} raised on {trace}:\n{''.join(traceback.format_exception(result.exception))}")
    written = {p.name: _content(p) for p in sorted(out.parent.glob(f"{out.stem}*"))} if command in ("merge", "recover") and result.exit_code == 0 else None
    return result.exit_code, result.stdout, (written, result.output)


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_traces_are_refused_or_read_identically(kind, tmp_path):
    trace, run_dir = build(kind, tmp_path / kind)
    pristine_bytes = trace.read_bytes()
    pristine = tmp_path / f"pristine{trace.suffix}"
    shutil.copy(trace, pristine)
    out = tmp_path / "out" / "written.h5"
    out.parent.mkdir()
    baseline = {c: _run(c, trace, pristine, run_dir, out) for c in COMMANDS}
    assert all(b is None or b[0] in (0, 2) for b in baseline.values()), baseline
    assert baseline["verify"] is not None and baseline["verify"][0] == 0, baseline["verify"]
    assert baseline["analyze"] is not None and baseline["analyze"][0] == 0, baseline["analyze"]
    for case in range(FUZZ_CASES):
        mutation = MUTATIONS[case % len(MUTATIONS)]
        rng = np.random.default_rng((SEED, KINDS.index(kind), case))
        damaged = corrupt(pristine_bytes, mutation, rng, pristine)
        trace.write_bytes(damaged)
        for command in COMMANDS:
            got, want = _run(command, trace, pristine, run_dir, out), baseline[command]
            if got is None or want is None:
                TALLY[(kind, command)]["n/a"] += 1
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
    """Print (and with MOETRACE_FUZZ_TALLY write) refused / identical per kind and command."""
    if not TALLY:
        pytest.skip("no fuzz case ran in this session")
    rows = {f"{k}/{c}": dict(v) for (k, c), v in sorted(TALLY.items())}
    if os.environ.get("MOETRACE_FUZZ_TALLY"):
        Path(os.environ["MOETRACE_FUZZ_TALLY"]).write_text(json.dumps({"cases_per_kind": FUZZ_CASES, "seed": SEED, "tally": rows}, indent=1))
    print("\nkind/command: refused (exit 2) / identical (exit 0)")
    for key, value in rows.items():
        print(f"{key}: {value}")
    assert all(set(v) <= {"refused", "identical", "n/a"} for v in rows.values())
