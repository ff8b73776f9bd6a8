"""Which transformers MoE families are observed how, and the explicit specs for those outside the shared machinery.

Most MoE families in transformers build their experts module with the
``@use_experts_implementation`` decorator (``transformers.integrations.moe``);
every such module is called as ``experts(hidden_states [T, H], top_k_index
[T, k], top_k_weights [T, k])`` and is found at run time by the forward
function the decorator gives it (see :func:`is_experts_machinery`), never by
class name.

The few families outside it are listed here explicitly (:data:`EXPLICIT_SITES`):

- ``experts-call``: an experts module with the same call convention but not
  built by the decorator (DBRX, Step-3.7): a forward pre-hook reads
  ``top_k_index``.
- ``router-topk``: the experts module never sees expert ids (Llama 4 passes
  dense scores, JetMoE sorted token groups): a forward hook on the router
  re-runs the router's own ``torch.topk`` on the logits it returns, which
  gives the very ids the router selected.
- ``router-ids``: the experts module sees other ids than the router chose
  (LongCat-Flash from transformers 5.25 maps its zero-compute experts onto
  real ones, with weight 0, before calling the decorated experts module): a
  forward hook on the router reads the ids it returns. The spec's ``shadows``
  names the experts class that is then not hooked.

:func:`moe_family_coverage` scans the installed transformers and classifies
every MoE family; :data:`UNSUPPORTED` and :data:`VIA_OTHER_FAMILY` name the
families that are not observed and why.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "EXPLICIT_SITES",
    "REPLAY_REFUSED",
    "REPLAY_TESTED",
    "UNSUPPORTED",
    "VIA_OTHER_FAMILY",
    "SiteSpec",
    "coverage_markdown",
    "explicit_spec",
    "is_experts_machinery",
    "is_shadowed",
    "machinery_forward_code",
    "moe_family_coverage",
    "replay_coverage",
]


@dataclass(frozen=True)
class SiteSpec:
    """How to observe one MoE module class outside the shared experts machinery.

    Attributes:
        family: transformers model directory (``"llama4"``).
        class_name: the module class hooked.
        kind: ``"experts-call"`` (pre-hook reads ``top_k_index``),
            ``"router-topk"`` (forward hook re-runs ``topk`` on the router logits)
            or ``"router-ids"`` (forward hook reads the ids the router returns).
        num_experts: expert ids the module can see, from the module.
        output_index: for the router kinds, the position in the router's output
            tuple of the logits ``[T, E]`` (``router-topk``) or of the selected
            ids ``[T, k]`` (``router-ids``).
        parent_class: for the router kinds, only routers that are the
            ``.router`` child of a module of this class count (JetMoE's
            attention experts use the same router class and are not MLP experts).
        shadows: the experts class of the same family that this site observes
            in its stead: built by the decorator, but called with other ids than
            the router chose, so it is not hooked.
    """

    family: str
    class_name: str
    kind: str
    num_experts: Callable[[torch.nn.Module], int]
    output_index: int = 0
    parent_class: str | None = None
    shadows: str | None = None

    @property
    def module_name(self) -> str:
        return f"transformers.models.{self.family}.modeling_{self.family}"

    @property
    def on_router(self) -> bool:
        """Whether the hook sits on the router (the experts module is not observed)."""
        return self.kind in ("router-topk", "router-ids")


EXPLICIT_SITES: tuple[SiteSpec, ...] = (
    SiteSpec("dbrx", "DbrxExperts", "experts-call", lambda m: m.num_experts),
    # LongCat-Flash routes to n_routed_experts real experts plus zero-compute (identity) experts; the
    # router's n_routed_experts counts both. From transformers 5.25 its block maps a zero-compute pick onto
    # a real expert (weight 0) before the experts module, so the router's own ids are read instead.
    SiteSpec("longcat_flash", "LongcatFlashTopkRouter", "router-ids", lambda m: m.n_routed_experts, output_index=2,
             shadows="LongcatFlashExperts"),
    SiteSpec("step3p7", "Step3p7Experts", "experts-call", lambda m: m.num_experts),
    SiteSpec("llama4", "Llama4Router", "router-topk", lambda m: m.num_experts, output_index=1),
    SiteSpec("jetmoe", "JetMoeTopKGating", "router-topk", lambda m: m.num_experts, output_index=4, parent_class="JetMoeMoE"),
)

UNSUPPORTED: dict[str, str] = {
    "doge": "product-key retrieval experts (DogeCDMoE) pick from num_keys**2 embeddings, not a top-k router over expert modules",
    "switch_transformers": "encoder-decoder with capacity-limited top-1 routing (dropped tokens); not implemented",
    "nllb_moe": "encoder-decoder with capacity-limited top-2 routing (dropped tokens); not implemented",
    "vitpose_backbone": "'experts' are per-dataset heads chosen by dataset index, not routed per token",
}

VIA_OTHER_FAMILY: dict[str, str] = {
    "sarvam_moe": "configuration only; the model is built from glm4_moe modeling (experts machinery)",
    "sarvam_mla": "configuration only; the model is built from deepseek_v3 modeling (experts machinery)",
    "param2moe": "configuration only; the model is built from glm4_moe modeling (experts machinery)",
}


REPLAY_REFUSED: dict[str, str] = {
    "phimoe": "sparsemixer routing picks experts by masked argmax with jitter, not torch.topk, so there is no top-k to replace",
    "deepseek_v4": "its first MoE layers are hash-routed (a token id -> experts table, no top-k over scores); replaying them would change nothing a router learns",
}
"""Families the adapter observes but :func:`moetrace.adapters.hf.replay` refuses, with the reason."""

REPLAY_TESTED: tuple[str, ...] = (
    "afmoe", "axk1", "axk2", "bailing_hybrid", "cohere2_moe", "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "dots3_note",
    "ernie4_5_moe", "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling", "inkling2", "jamba", "jetmoe", "kimi_linear",
    "kolibri1", "laguna", "lara_mini", "lfm2_moe", "llama4", "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "minimax_m2",
    "mistral4", "mixtral", "nemotron_h", "olmoe", "param2moe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "solar_open",
)
"""Families whose replay tests/divergence/test_replay_hf.py checks on tiny models (logits, routes, gradients)."""


def explicit_spec(module: torch.nn.Module) -> SiteSpec | None:
    """The :data:`EXPLICIT_SITES` entry for ``module``'s class, if any."""
    cls = type(module)
    for spec in EXPLICIT_SITES:
        if cls.__name__ == spec.class_name and cls.__module__ == spec.module_name:
            return spec
    return None


