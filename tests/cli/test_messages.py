"""Every message says what is true: each case issue 52 found, reproduced, with the message it now gives."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.batch import PassBatch
from moetrace.words import counted

from ..analysis.helpers import random_passes, record

runner = CliRunner()

#: What people must never read: Python's None, a NaN, a repr of a numpy value or array.
NOT_FOR_PEOPLE = re.compile(r"\bNone\b|\bnan\b|\bNaN\b|array\(|np\.\w+\(|dtype=")


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result, code: int) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrace: error: "), result.stderr
    return lines[0]


def _requests_trace(tmp: Path) -> Path:
    """A per_token trace whose rows carry 3 requests: a prefill pass of 4 + 3 + 2 rows, then 2 decode passes of 3."""
    cfg = RecorderConfig(num_layers=2, num_physical_experts=8, top_k=2, mode="per_token", output_dir=tmp, max_tokens_per_pass=16,
                         stream_chunk_tokens=4096, stream_chunk_passes=16, model="test-moe")
    rec = ExpertDistributionRecorder(cfg)
    rec.start_record()
    rng = np.random.default_rng(5)
    batches = [PassBatch.of(["a", "b", "c"], [0, 0, 0], [4, 3, 2], prefill=True)]
    batches += [PassBatch.of(["a", "b", "c"], [4 + s, 3 + s, 2 + s], [1, 1, 1], prefill=False) for s in range(2)]
    for batch in batches:
        rows = int(batch.count.sum())
        with rec.with_forward_pass(batch=batch):
            for layer in range(2):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.as_tensor(np.stack([rng.choice(8, 2, replace=False) for _ in range(rows)])))
    rec.stop_record()
    return rec.dump_record(tmp / "requests.h5")


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("messages")
    passes = random_passes(np.random.default_rng(7), num_passes=6, num_layers=2, num_experts=8, top_k=2)
    small = record(tmp, "per_pass", passes, num_experts=8)
    text = tmp / "notes.h5"
    text.write_text("my notes, not a trace\n")
    truncated = tmp / "truncated.h5"
    raw = small.read_bytes()
    truncated.write_bytes(raw[: len(raw) // 2])
    return {"small": small, "requests": _requests_trace(tmp), "text": text, "truncated": truncated, "dir": tmp}


def test_words_counted_in_the_right_number() -> None:
    assert [counted(1, "group"), counted(1, "pass"), counted(3, "pass"), counted(1200, "token"), counted(0, "request")] == [
        "1 group", "1 pass", "3 passes", "1,200 tokens", "0 requests"]


def test_report_without_routes_says_where_the_requests_come_from(traces, tmp_path) -> None:
    """Was: ``7 requests in None`` in the HTML."""
    out = tmp_path / "r.html"
    result = invoke("report", traces["requests"], "-o", out)
    assert result.exit_code == 0, result.stderr
    page = out.read_text()
    assert "3 requests from the trace&#x27;s own token rows" in page or "3 requests from the trace's own token rows" in page
    visible = re.sub(r"<script.*?</script>|<style.*?</style>", "", page, flags=re.S)
    assert not NOT_FOR_PEOPLE.search(visible), NOT_FOR_PEOPLE.search(visible)
    assert "in None" not in page


def test_negative_control_the_scan_sees_a_none(traces, tmp_path) -> None:
    """The scan above finds ``None`` where one is written into the page's text."""
    assert NOT_FOR_PEOPLE.search("<p>7 requests in None</p>") and NOT_FOR_PEOPLE.search("mean nan") and not NOT_FOR_PEOPLE.search("Nonetheless")


@pytest.mark.parametrize(("name", "label", "remedy"), [
    ("nope.h5", "no such file", "check the path"),
    ("text", "not a moetrace trace", "give a trace file that moetrace wrote"),
    ("truncated", "DAMAGED: it cannot be read (truncated or overwritten)", "restore it from a copy"),
])
def test_verify_names_what_the_file_is(traces, name: str, label: str, remedy: str) -> None:
    """Was: every one of them ``DAMAGED; no checksums (written before moetrace had them)``."""
    path = traces.get(name, traces["dir"] / name)
    result = invoke("verify", path)
    assert result.exit_code == 2
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"{path}: {label}") and remedy in first, result.stdout
    assert "no checksums" not in result.stdout


