"""No function runs past about 60 lines unless :data:`LONG` names it with its reason.

Lines are counted from the ``def`` to the last line of the body, docstring included. The list
cannot go stale: a listed function that is gone or has come under the limit fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .import_graph import ROOTS

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 60

#: ``path:qualified name`` -> why it is longer than :data:`LIMIT` lines.
LONG: dict[str, str] = {
    # The instrument contract (moetrace.adapters): a docstring of every argument and option is a third
    # of each; the rest checks the target, then installs every hook under one rollback (unwinding).
    "adapters/hf/__init__.py:instrument": "the contract's docstring and its typed options, checks of the model, then every layer's hooks installed under one rollback",
    "adapters/megatron/__init__.py:instrument": "the contract's docstring and its typed options, checks of the model, then every layer's hooks installed under one rollback",
    # Rewritten by the placement package (issue 36).
    "moetrace/placement/plan.py:plan_experts": "the planner's contract: a 50-line docstring over 14 lines that call its named steps (options, limits, node assignment, EPLB per layer, keep deployed)",
    "moetrace/placement/backtesting.py:backtest": "the replay loop over rebalances: each planner's track, the oracle and the current placement scored at each (half of it the docstring and the result)",
    "moetrace/analysis/source.py:load_series": "one streaming read of a trace into bucketed loads (bucket doubling inline)",
    "moetrace/placement/select.py:select_planner": "folds under the work budget, then the rule and its one-sentence reason",
    # Long for a reason.
    "moetrace/trace/convert.py:convert_jsonl": "the second, streaming read of the log assembles tokens from per-layer lines with one flush closure over its state",
    "moetrace/analysis/attribution.py:attribute": "one streaming read of a routes file that fills every attribution table at once (bounded memory)",
    "moetrace/analysis/distributed.py:analyze_traces": "plans tasks, runs them in process or on Dask, and reduces partials in one place so both paths agree",
    "moetrace/reference/launcher.py:launch": "process start, rendezvous, result collection and cleanup of the EP ranks must share one try/finally",
    "moetrace/analysis/timing.py:analyze_timing": "reads every phase table of /timing in one pass (stat and per_pass rows)",
    "moetrace/dispatch_layout.py:build_dispatch_layout": "the dispatch formulas with their shape docstring: one vectorised computation, split only by its comments",
    "moetrace/analysis/summary.py:AnalysisReport.to_dict": "the JSON document of docs/analysis.md as one literal, field by field",
    "cli/demo.py:_serve_rank": "one demo rank: engine, recorder, endpoints and the serving loop under one cleanup",
    "moetrace/analysis/timeline.py:build_timeline": "one pass over /timing rows that builds every lane of the timeline",
}


def long_functions(root: Path) -> dict[str, int]:
    """``{path:qualified name: lines}`` of every function over :data:`LIMIT` lines."""
    found = {}
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()

            def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        name = f"{prefix}{child.name}"
                        if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > LIMIT:  # type: ignore[operator]
                            found[f"{rel}:{name}"] = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                        visit(child, name + ".")

            visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_long_functions_are_listed_with_their_reason() -> None:
    found = long_functions(ROOT)
    unlisted = {f"{name} ({lines} lines)" for name, lines in found.items() if name not in LONG}
    assert not unlisted, f"split these functions, or list them in LONG with the reason: {sorted(unlisted)}"
    stale = sorted(set(LONG) - set(found))
    assert not stale, f"these functions are gone or short now: drop them from LONG: {stale}"


def test_negative_control_a_long_function_is_found(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(LIMIT))
    (tmp_path / "cli" / "a.py").write_text(f"def short():\n    pass\n\n\nclass K:\n    def long(self):\n{body}")
    assert long_functions(tmp_path) == {"cli/a.py:K.long": LIMIT + 1}
