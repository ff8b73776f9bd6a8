"""The house drawn from its own imports: moetrace's module graph, its circles and its upward arrows.

Every ``import`` and ``from ... import`` statement of every module of the distribution is read
with :mod:`ast` (module level, inside functions and under ``TYPE_CHECKING`` alike: an import
inside a function is still an arrow), resolved to the moetrace module it names (``from pkg
import name`` is an arrow to ``pkg.name`` when that is a module, else to ``pkg``), and drawn as
an arrow between two modules. :data:`LAYERS` is the house's order, bottom to top; an arrow from
a module to one in a higher layer *runs back up*. A circle is a strongly connected component of
more than one module.

Run it from the repository root::

    python tests/packaging/import_graph.py            # figures: modules and folders, arrows, circles, upward arrows
    python tests/packaging/import_graph.py --figure   # the layer figure of docs/architecture.md
    python tests/packaging/import_graph.py --modules  # each layer's modules, by folder (docs/architecture.md)

tests/packaging/test_layers.py holds the house to 0 circles and 0 upward arrows.
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LAYERS",
    "Graph",
    "build_graph",
    "circles",
    "folder_graph",
    "folder_layer_mismatches",
    "folder_of",
    "layer_of",
    "module_list",
    "relative_imports_across_folders",
    "upward_arrows",
]

#: Source folder → the package it is installed as (pyproject's ``package-dir``).
ROOTS = {"moetrace": "moetrace", "adapters": "moetrace.adapters", "exporters": "moetrace.exporters", "cli": "moetrace.cli"}

#: The layers, bottom to top: (name, module prefixes, what the layer is for). A module belongs to
#: the layer of its longest matching prefix; a module may import its own layer and those below.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("base", ("moetrace._version", "moetrace.ids", "moetrace.data", "moetrace.dispatch", "moetrace.dispatch_layout", "moetrace.balance", "moetrace.layout",
              "moetrace.pass_phase", "moetrace.lazy", "moetrace.words"),
     "versions, id spaces, vendored data, dispatch formulas, balance metric definitions, rank layouts, lazy package attributes, words for people"),
    ("trace", ("moetrace.trace",), "the HDF5 trace: schema (every name), writers, readers, segments, merge"),
    ("core", ("moetrace.config", "moetrace.timing", "moetrace.snapshot", "moetrace.graphs", "moetrace.devices", "moetrace.label_load",
              "moetrace.provenance", "moetrace.route_checks", "moetrace.batch", "moetrace.cuda_clock", "moetrace.wire"),
     "what the recorder and the capturer share: config, timing phases and clocks, snapshots, batches, device and graph state"),
    ("recording", ("moetrace.recording",),
     "the recorder's rooms: the pass counter and one sink per mode, the session's files, cuts and dumps, hook argument checks"),
    ("recorder", ("moetrace.recorder", "moetrace.process_recorder", "moetrace.capturer", "moetrace.routes",
                  "moetrace.replay", "moetrace.replay_audit", "moetrace.testing"),
     "what runs inside an engine's forward: the recorder's hooks and state machine, the capturer, replay"),
    ("http", ("moetrace.http",), "HTTP serving infrastructure: guarded server, server handle"),
    ("replicas", ("moetrace.replicas",), "request→replica evidence: recorder, router, prefix cache, simulation, analysis"),
    ("exporters", ("moetrace.exporters",), "Prometheus and OpenTelemetry views of the recorders' snapshots"),
    ("control", ("moetrace.control",), "the HTTP control endpoint of a running process"),
    ("placement", ("moetrace.placement",), "expert placement: planners, EPLB's contract, backtests, rebalance cost, SGLang's plan file"),
    ("analysis", ("moetrace.analysis",), "offline analysis of traces: balance, drift, projection, reports, plots"),
    ("report", ("moetrace.report",), "the HTML report of a run: plotly figures of the analyses"),
    ("reference", ("moetrace.reference",), "the reference MoE runtime: router, experts, EP layer, model, serving loop"),
    ("drivers", ("moetrace.drivers",),
     "replica drivers that run reference engines behind the router"),
    ("adapters", ("moetrace.adapters",), "engine adapters and plugins: Hugging Face, SGLang, vLLM, Megatron-Core"),
    ("facade", ("moetrace",), "the package root: `import moetrace` (the core and control, each on first use)"),
    ("cli", ("moetrace.cli",), "the `moetrace` command"),
)


@dataclass(frozen=True)
class Graph:
    """Modules (name → source file) and arrows (importer, imported) between them."""

    modules: dict[str, Path]
    arrows: frozenset[tuple[str, str]]
    #: Packages (folders with an ``__init__.py``) among :attr:`modules`.
    packages: frozenset[str] = frozenset()


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    found: dict[str, tuple[Path, bool]] = {}
    for folder, package in ROOTS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


def _known(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             modules: dict[str, tuple[Path, bool]]) -> Iterable[str | None]:
    if isinstance(node, ast.Import):
        return [_known(alias.name, modules) for alias in node.names]
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(max(node.level - 1, 0)):
        base = base.rpartition(".")[0]
    target = (base + "." + node.module if node.module else base) if node.level else (node.module or "")
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else _known(target, modules) for a in node.names]


def build_graph(root: Path) -> Graph:
    """Read every module under ``root``'s package folders and draw its import arrows."""
    modules = _modules(root)
    arrows: set[tuple[str, str]] = set()
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                arrows.update((module, t) for t in _targets(module, is_package, node, modules) if t and t != module)
    return Graph({m: p for m, (p, _) in modules.items()}, frozenset(arrows),
                 frozenset(m for m, (_, is_package) in modules.items() if is_package))


