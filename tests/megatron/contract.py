"""The Megatron-Core internals that moetrace.adapters.megatron hooks, looked up in a release's source.

A contract check that runs no Megatron: each release's source (a wheel, or the
installed ``site-packages``) is parsed with :mod:`ast`, never imported, so releases
this interpreter cannot run (0.17+ needs Python >= 3.12) are checked as well. A name
is ``"module:Owner.member"``: a member of a class (a method, a class attribute or
dataclass field, an attribute assigned on ``self``, its bases' included), a parameter
of a function or method (``"name@i"``: the ``i``-th positional parameter after
``self``, for the arguments the adapter reads by position), or ``"module:name"`` for a
module-level name. :data:`CONTRACT` lists what the adapter reads, each entry with its
alternatives (feature detection). Names only: what a method returns (``dispatch_postprocess``'s
``tokens_per_expert`` second) or whether ``routing`` still passes ``router_replay=`` is proven
only where a release runs (0.16.1, the live tests of this package).

``python -m tests.megatron.contract WHEEL_OR_SITE_PACKAGES...`` records what each
release holds in ``contract_versions.json`` (network-free afterwards);
``tests/megatron/test_contract.py`` re-extracts the installed release and checks the
contract against every recorded one.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
import sys
import zipfile
from collections.abc import Callable, Iterable
from email.parser import Parser
from pathlib import Path

from moetrace.adapters.megatron import TopKSlot
from moetrace.adapters.megatron.layers import DISPATCHERS, PHASE_METHODS

__all__ = ["CONTRACT", "FIXTURE", "Release", "missing", "names", "read_release"]

FIXTURE = Path(__file__).with_name("contract_versions.json")
"""What each checked release holds of :data:`CONTRACT`: ``{version: {"source", "sha256", "requires_python", "found"}}``
(an installed release, ``"source": "installed"``, has no file to hash)."""

_MOE = "megatron.core.transformer.moe"
_DISPATCHER = {kind: cls for cls, kind in DISPATCHERS.items()}  # "alltoall" / "allgather" -> class name
_SLOT_PARAMS = list(inspect.signature(TopKSlot.get_replay_topk).parameters)[1:]  # Megatron calls the slot as its RouterReplay

CONTRACT: tuple[tuple[str, ...], ...] = (
    ("megatron.core.package_info:__version__",),
    ("megatron.core.utils:get_pg_rank",),
    ("megatron.core.utils:get_pg_size",),
    (f"{_MOE}.moe_utils:topk_routing_with_score_function.router_replay",),
    (f"{_MOE}.moe_layer:BaseMoELayer",),
    *((f"{_MOE}.moe_layer:MoELayer.{member}",) for member in (
        *PHASE_METHODS, "router", "config", "token_dispatcher", "ep_group", "layer_number",
        "num_local_experts", "local_expert_indices")),
    *((f"{_MOE}.router:TopKRouter.{member}",) for member in ("routing", "router_replay", "routing_type")),
    *((f"{_MOE}.router_replay:RouterReplay.{member}",) for member in (
        "get_replay_topk", "set_target_indices", "clear_indices", "set_router_replay_action", "router_replay_action")),
    *((f"{_MOE}.router_replay:RouterReplay.get_replay_topk.{name}@{i}",) for i, name in enumerate(_SLOT_PARAMS)),
    (f"{_MOE}.router_replay:RouterReplayAction.REPLAY_FORWARD",),
    *((f"{_MOE}.token_dispatcher:{_DISPATCHER['alltoall']}.{member}",) for member in (
        "preprocess", "preprocess.routing_map@0", "dispatch_preprocess.routing_map@1", "dispatch_postprocess",
        "input_splits", "output_splits")),
    *((f"{_MOE}.token_dispatcher:{_DISPATCHER['allgather']}.{member}",) for member in (
        "dispatch_preprocess.routing_map@1", "dispatch_postprocess", "local_map")),
    *((f"megatron.core.transformer.transformer_config:TransformerConfig.{field}",) for field in (
        "num_moe_experts", "moe_router_topk", "moe_expert_capacity_factor", "moe_router_fusion", "hidden_size", "params_dtype")),
    # Megatron's aux-loss tracker (adapters/megatron/losses.py): the metrics tracker where it exists, else the legacy dict.
    (f"{_MOE}.moe_logging:get_moe_metrics_tracker & {_MOE}.moe_logging:MoEMetricsTracker.metrics & {_MOE}.moe_logging:MetricEntry.values",
     f"{_MOE}.moe_utils:get_moe_layer_wise_logging_tracker"),
)
"""Each entry: its alternatives in the order the adapter's feature detection tries them; an
alternative ``"a & b"`` is picked when ``a`` exists, and then needs all of its names."""


def _alternatives(entry: tuple[str, ...]) -> list[list[str]]:
    return [alternative.split(" & ") for alternative in entry]


def names() -> list[str]:
    """Every name :data:`CONTRACT` mentions, sorted."""
    return sorted({name for entry in CONTRACT for alternative in _alternatives(entry) for name in alternative})


class Release:
    """A release's files: a wheel (zip) or an installed ``site-packages`` directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._files = set(self._zip.namelist()) if self._zip else None

    def read(self, relative: str) -> str | None:
        """The text of ``relative`` (a ``/`` path inside the release), ``None`` when absent."""
        if self._zip is not None:
            return self._zip.read(relative).decode() if relative in self._files else None
        file = self.path / relative
        return file.read_text() if file.is_file() else None

    def metadata(self) -> dict[str, str]:
        """``Version`` and ``Requires-Python`` of megatron-core's ``METADATA``."""
        pattern = re.compile(r"megatron_core-[^/]+\.dist-info/METADATA$")
        candidates = self._files if self._zip is not None else (str(p.relative_to(self.path)) for p in self.path.glob("megatron_core-*.dist-info/METADATA"))
        found = sorted(name for name in candidates if pattern.fullmatch(name))
        if len(found) != 1:
            raise ValueError(f"{self.path}: expected one megatron_core-*.dist-info/METADATA, found {found}; give a megatron-core wheel or the site-packages holding one install")
        meta = Parser().parsestr(self.read(found[0]) or "")
        return {"version": meta["Version"], "requires_python": meta.get("Requires-Python", "")}