def test_verify_an_hdf5_file_moetrace_did_not_write(traces, tmp_path) -> None:
    import h5py

    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = [1, 2, 3]
    assert invoke("verify", other).stdout.startswith(f"{other}: not a moetrace trace")


def test_verify_an_intact_trace_still_says_intact(traces) -> None:
    """Negative control of the three labels: a whole trace is none of them."""
    result = invoke("verify", traces["small"])
    assert result.exit_code == 0 and result.stdout.startswith(f"{traces['small']}: intact;")


@pytest.mark.parametrize("command", ["routes", "plot", "report", "merge", "placement"])
def test_a_write_that_fails_says_what_and_why(traces, command: str) -> None:
    """Was: ``[Errno 2] No such file or directory: '/proc/.x.json.2fsqaewb.tmp'``, exit 2, no remedy."""
    trace = traces["requests"] if command == "routes" else traces["small"]
    target = {"routes": "/proc/x.json", "plot": "/proc/x.png", "report": "/proc/x.html", "merge": "/proc/x.h5", "placement": "/proc/plan.json"}[command]
    extra = ["--gpus", "2"] if command == "placement" else []
    line = one_error_line(invoke(command, trace, "-o", target, *extra), 1)
    assert f"could not write {'trace ' if command == 'merge' else ''}{target}: no such file or directory (creating a file in /proc/)" in line, line
    assert "write it to a folder you can create files in" in line
    assert ".tmp" not in line and "Errno" not in line


def test_negative_control_a_write_error_elsewhere_is_not_reworded(traces, tmp_path) -> None:
    """A missing input is still a missing input (exit 2), not a write failure."""
    line = one_error_line(invoke("routes", tmp_path / "absent.h5", "-o", tmp_path / "x.json"), 2)
    assert "no such trace file" in line and "could not write" not in line


def test_counts_name_their_unit(traces) -> None:
    """Was: ``dead experts 10`` on a model of 8 experts (it counted (layer, expert) cells)."""
    counts = np.zeros((3, 8), dtype=np.int64)
    counts[:, :6] = 5  # experts 6 and 7 idle in every layer: 6 idle cells
    counts[1, 5] = 0  # one more idle cell
    from ..analysis.helpers import write_stat_trace

    path = write_stat_trace(traces["dir"] / "idle.h5", counts, 8, 2, [0, 1, 2], model="m")
    text = " ".join(invoke("analyze", path).stdout.split())
    assert "idle (no token): 7 of 24 (layer, expert) cells; 2 of 8 experts idle in every layer" in text
    assert "dead experts" not in text


def test_plurals_in_analyze(traces) -> None:
    """Was: ``drift: 8 windows of 1 passes``."""
    text = " ".join(invoke("analyze", traces["small"], "--window", "1").stdout.split())
    assert "windows of 1 pass;" in text and "1 passes" not in text


def test_coactivation_pairs_read_as_pairs(tmp_path) -> None:
    """Was: ``1+5: 9, 1.56, 2+7: 7, ...`` (commas inside and between pairs)."""
    passes = random_passes(np.random.default_rng(3), num_passes=6, num_layers=2, num_experts=8, top_k=2)
    text = invoke("analyze", record(tmp_path, "per_token", passes, num_experts=8)).stdout
    cells = re.findall(r"\d+\+\d+ \(\d[\d,]* tokens?, lift \d+\.\d\d\)", text)
    assert cells, text
    assert not re.search(r"\d+\+\d+: \d+, \d", text)


def test_placement_reads_for_a_person(tmp_path) -> None:
    """Was: ``planner deployed: greedy`` then ``deployed instead: greedy``; a selection paragraph of ~400 characters;
    ``1 groups``, ``1 passes``, ``std error(s)``."""
    passes = random_passes(np.random.default_rng(9), num_passes=40, num_layers=2, num_experts=8, top_k=2)
    result = invoke("placement", record(tmp_path, "per_pass", passes, num_experts=8), "--gpus", "2")
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert len(re.findall(r"^deployed: ", text, flags=re.M)) == 1 and "deployed instead" not in text and "planner deployed" not in text
    deployed = next(line for line in text.splitlines() if line.startswith("deployed: "))
    assert len(deployed) < 240, deployed
    assert "1 expert group, 1 node, 2 GPUs" in " ".join(text.split())
    for wrong in ("1 groups", "1 passes", "1 nodes", "std error(s)", "fold(s)"):
        assert wrong not in text
