"""The house's layer order, drawn from the code's own imports: no circles, no arrow that runs back up.

See tests/packaging/import_graph.py (the tool) and docs/architecture.md (the figure).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .import_graph import LAYERS, build_graph, circles, figure, layer_of, upward_arrows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph():
    return build_graph(ROOT)


def test_every_module_has_a_layer(graph) -> None:
    for module in graph.modules:
        layer_of(module)  # raises, naming the module, when it is in no layer


def test_no_import_circles(graph) -> None:
    assert circles(graph) == []


def test_no_arrow_runs_back_up(graph) -> None:
    up = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, b in upward_arrows(graph)]
    assert up == []


def test_the_graph_sees_what_the_modules_import(graph) -> None:
    # An import inside a function is an arrow too (the old reader ↔ segments circle ran through one).
    assert ("moetrace", "moetrace.control") in graph.arrows  # serve_control imports it on first use
    assert ("moetrace.trace.join", "moetrace.trace.reader") in graph.arrows
    assert ("moetrace.recorder", "moetrace.config") in graph.arrows
    assert len(graph.modules) > 90


def test_the_architecture_figure_is_the_one_the_code_draws(graph) -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert figure(graph) in doc, "docs/architecture.md's figure is stale: paste `python tests/packaging/import_graph.py --figure`"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_negative_control_a_circle_and_an_upward_arrow_are_found(tmp_path: Path) -> None:
    _write(tmp_path, {
        "moetrace/__init__.py": "",
        "moetrace/recorder.py": "from .trace import reader\n",
        "moetrace/trace/__init__.py": "",
        "moetrace/trace/reader.py": "def f():\n    from . import segments\n",
        "moetrace/trace/segments.py": "from .reader import f\nfrom ..recorder import X\n",
    })
    graph = build_graph(tmp_path)
    assert circles(graph) == [["moetrace.recorder", "moetrace.trace.reader", "moetrace.trace.segments"]]
    assert upward_arrows(graph) == [("moetrace.trace.segments", "moetrace.recorder")]


def test_negative_control_a_module_outside_every_layer_is_named(tmp_path: Path) -> None:
    _write(tmp_path, {"cli/app.py": "", "elsewhere/x.py": ""})
    assert set(build_graph(tmp_path).modules) == {"moetrace.cli.app"}
    with pytest.raises(ValueError, match=r"'nowhere\.x' is in no layer"):
        layer_of("nowhere.x")