def is_shadowed(module: torch.nn.Module) -> bool:
    """True when an :data:`EXPLICIT_SITES` entry observes ``module``'s family in its stead (``shadows``)."""
    cls = type(module)
    return any(cls.__name__ == spec.shadows and cls.__module__ == spec.module_name for spec in EXPLICIT_SITES)


@functools.cache
def machinery_forward_code() -> Any:
    """The code object of the ``forward`` that ``@use_experts_implementation`` installs on a class."""
    from transformers.integrations.moe import use_experts_implementation

    class _Probe(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            return hidden_states

    return use_experts_implementation(_Probe).forward.__code__


def is_experts_machinery(module: torch.nn.Module) -> bool:
    """True when ``module``'s class got its ``forward`` from ``@use_experts_implementation``.

    The decorator wraps the class's own forward in a dispatcher (same code
    object for every decorated class) and gives instances ``num_experts``
    users and the ``has_gate`` / ``is_transposed`` flags.
    """
    forward = getattr(type(module), "forward", None)
    return getattr(forward, "__code__", None) is machinery_forward_code() and hasattr(module, "num_experts")


# ---------------------------------------------------------------------------- coverage scan

_EXPERT_COUNT_FIELDS = re.compile(
    r"^\s+(num_local_experts|n_routed_experts|moe_num_experts|num_experts|num_experts_per_tok|moe_topk|moe_k|top_k_experts)\b\s*[:=]",
    re.MULTILINE,
)


def _decorated_with_machinery(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Name) and target.id == "use_experts_implementation":
                    return True
    return False


def moe_family_coverage() -> dict[str, str]:
    """Classify every MoE family of the installed transformers.

    A family (directory of ``transformers/models``) counts as MoE when its
    configuration declares an expert count or per-token expert number. Each
    gets one of: ``"experts"`` (a class decorated with
    ``@use_experts_implementation`` in its modeling file), ``"experts-call"``
    ``"router-topk"`` or ``"router-ids"`` (:data:`EXPLICIT_SITES`), ``"via-other-family"``,
    ``"unsupported"``, or ``"unknown"`` (none of these: a family this adapter
    has not been taught about).
    """
    import transformers.models

    root = Path(transformers.models.__file__).parent
    explicit = {spec.family: spec.kind for spec in EXPLICIT_SITES}
    shadowing = {spec.family for spec in EXPLICIT_SITES if spec.shadows is not None}
    coverage: dict[str, str] = {}
    for family_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        family = family_dir.name
        configs = list(family_dir.glob("configuration_*.py"))
        if not any(_EXPERT_COUNT_FIELDS.search(c.read_text(encoding="utf-8")) for c in configs):
            continue
        if family in shadowing:
            coverage[family] = explicit[family]
        elif any(_decorated_with_machinery(m) for m in family_dir.glob("modeling_*.py")):
            coverage[family] = "experts"
        elif family in explicit:
            coverage[family] = explicit[family]
        elif family in VIA_OTHER_FAMILY:
            coverage[family] = "via-other-family"
        elif family in UNSUPPORTED:
            coverage[family] = "unsupported"
        else:
            coverage[family] = "unknown"
    return coverage


_HOW = {
    "experts": "pre-hook on the experts module (`@use_experts_implementation`)",
    "experts-call": "pre-hook on its experts module (same call convention, listed explicitly)",
    "router-topk": "forward hook on the router, re-running its top-k on the returned logits",
    "router-ids": "forward hook on the router, reading the ids it returns",
    "via-other-family": "built from another family's modeling (see that family)",
    "unsupported": "not observed",
    "unknown": "not classified yet",
}


def replay_coverage() -> dict[str, str]:
    """Per MoE family: ``"tested"``, ``"yes"`` (router selects with ``torch.topk``; not run in the tests),
    or the reason replay is refused / not applicable."""
    import transformers.models

    root = Path(transformers.models.__file__).parent
    out: dict[str, str] = {}
    for family, how in moe_family_coverage().items():
        if how == "unsupported":
            out[family] = "refused: not observed by the adapter"
        elif how == "via-other-family":
            out[family] = "tested" if family in REPLAY_TESTED else "as the family it is built from"
        elif family in REPLAY_REFUSED:
            out[family] = f"refused: {REPLAY_REFUSED[family]}"
        elif not any(re.search(r"\btopk\(", p.read_text(encoding="utf-8")) for p in (root / family).glob("modeling_*.py")):
            out[family] = "refused at run time: no torch.topk in its modeling code"
        else:
            out[family] = "tested" if family in REPLAY_TESTED else "yes"
    return out


def coverage_markdown() -> str:
    """A markdown table of :func:`moe_family_coverage` and :func:`replay_coverage` for the installed transformers."""
    import transformers

    notes = {**UNSUPPORTED, **VIA_OTHER_FAMILY}
    coverage = moe_family_coverage()
    replays = replay_coverage()
    lines = [
        f"Generated by `python -m moetrace.adapters.hf.families` from transformers {transformers.__version__}: "
        f"{len(coverage)} MoE families, {sum(v == 'experts' for v in coverage.values())} through the shared experts machinery; "
        f"replay: {sum(v == 'tested' for v in replays.values())} tested on tiny models, "
        f"{sum(v == 'yes' for v in replays.values())} more whose modeling code selects with `torch.topk` (replayed the same way, "
        "not run in the tests; a router that does not call it raises `ReplayError` at its first forward).",
        "",
        "| family | how | replay | note |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{family}` | {_HOW[how]} | {replays[family]} | {notes.get(family, '')} |" for family, how in coverage.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(coverage_markdown())
