"""One name, one home: no module only re-exports, and no public name is defined in two modules.

Every module of the distribution is read with :mod:`ast`. A *definition* is a module-level
``def``, ``class`` or assignment; names starting with ``_`` are private and not counted.

- A module that is not a package's ``__init__`` may list in ``__all__`` only names it defines:
  a name it imports and lists is a re-export (the old shims: ``guarded_http``,
  ``reference.prefix_cache``, ``trace.writer.TraceHeader`` ...). A package's ``__init__`` is its
  public surface and may list what its modules define.
- A public name defined in two modules means two things, or one thing twice. :data:`SHARED`
  lists the names that several modules define on purpose, each with its reason; every other
  such name fails.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

from .import_graph import ROOTS

ROOT = Path(__file__).resolve().parents[2]

#: Names several modules define on purpose, and why.
SHARED: dict[str, str] = {
    "log": "each module's own logging.getLogger(__name__)",
    "logger": "each module's own logging.getLogger(__name__)",
    "main": "a module's command-line entry point (`moetrace`, `python -m moetrace.cli.reference`, `python -m moetrace.drivers.http_replica`)",
    "instrument": "the adapter contract (moetrace.adapters: instrument(target, recorder=None, capturer=None, **options)): one per engine",
    "create_otel_instruments": "the OpenTelemetry views' contract (exporters: create_otel_instruments(source, meter_provider)): one per view",
    "register": "the Prometheus collectors' contract (exporters: register(recorder, registry)) and vLLM's plugin entry point, "
                "whose name vLLM fixes (vllm.general_plugins)",
    "replay": "the routing-replay contract, one per runtime (reference, Hugging Face, Megatron-Core): replay(model, routes) -> handle",
    "find_moe_layers": "each engine adapter's discovery of its MoE layers (vLLM, Megatron-Core), one per engine",
    "installed_version": "each engine adapter's installed-version probe (transformers, Megatron-Core), one per engine",
    "PHASE_METHODS": "per-engine tables of the methods timed as phases (Megatron-Core, SGLang)",
    "Record": "per-engine records of one MoE layer's routing (Hugging Face, vLLM)",
}


def _defined(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


@functools.lru_cache(maxsize=4)
def _modules(root: Path) -> dict[str, tuple[ast.Module, bool]]:
    found = {}
    for folder, package in ROOTS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            found[name] = (ast.parse(path.read_text(encoding="utf-8")), is_package)
    return found


def re_exports(root: Path) -> dict[str, list[str]]:
    """``{module: [names it lists in __all__ but does not define]}`` for every non-package module."""
    found = {}
    for name, (tree, is_package) in _modules(root).items():
        if not is_package:
            foreign = [n for n in _all(tree) if n not in _defined(tree)]
            if foreign:
                found[name] = foreign
    return found


def defined_twice(root: Path) -> dict[str, list[str]]:
    """``{public name: [modules defining it]}`` for every name defined in more than one module."""
    where: dict[str, list[str]] = defaultdict(list)
    for name, (tree, _) in _modules(root).items():
        for defined in _defined(tree):
            if not defined.startswith("_"):
                where[defined].append(name)
    return {n: sorted(ms) for n, ms in sorted(where.items()) if len(ms) > 1}


def test_no_module_re_exports() -> None:
    assert re_exports(ROOT) == {}, "import each name from the module that defines it (one name, one home)"


def test_no_public_name_is_defined_in_two_modules() -> None:
    twice = {n: ms for n, ms in defined_twice(ROOT).items() if n not in SHARED}
    assert twice == {}, "rename one of them, or define it once and import it (or say why in SHARED)"


def test_every_shared_name_is_still_shared() -> None:
    stale = sorted(set(SHARED) - set(defined_twice(ROOT)))
    assert stale == [], f"these names are defined once now: drop them from SHARED: {stale}"


def test_negative_control_a_shim_and_a_twice_defined_name_are_found(tmp_path: Path) -> None:
    files = {
        "moetrace/__init__.py": "from .http import ServerLimits\n__all__ = ['ServerLimits']\n",
        "moetrace/http.py": "class ServerLimits: ...\n__all__ = ['ServerLimits']\n",
        "moetrace/guarded_http.py": "from .http import ServerLimits\n__all__ = ['ServerLimits']\n",
        "moetrace/a.py": "def render(): ...\n_private = 1\n",
        "cli/b.py": "def render(): ...\n_private = 2\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert re_exports(tmp_path) == {"moetrace.guarded_http": ["ServerLimits"]}
    assert defined_twice(tmp_path) == {"render": ["moetrace.a", "moetrace.cli.b"]}
