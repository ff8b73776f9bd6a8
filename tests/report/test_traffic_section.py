"""The report's "Who sends to whom" section in a real headless Chromium: the node x node heatmap, the hottest links and
nodes per token drawn from per-rank ``per_token`` traces (2 nodes of 2 ranks), with its one-line reading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moetrace.report import build_report

from ..analysis.traffic_runs import (
    GPUS_PER_NODE,
    RANKS,
    hand_count,
    spread_routes,
    write_rank_traces,
)
from .browser import check_page, open_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_READING_JS = "return document.querySelector('#traffic .reading').textContent;"


def test_traffic_section_in_the_browser(tmp_path: Path, chrome) -> None:
    rng = np.random.default_rng(5)
    passes = {rank: [spread_routes(rng, 4 + rank), spread_routes(rng, 6)] for rank in range(RANKS)}
    paths = write_rank_traces(tmp_path, "per_token", passes)
    view = open_report(chrome, build_report(paths, tmp_path / "traffic.html", gpus_per_node=GPUS_PER_NODE))
    check_page(view, view.sections)
    assert "traffic" in view.sections and view.sections.index("traffic") == view.sections.index("ranks") + 1
    figs = {f["id"]: f for f in view.figures if f["section"] == "traffic"}
    assert set(figs) == {"fig-traffic-nodes", "fig-traffic-links", "fig-traffic-nodes-per-token"}
    assert figs["fig-traffic-nodes"]["traces"] == [{"type": "heatmap", "points": 4}] and figs["fig-traffic-nodes"]["marks"]["heatmap"] == 1
    assert figs["fig-traffic-links"]["traces"] == [{"type": "bar", "points": 2}]  # the two inter-node links of two nodes
    rank_tokens, nodes = hand_count(passes, [slot // 2 for slot in range(8)])
    node = rank_tokens.sum(axis=0).reshape(2, 2, 2, 2).sum(axis=(1, 3))
    reading = chrome.execute_script(_READING_JS)
    share = 1 - np.trace(node) / node.sum()
    assert f"{share:.1%} of {node.sum():,} token copies cross nodes" in reading
    assert "a token reaches 2.00 nodes on average, 1.00 remote" in reading and nodes.sum(axis=0)[2] == nodes.sum()


def test_no_traffic_section_without_gpus_per_node(tmp_path: Path) -> None:
    """Negative control: the section needs the node size; without it the report has none."""
    rng = np.random.default_rng(5)
    paths = write_rank_traces(tmp_path, "per_pass", {rank: [spread_routes(rng, 3)] for rank in range(RANKS)})
    html = build_report(paths, tmp_path / "plain.html").read_text()
    assert 'id="traffic"' not in html and "fig-traffic-nodes" not in html
