"""No trace dataset or attribute name is spelled outside moetrace/trace/schema.py.

Every module of the distribution is read with :mod:`ast` (docstrings and comments do not count)
and these spellings are refused anywhere but the schema module:

- a string that is a dataset path of a trace group (``"stat/physical_count"``, ``"/requests/ttft"``)
  or an f-string that starts with one (``f"timing/{name}"``): use ``Data.*`` or ``dataset(group, field)``;
- a string used as a root attribute key: ``x.attrs["rank"]``, ``attrs.get("rank")``,
  ``writer.set_attr("rank", ...)``, ``"rank" in x.attrs``: use ``Attr.*``;
- a trace group named by a string: ``"timing" in file``, ``file["requests"]`` (an open file:
  ``f``, ``file``, ``self._file``, ``files[i]`` ...): use ``Data.*``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .import_graph import ROOTS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = Path("moetrace/trace/schema.py")
GROUPS = ("stat", "passes", "tokens", "window", "timing", "ranks", "requests")
_PATH = re.compile(rf"^/?({'|'.join(GROUPS)})/")
#: Fields of the streamed groups (``f"{group}/pass_id"`` is a dataset path too).
_FIELDS = {"pass_id", "timestamp", "num_tokens", "physical_count", "topk_ids", "position", "rank"}
#: Names an ``attrs`` mapping goes by in the code (``trace.attrs``, ``attrs = dict(f.attrs)``).
_ATTRS_NAMES = ("attrs", "first_attrs", "last_attrs")
#: Names an open HDF5 file goes by (``f["requests"]``, ``self._file["timing"]``, ``files[0]["stat"]``).
_FILE_NAMES = ("f", "file", "first", "source", "src", "h5", "_file", "files")


def _is_file(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Name) and node.id in _FILE_NAMES) or (isinstance(node, ast.Attribute) and node.attr in _FILE_NAMES)


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_attrs(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "attrs") or (isinstance(node, ast.Name) and node.id in _ATTRS_NAMES)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and _is_str(body[0].value):
            found.add(id(body[0].value))
    return found


def spelled_names(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every trace name ``source`` spells itself."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
            first = node.values[0] if node.values else None
            if first is not None and _is_str(first) and _PATH.match(first.value):  # type: ignore[attr-defined]
                found.append((node.lineno, f"dataset path f-string {first.value!r}..."))  # type: ignore[attr-defined]
            pieces = ["{}" if isinstance(v, ast.FormattedValue) else v.value for v in node.values]  # type: ignore[attr-defined]
            if pieces == ["{}", "/", "{}"] or (len(pieces) == 2 and pieces[0] == "{}" and str(pieces[1]).lstrip("/") in _FIELDS):
                found.append((node.lineno, f"dataset path built by hand f\"{''.join(pieces)}\""))
        elif isinstance(node, ast.Subscript) and _is_str(node.slice):
            key = node.slice.value  # type: ignore[attr-defined]
            if _is_attrs(node.value):
                found.append((node.lineno, f"attribute key {key!r}"))
            elif key in GROUPS and _is_file(node.value):
                found.append((node.lineno, f"group {key!r}"))
            skip.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and _is_str(node.args[0]):
            if node.func.attr == "set_attr" or (node.func.attr == "get" and _is_attrs(node.func.value)):
                found.append((node.lineno, f"attribute key {node.args[0].value!r}"))  # type: ignore[attr-defined]
                skip.add(id(node.args[0]))
        elif isinstance(node, ast.Compare) and _is_str(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = node.left.value  # type: ignore[attr-defined]
            if key in GROUPS or _is_attrs(node.comparators[0]):
                found.append((node.lineno, f"membership test of {key!r}"))
            skip.add(id(node.left))
    for node in ast.walk(tree):
        if _is_str(node) and id(node) not in skip and _PATH.match(node.value):  # type: ignore[attr-defined]
            found.append((node.lineno, f"dataset path {node.value!r}"))  # type: ignore[attr-defined]
    return sorted(found)


def test_no_trace_name_is_spelled_outside_the_schema() -> None:
    spelled = []
    for folder in ROOTS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel == SCHEMA:
                continue
            spelled += [f"{rel}:{line}: {what}" for line, what in spelled_names(path.read_text(encoding="utf-8"))]
    assert spelled == [], "spell these with moetrace.trace.schema (Attr, Data, dataset):\n" + "\n".join(spelled)


def test_the_schema_spells_them() -> None:
    # The checker reads the schema module like any other: there it finds every dataset path.
    spelled = {what for _, what in spelled_names((ROOT / SCHEMA).read_text(encoding="utf-8"))}
    assert {"dataset path 'stat/physical_count'", "dataset path 'tokens/topk_ids'"} <= spelled
    from moetrace.trace.schema import Attr, Data, dataset

    assert (Data.STAT_PHYSICAL_COUNT, Data.TOKENS_TOPK_IDS, Attr.RUN_ID) == ("stat/physical_count", "tokens/topk_ids", "run_id")
    assert dataset(Data.TIMING, "pass_id") == "timing/pass_id"


def test_negative_control_each_spelling_is_found() -> None:
    source = '''
"""Docstrings may say "tokens/topk_ids"."""
def f(writer, trace, attrs, name, file, group):
    writer.write("stat/physical_count", 1)
    writer.append(f"timing/{name}", 2)
    rows = file[f"{group}/pass_id"], file[f"{group}/{name}"]
    rank = trace.attrs["rank"]
    hidden = attrs.get("hidden_size", 0)
    writer.set_attr("merged_from", "[]")
    if "timing" in file and "timing_clock" in trace.attrs:
        group = file["requests"]
    other = {"layers": 1}["layers"]
'''
    assert [what for _, what in spelled_names(source)] == [
        "dataset path 'stat/physical_count'",
        "dataset path f-string 'timing/'...",
        'dataset path built by hand f"{}/pass_id"',
        'dataset path built by hand f"{}/{}"',
        "attribute key 'rank'",
        "attribute key 'hidden_size'",
        "attribute key 'merged_from'",
        "membership test of 'timing'",
        "membership test of 'timing_clock'",
        "group 'requests'",
    ]
