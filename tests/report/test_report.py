"""``moetrace report`` in a real headless Chromium: an HF adapter trace with routes, a replica trace,
sections only where the data is, bounded size, and the same errors as ``analyze``.

The demo's own report (reference runtime, 2 EP ranks, per-rank files and merged) is opened in
tests/demo/test_demo.py, where the demo already runs.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from moetrace.adapters import hf
from moetrace.cli.app import app
from PIL import Image
from typer.testing import CliRunner

from moetrace.capturer import RoutedExpertsCapturer
from moetrace.report import build_report
from moetrace.report.evidence import gather_evidence
from moetrace.report.sections import build_sections
from moetrace.routes import save_routes

from ..adapters.hf_models import FAMILIES, VOCAB
from ..analysis.helpers import write_stat_trace
from ..benchmarks import benchmark_module
from .browser import check_page, choose_request, open_report, pixel_stats

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _hf_run(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny Mixtral through the HF adapter: per_token trace with timing, and every sequence's captured routes."""
    family = FAMILIES["mixtral"]
    model = family.build()
    layers = model.config.num_hidden_layers
    batch, prompt, new = 3, 6, 8
    capturer = RoutedExpertsCapturer(layers, family.top_k, max_tokens_per_pass=64, num_kv_slots=batch * 32)
    handle = hf.instrument(model, capturer=capturer, capture_seq_len=32, mode="per_token", timing=True, output_dir=tmp_path)
    handle.recorder.start_record()
    ids = torch.randint(0, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    trace = handle.recorder.dump_record(tmp_path / "hf.h5")
    routes = {f"seq-{row}": handle.routed_experts(row, seq_len=prompt + new - 1, batch_size=batch) for row in range(batch)}
    handle.uninstrument()
    return trace, save_routes(tmp_path / "hf-routes.json", routes, model="tiny-mixtral", num_experts=family.num_experts,
                              layer_ids=range(layers))


def test_hf_trace_report_in_the_browser(tmp_path, chrome):
    trace, routes = _hf_run(tmp_path)
    out = build_report([trace], tmp_path / "hf.html", routes=routes)
    view = open_report(chrome, out)
    # one rank: drift instead of rank load; HF brackets the expert phase only; EP projection without a plan
    check_page(view, ["headline", "experts", "ranks", "timing", "placement", "routes", "coactivation"])
    before, after = choose_request(chrome, 1)
    assert before["title"].startswith("Request seq-0") and after["title"].startswith("Request seq-1")
    assert before["z"] != after["z"] and before["image"] != after["image"]  # the grid's data and its drawn image changed
    assert len(after["z"]) == 2 and len(after["z"][0]) == 13  # 2 MoE layers x (6 + 8 - 1) positions
    assert chrome.execute_script("return document.querySelectorAll('#placement div.figure').length;") == 1  # no plan with 1 rank


def test_routing_trace_report_in_the_browser(tmp_path, chrome):
    routing = tmp_path / "routing.h5"
    result = CliRunner().invoke(app, ["replicas", "replay", "mooncake", "--replicas", "4", "--limit", "300", "--out", str(routing)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "routing.html"
    result = CliRunner().invoke(app, ["report", str(routing), "-o", str(out)])
    assert result.exit_code == 0, result.output
    view = open_report(chrome, out)
    check_page(view, ["replicas"])
    ids = [f["id"] for f in view.figures]
    assert ids == ["fig-replica-load-0", "fig-ttft-0", "fig-hits-0"]
    load = next(f for f in view.figures if f["id"] == "fig-replica-load-0")
    assert [t["points"] for t in load["traces"]] == [200] * 4  # one line per replica, 200 time bins


def test_sections_only_where_the_trace_holds_the_data(tmp_path):
    counts = np.random.default_rng(0).integers(1, 50, size=(3, 8))
    sections = build_sections(gather_evidence([write_stat_trace(tmp_path / "s.h5", counts, top_k=2, ep_size=1, layer_ids=[0, 1, 2])]))
    # stat, one rank, no timing, no routes, no per-token ids: headline, expert load and the EP projection only
    assert [s.key for s in sections] == ["headline", "experts", "placement"]
    assert all(s.reading for s in sections)
    html = build_report([tmp_path / "s.h5"], tmp_path / "s.html")
    umask = os.umask(0)
    os.umask(umask)
    assert html.stat().st_mode & 0o777 == 0o666 & ~umask  # readable like any file the user writes, not mkstemp's 0600
    two = build_sections(gather_evidence([write_stat_trace(tmp_path / "t.h5", counts, top_k=2, ep_size=2, layer_ids=[0, 1, 2])]))
    assert [s.key for s in two] == ["headline", "experts", "ranks", "placement"]  # rank load and a plan (in-sample only)
    placement = next(s for s in two if s.key == "placement")
    assert "in-sample" in placement.reading and "held-out: n/a" in placement.reading


@pytest.fixture(scope="module")
def token_traces():
    with benchmark_module("analysis_throughput") as m:
        yield m.make_token_trace


def test_report_size_does_not_grow_with_the_trace(tmp_path, token_traces):
    sizes = {}
    stages: dict[str, tuple[int, int]] = {}
    for tokens in (4_000, 40_000):
        token_traces(tmp_path / f"t{tokens}.h5", tokens)  # 16 layers x 64 experts, top-8, 8 EP ranks
        shown = (lambda stage, done, total: stages.__setitem__(stage, (done, total))) if tokens == 4_000 else None
        sizes[tokens] = build_report([tmp_path / f"t{tokens}.h5"], tmp_path / f"t{tokens}.html", progress=shown).stat().st_size
    # the placement section's progress: every stage counted to its end
    assert set(stages) == {"placement: validating the planners (folds)", "placement: held-out estimate (rebalances)"}, stages
    assert all(done == total > 0 for done, total in stages.values()), stages
    assert abs(sizes[40_000] - sizes[4_000]) < 0.02 * sizes[4_000], sizes  # 10x the tokens, the same size
    assert max(sizes.values()) < 5.5e6, sizes


def _corrupt(tmp_path: Path) -> dict[str, Path]:
    good = write_stat_trace(tmp_path / "good.h5", np.ones((2, 4), np.int64), top_k=2, ep_size=1, layer_ids=[0, 1])
    data = good.read_bytes()
    files = {"truncated": tmp_path / "truncated.h5", "garbage": tmp_path / "garbage.h5", "foreign": tmp_path / "foreign.h5",
             "text": tmp_path / "notes.txt"}
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["garbage"].write_bytes(np.random.default_rng(1).bytes(4096))
    with h5py.File(files["foreign"], "w") as f:
        f["x"] = np.arange(3)
    files["text"].write_text("not a trace\n")
    return files


def test_bad_inputs_fail_with_the_errors_analyze_gives(tmp_path):
    runner = CliRunner()
    for name, path in _corrupt(tmp_path).items():
        out = tmp_path / f"{name}.html"
        analyzed = runner.invoke(app, ["analyze", str(path)])
        reported = runner.invoke(app, ["report", str(path), "-o", str(out)])
        assert analyzed.exit_code == reported.exit_code == 2, (name, analyzed.output, reported.output)
        assert reported.output == analyzed.output and reported.output.startswith("moetrace: error: "), name
        assert str(path) in reported.output and not out.exists()
        assert not list(tmp_path.glob(f".{name}.html.*")), "a temporary was left behind"
    missing = runner.invoke(app, ["report", str(tmp_path / "nope.h5"), "-o", str(tmp_path / "x.html")])
    assert missing.exit_code == 2 and "no such trace file" in missing.output


def test_negative_controls_the_browser_checks_fail_on_a_broken_page(tmp_path, chrome):
    counts = np.random.default_rng(0).integers(1, 50, size=(3, 8))
    good = build_report([write_stat_trace(tmp_path / "s.h5", counts, top_k=2, ep_size=1, layer_ids=[0, 1, 2])], tmp_path / "good.html")
    expected = ["headline", "experts", "placement"]
    check_page(open_report(chrome, good), expected)
    page = good.read_text(encoding="utf-8")
    broken = {
        # a JavaScript error in the page
        "error": page.replace("</body>", "<script>window.notAFunction();</script></body>"),
        # a figure drawn without any data point
        "empty": page.replace("</body>", '<div id="fig-empty" class="figure" data-section="experts"></div>'
                                         "<script>Plotly.newPlot('fig-empty', [], {});</script></body>"),
    }
    for name, text in broken.items():
        path = tmp_path / f"{name}.html"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(AssertionError):
            check_page(open_report(chrome, path), expected)
    white = io.BytesIO()
    Image.new("RGB", (1280, 900), "white").save(white, format="PNG")
    assert pixel_stats(white.getvalue())["ink"] == 0.0  # a blank page fails check_page's ink test