class _Module:
    """One parsed module: its top-level names, classes and the modules its imported names come from.

    ``package`` is the package relative imports start from (the module's own for an ``__init__``)."""

    def __init__(self, tree: ast.Module, package: str) -> None:
        self.classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        self.functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.imported = {alias.asname or alias.name: _absolute(node, package) for node in tree.body
                         if isinstance(node, ast.ImportFrom) for alias in node.names}
        self.names = {*self.classes, *self.functions, *self.imported, *_assigned(tree.body)}


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads, relative levels resolved against ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _assigned(body: Iterable[ast.stmt]) -> set[str]:
    """Names bound by plain and annotated assignments in ``body``."""
    out: set[str] = set()
    for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes a class's methods assign on ``self``."""
    return {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> tuple[list[str], set[str]]:
    """``(positional parameters, every parameter)`` of ``fn``, ``self`` left out of a method's."""
    positional = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)][1 if method else 0:]
    return positional, {*positional, *(a.arg for a in fn.args.kwonlyargs)}


class _Source:
    """Lookups of contract names in one release, modules parsed once."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self._modules: dict[str, _Module | None] = {}

    def module(self, dotted: str) -> _Module | None:
        if dotted not in self._modules:
            base = dotted.replace(".", "/")
            text, package = self.release.read(f"{base}.py"), dotted.rpartition(".")[0]
            if text is None:
                text, package = self.release.read(f"{base}/__init__.py"), dotted
            self._modules[dotted] = None if text is None else _Module(ast.parse(text), package)
        return self._modules[dotted]

    def _class_chain(self, dotted: str, name: str) -> list[ast.ClassDef]:
        """The class ``name`` of module ``dotted`` and its bases found in this release, nearest first."""
        module = self.module(dotted)
        if module is None:
            return []
        if name not in module.classes:
            origin = module.imported.get(name)
            return self._class_chain(origin, name) if origin else []
        cls = module.classes[name]
        chain = [cls]
        for base in cls.bases:
            if isinstance(base, ast.Name):
                chain += self._class_chain(dotted, base.id)
        return chain

    def has(self, name: str) -> bool:
        """Whether the release's source holds ``name`` (``"module:Owner.member"``, see the module docstring)."""
        dotted, _, path = name.partition(":")
        parts = path.split(".")
        module = self.module(dotted)
        if module is None:
            return False
        if len(parts) == 1:
            return parts[0] in module.names
        owner, member = parts[0], parts[1]
        chain = self._class_chain(dotted, owner)
        if len(parts) == 2 and chain:
            return any(member in {*(n.name for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                                  *_assigned(c.body), *_self_attributes(c)} for c in chain)
        if len(parts) == 2:  # a parameter of a module-level function
            fn, param = module.functions.get(owner), member
            method = False
        else:
            fn = next((n for c in chain for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member), None)
            param, method = parts[2], True
        if fn is None:
            return False
        positional, every = _params(fn, method)
        param, _, index = param.partition("@")
        return (int(index) < len(positional) and positional[int(index)] == param) if index else param in every


def read_release(path: Path) -> dict[str, object]:
    """What the release at ``path`` holds of :data:`CONTRACT`: ``version``, ``requires_python``, ``found`` (names, sorted)."""
    release = Release(path)
    source = _Source(release)
    return {**release.metadata(), "found": [name for name in names() if source.has(name)]}


def missing(found: Iterable[str]) -> list[str]:
    """What a release that holds ``found`` lacks of :data:`CONTRACT`: the names missing from each entry's picked
    alternative, or a whole entry (``"a | b"``) where no alternative is picked."""
    have, out = set(found), []
    for entry in CONTRACT:
        picked = next((alternative for alternative in _alternatives(entry) if alternative[0] in have), None)
        out += [" | ".join(entry)] if picked is None else [name for name in picked if name not in have]
    return out


def _record(paths: list[Path], write: Callable[[str], None]) -> None:
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    for path in paths:
        facts = read_release(path)
        version = str(facts.pop("version"))
        source = {"source": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()} if path.is_file() else {"source": "installed"}
        recorded[version] = {**source, **facts}
        write(f"{version}: {len(facts['found'])} of {len(names())} names; missing {missing(facts['found']) or 'nothing'}\n")
    FIXTURE.write_text(json.dumps(dict(sorted(recorded.items(), key=lambda kv: [int(p) for p in kv[0].split(".")])), indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.megatron.contract WHEEL_OR_SITE_PACKAGES... (pip download --no-deps megatron-core==X)")
    _record([Path(arg) for arg in sys.argv[1:]], sys.stdout.write)
