"""The house's layer order, drawn from the code's own imports: no circles, no arrow that runs back up.

See tests/packaging/import_graph.py (the tool) and docs/architecture.md (the figure).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import import_graph
from .import_graph import (
    LAYERS,
    build_graph,
    circles,
    figure,
    folder_graph,
    folder_layer_mismatches,
    layer_of,
    module_list,
    relative_imports_across_folders,
    upward_arrows,
)

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


def test_no_circle_between_folders(graph) -> None:
    assert circles(folder_graph(graph)) == []


def test_no_arrow_between_folders_runs_back_up(graph) -> None:
    assert upward_arrows(folder_graph(graph)) == []


def test_each_folder_is_one_layer(graph) -> None:
    assert folder_layer_mismatches(graph) == [], "move the module into its layer's folder, or the folder into one layer"


def test_no_relative_import_crosses_a_top_level_folder() -> None:
    found = relative_imports_across_folders(ROOT)
    assert found == [], "import across moetrace/, adapters/, exporters/ and cli/ absolutely (moetrace.exporters):\n" + "\n".join(found)


def test_the_graph_sees_what_the_modules_import(graph) -> None:
    # An import inside a function is an arrow too (the old reader ↔ segments circle ran through one).
    assert ("moetrace", "moetrace.control") in graph.arrows  # the root exports serve_control lazily; its TYPE_CHECKING import is the arrow
    assert ("moetrace.trace.join", "moetrace.trace.reader") in graph.arrows
    assert ("moetrace.recorder", "moetrace.config") in graph.arrows
    assert len(graph.modules) > 90


def test_the_architecture_figure_is_the_one_the_code_draws(graph) -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert figure(graph) in doc, "docs/architecture.md's figure is stale: paste `python tests/packaging/import_graph.py --figure`"


def test_the_architecture_module_list_is_the_one_the_code_draws(graph) -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert module_list(graph, ROOT) in doc, "docs/architecture.md's module list is stale: paste `python tests/packaging/import_graph.py --modules`"


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


def test_negative_control_folder_circles_misplaced_modules_and_relative_imports_are_found(tmp_path: Path, monkeypatch) -> None:
    # replicas.live drives the reference runtime (a drivers module in the replicas folder), and
    # reference.serving uses the replicas' prefix cache: no module circle, but the folders point
    # at each other; control reaches the top-level exporters/ folder through a relative import.
    _write(tmp_path, {
        "moetrace/__init__.py": "",
        "moetrace/control.py": "from .exporters import prometheus\n",
        "moetrace/reference/__init__.py": "",
        "moetrace/reference/serving.py": "from ..replicas.prefix_cache import PrefixCache\n",
        "moetrace/replicas/__init__.py": "",
        "moetrace/replicas/prefix_cache.py": "",
        "moetrace/replicas/live.py": "def f():\n    from ..reference import serving\n",
        "moetrace/drivers/__init__.py": "",
        "exporters/__init__.py": "",
        "exporters/prometheus.py": "",
    })
    graph = build_graph(tmp_path)
    assert circles(graph) == []
    folders = folder_graph(graph)
    assert circles(folders) == [["moetrace.reference", "moetrace.replicas"]]
    assert upward_arrows(folders) == [("moetrace.replicas", "moetrace.reference")]
    assert folder_layer_mismatches(graph) == []  # live is a replicas module by its prefix: the arrow is what is wrong
    assert relative_imports_across_folders(tmp_path) == ["moetrace/control.py:1: from .exporters import ..."]
    # A layer that picks single modules out of another folder is a mismatch.
    layers = (*LAYERS[:-1], ("drivers2", ("moetrace.replicas.live",), "x"), LAYERS[-1])
    monkeypatch.setattr(import_graph, "LAYERS", layers)
    assert folder_layer_mismatches(graph) == ["moetrace.replicas.live (drivers2) in moetrace.replicas (replicas)"]
