"""The issue's hang: a zeroed block over a stat trace's global heap collection (where HDF5 keeps
the string attributes) made HDF5 loop forever in ``open_trace``; now every reader refuses it.

Each read runs under a watchdog (``faulthandler.dump_traceback_later(exit=True)``): HDF5 spins
in C holding the GIL, where no Python timeout reaches, so a hang ends the test process with
the stack of the loop instead of stalling CI.
"""

from __future__ import annotations

import faulthandler
import subprocess
import sys
from contextlib import contextmanager

import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.trace import open_trace
from moetrace.trace.safe_open import collection_damage
from moetrace.trace.schema import TraceDamageError
from moetrace.trace.verify import verify_trace
from tests.servers import SUBPROCESS_BOUND_S

from .traces import dumped

BOUND_S = 300  # far above a read of this 20 kB file (milliseconds; seconds on a loaded box); only a loop reaches it
runner = CliRunner()


@contextmanager
def watchdog(seconds: float = BOUND_S):
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """``(pristine, damaged, collection offset)``: a stat trace from the real recorder and a copy
    with 2,048 bytes zeroed right after its global heap collection's 16-byte header."""
    directory = tmp_path_factory.mktemp("heap")
    pristine = dumped(directory, "stat")
    data = bytearray(pristine.read_bytes())
    at = data.find(b"GCOL")
    assert at > 0 and data.find(b"GCOL", at + 1) == -1  # one collection: the root's string attributes
    data[at + 16 : at + 16 + 2048] = bytes(2048)
    damaged = directory / "damaged.h5"
    damaged.write_bytes(bytes(data))
    return pristine, damaged, at


def test_the_collection_walk_accepts_the_pristine_heap_and_names_the_damage(traces):
    pristine, damaged, at = traces
    size = len(pristine.read_bytes())
    assert collection_damage(pristine.read_bytes()[at:], at, size) is None
    problem = collection_damage(damaged.read_bytes()[at:], at, size)
    assert problem == f"the global heap collection at byte {at} has object 0 at byte {at + 16} of 0 bytes, which never ends"
    block = bytearray(pristine.read_bytes()[at:])
    block[16 + 8 : 16 + 16] = (1 << 40).to_bytes(8, "little")  # the first object's size runs past the collection
    assert "runs past the collection" in collection_damage(bytes(block), at, size)


def test_every_reader_refuses_the_zeroed_heap_within_the_bound(traces):
    _, damaged, at = traces
    with watchdog(), pytest.raises(TraceDamageError, match=f"global heap collection at byte {at}.*moetrace verify"):
        open_trace(damaged)
    with watchdog():
        report = verify_trace(damaged)
    assert not report.intact and f"global heap collection at byte {at}" in " ".join(report.problems)
    for args in (["analyze", str(damaged), "--json", "--no-progress"], ["inspect", str(damaged)], ["verify", str(damaged)]):
        with watchdog():
            result = runner.invoke(app, args)
        assert result.exit_code == 2 and f"global heap collection at byte {at}" in result.output, (args, result.output)


def test_without_the_guard_hdf5_loops_on_it(traces):
    """Negative control: plain h5py, once the file is open, reads the damaged attribute forever
    (it reads the pristine one at once). The child is killed after 10 s past its open."""
    pristine, damaged, _ = traces
    code = "import sys, h5py; f = h5py.File(sys.argv[1], 'r'); print('open', flush=True); f.attrs['model']; print('read', flush=True)"
    done = subprocess.run([sys.executable, "-c", code, str(pristine)], capture_output=True, text=True, timeout=SUBPROCESS_BOUND_S)
    assert done.returncode == 0 and done.stdout.split() == ["open", "read"], done
    child = subprocess.Popen([sys.executable, "-c", code, str(damaged)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "open\n"  # bounded: the open itself is quick and does not loop
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=10)
    finally:
        child.kill()
        child.wait(timeout=60)
