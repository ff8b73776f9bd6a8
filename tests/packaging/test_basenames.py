"""One file name, one meaning: two modules of the package that share a base name must have one role in
parallel places, and :data:`PARALLEL` lists each such group with that role.

A base name that means two things (``guarded.py`` as an HTTP server and as a safe HDF5 open, ``labels.py``
as request labels and as their metrics, ``requests.py`` as a Hugging Face batch and as the replicas'
``/requests`` group: all before issue 49) makes a reader open the wrong file. Package ``__init__`` and
``__main__`` modules are the only names every folder may repeat. The list cannot go stale: a group that is
gone or has changed fails too, so a new module that repeats a base name is a decision written down here.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .import_graph import ROOTS

ROOT = Path(__file__).resolve().parents[2]
#: Base names every package folder may repeat.
PACKAGE_FILES = frozenset({"__init__", "__main__"})

#: base name -> (the one role its modules play, each in its own place; the modules, as paths).
PARALLEL: dict[str, tuple[str, frozenset[str]]] = {
    # One per engine adapter.
    "batches": ("an engine's batch of a pass as the recorder reads it (request rows)",
                frozenset({"adapters/hf/batches.py", "adapters/sglang/batches.py", "adapters/vllm/batches.py"})),
    "layers": ("an engine's MoE layers found and hooked",
               frozenset({"adapters/hf/layers.py", "adapters/megatron/layers.py", "adapters/vllm/layers.py"})),
    "layout": ("a rank's parallel layout: the RankLayout type, and each engine's reading of its parallel state into one",
               frozenset({"moetrace/layout.py", "adapters/sglang/layout.py", "adapters/vllm/layout.py"})),
    "replay": ("routing replay (a runtime's MoE layers run on given expert ids): the contract and one per runtime",
               frozenset({"moetrace/replay.py", "moetrace/reference/replay.py", "adapters/hf/replay.py", "adapters/megatron/replay.py"})),
    "routes": ("routes (the experts each token went to): the arrays and files, and Megatron-Core's recording of them",
               frozenset({"moetrace/routes.py", "adapters/megatron/routes.py"})),
    # One subject, one module per layer: what it is, its offline analysis, its metrics, its command.
    "timing": ("timing phases: names and clocks (core), the analysis of a trace's /timing, the `timing` command",
               frozenset({"moetrace/timing.py", "moetrace/analysis/timing.py", "cli/timing.py"})),
    "traffic": ("who sends to whom: its analysis of traces and the `traffic` command",
                frozenset({"moetrace/analysis/traffic.py", "cli/traffic.py"})),
    "analysis": ("offline analysis: of the replica traces (replicas) and the `analyze` command over moetrace/analysis/",
                 frozenset({"moetrace/replicas/analysis.py", "cli/analysis.py"})),
    "attribution": ("per-label attribution: the analysis and its command", frozenset({"moetrace/analysis/attribution.py", "cli/attribution.py"})),
    "deployment": ("the deployment series: the analysis and its command", frozenset({"moetrace/analysis/deployment.py", "cli/deployment.py"})),
    "timeline": ("the timeline of /timing: the builder and its command", frozenset({"moetrace/analysis/timeline.py", "cli/timeline.py"})),
    "verify": ("a trace's verification: the checks and the `verify` command", frozenset({"moetrace/trace/verify.py", "cli/verify.py"})),
    "control": ("the control endpoint: the server in the process and the `control` command, its client",
                frozenset({"moetrace/control.py", "cli/control.py"})),
    "replicas": ("the replicas package's metrics and its `replicas` command", frozenset({"exporters/replicas.py", "cli/replicas.py"})),
    "label_load": ("the live per-label load and its metrics", frozenset({"moetrace/label_load.py", "exporters/label_load.py"})),
    "replay_audit": ("the replay audit and its metrics", frozenset({"moetrace/replay_audit.py", "exporters/replay_audit.py"})),
    "route_checks": ("the row checks of handed-out routes and their metrics", frozenset({"moetrace/route_checks.py", "exporters/route_checks.py"})),
}


def shared_basenames(root: Path) -> dict[str, frozenset[str]]:
    """``{base name: paths}`` of every base name (other than :data:`PACKAGE_FILES`) that two modules under the
    package's top-level folders share; paths relative to ``root``."""
    found: dict[str, set[str]] = defaultdict(set)
    for folder in ROOTS:
        for path in (root / folder).rglob("*.py"):
            if path.stem not in PACKAGE_FILES:
                found[path.stem].add(path.relative_to(root).as_posix())
    return {name: frozenset(paths) for name, paths in found.items() if len(paths) > 1}


def test_shared_basenames_have_one_role_each() -> None:
    shared = shared_basenames(ROOT)
    unlisted = {name: sorted(paths) for name, paths in shared.items() if name not in PARALLEL or PARALLEL[name][1] != paths}
    assert not unlisted, (f"these modules share a base name: give the one with another meaning a name of its own, or list the "
                          f"group in PARALLEL with the one role they share: {unlisted}")
    stale = sorted(set(PARALLEL) - set(shared))
    assert not stale, f"these base names are no longer shared: drop them from PARALLEL: {stale}"


def test_negative_control_a_repeated_basename_is_found(tmp_path: Path) -> None:
    for path in ("moetrace/http/guarded.py", "moetrace/trace/guarded.py", "moetrace/trace/__init__.py", "cli/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert shared_basenames(tmp_path) == {"guarded": frozenset({"moetrace/http/guarded.py", "moetrace/trace/guarded.py"})}
    assert "guarded" not in PARALLEL