def _top(module: str) -> str:
    """The top-level folder's package ``module`` is installed under (``moetrace.exporters``, ``moetrace``)."""
    return max((p for p in ROOTS.values() if module == p or module.startswith(p + ".")), key=len)


def folder_of(module: str, graph: Graph) -> str:
    """The folder that stands for ``module`` in the folder graph.

    A module inside a sub-folder of a top-level folder (``moetrace/trace/``, ``adapters/vllm/``)
    belongs to that sub-folder, the whole of it; a module directly in a top-level folder
    (``moetrace/recorder.py``, ``cli/app.py``) and a top-level folder's own ``__init__`` stand
    for themselves: those folders hold several layers, their modules one each.
    """
    top = _top(module)
    rest = module[len(top) + 1:].split(".") if module != top else []
    if len(rest) >= 2 or (len(rest) == 1 and module in graph.packages):
        return f"{top}.{rest[0]}"
    return module


def folder_graph(graph: Graph) -> Graph:
    """The module graph with each sub-folder drawn as one node (see :func:`folder_of`)."""
    folders = {folder_of(m, graph) for m in graph.modules}
    arrows = {(folder_of(a, graph), folder_of(b, graph)) for a, b in graph.arrows}
    return Graph({f: graph.modules.get(f, Path(f)) for f in folders}, frozenset((a, b) for a, b in arrows if a != b),
                 frozenset(f for f in folders if f in graph.packages))


def folder_layer_mismatches(graph: Graph) -> list[str]:
    """``module (layer) in folder (layer)`` for every module whose layer is not its sub-folder's."""
    found = []
    for module in sorted(graph.modules):
        folder = folder_of(module, graph)
        if folder != module and layer_of(module) != layer_of(folder):
            found.append(f"{module} ({LAYERS[layer_of(module)][0]}) in {folder} ({LAYERS[layer_of(folder)][0]})")
    return found


def relative_imports_across_folders(root: Path) -> list[str]:
    """``path:line: from .x`` for every relative import whose target is in another top-level folder."""
    modules = _modules(root)
    found = []
    for module, (path, is_package) in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
                if _top(target) != _top(module):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
    return found


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of ``module``'s layer (its longest matching prefix)."""
    best, best_len = -1, -1
    for index, (_, prefixes, _) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise ValueError(f"module {module!r} is in no layer: add its prefix to LAYERS in {__file__}")
    return best


def upward_arrows(graph: Graph) -> list[tuple[str, str]]:
    """Arrows from a module to one in a higher layer, sorted."""
    return sorted((a, b) for a, b in graph.arrows if layer_of(a) < layer_of(b))


def circles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    succ: dict[str, list[str]] = {m: [] for m in graph.modules}
    for a, b in graph.arrows:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(succ)))
    for module in sorted(succ):
        if module not in index:
            visit(module)
    return sorted(found)


def figure(graph: Graph) -> str:
    """The layer figure: each layer, top to bottom, and the lower layers its modules import."""
    lines = []
    for index in reversed(range(len(LAYERS))):
        name, _, about = LAYERS[index]
        below = sorted({layer_of(b) for a, b in graph.arrows if layer_of(a) == index and layer_of(b) != index},
                       reverse=True)
        lines.append(f"{name:<10} {about}")
        lines.append(f"{'':<10}   └─► {', '.join(LAYERS[i][0] for i in below) if below else '(nothing of moetrace)'}")
    return "\n".join(lines)


def module_list(graph: Graph, root: Path) -> str:
    """Each layer's modules, top to bottom, by source folder: the list of docs/architecture.md."""
    lines = []
    for index in reversed(range(len(LAYERS))):
        by_folder: dict[str, list[str]] = defaultdict(list)
        for module, path in graph.modules.items():
            if layer_of(module) == index:
                rel = path.relative_to(root)
                by_folder[rel.parent.as_posix() + "/"].append(rel.stem)
        for folder in sorted(by_folder):
            head = f"{LAYERS[index][0]:<10} {folder:<20} "
            lines += textwrap.wrap(", ".join(sorted(by_folder[folder])), 100, initial_indent=head,
                                   subsequent_indent=" " * len(head), break_on_hyphens=False)
    return "\n".join(lines)


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--figure", action="store_true", help="print the layer figure instead of the figures")
    parser.add_argument("--modules", action="store_true", help="print each layer's modules instead of the figures")
    args = parser.parse_args()
    graph = build_graph(args.root)
    if args.figure:
        print(figure(graph))
        return 0
    if args.modules:
        print(module_list(graph, args.root))
        return 0
    for level, drawn in (("modules", graph), ("folders", folder_graph(graph))):
        found, up = circles(drawn), upward_arrows(drawn)
        print(f"{level} {len(drawn.modules)}  arrows {len(drawn.arrows)}  circles {len(found)}  upward arrows {len(up)}")
        for component in found:
            print("  circle:", " ↔ ".join(component))
        for a, b in up:
            print(f"  upward: {a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
    for line in folder_layer_mismatches(graph) + relative_imports_across_folders(args.root):
        print("  misplaced:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
