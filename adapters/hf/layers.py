"""Find the MoE layers of a transformers model and number them compactly.

Each observed module becomes a :class:`MoESite`: where it is, how it is
hooked, which model layer it belongs to and its compact MoE index. Dense
layers leave gaps in the model numbering (DeepSeek-V3's
``first_k_dense_replace``, Qwen's ``mlp_only_layers``, ``decoder_sparse_step``);
the compact index ``i`` maps to model layer ``layer_ids[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..base import AdapterError, NoMoELayersError
from .families import UNSUPPORTED, SiteSpec, explicit_spec, is_experts_machinery, is_shadowed

__all__ = ["MoESite", "config_top_k", "find_moe_sites", "model_top_k"]

# Names transformers configurations use for "experts per token".
_TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k_experts", "top_k")


@dataclass(frozen=True)
class MoESite:
    """One observed MoE module.

    Attributes:
        name: qualified module name in the model (``"model.layers.3.mlp.experts"``).
        module: the module hooked.
        kind: ``"experts"`` (shared machinery), ``"experts-call"``, ``"router-topk"`` or ``"router-ids"``.
        num_experts: expert ids this module can see.
        layer_id: model layer index (unique, increasing in model order).
        index: compact MoE layer index ``0..L-1``.
        spec: the explicit spec for families outside the machinery.
    """

    name: str
    module: torch.nn.Module
    kind: str
    num_experts: int
    layer_id: int
    index: int
    spec: SiteSpec | None = None

    @property
    def on_router(self) -> bool:
        """Whether the site is a router (no experts module of this layer is hooked)."""
        return self.spec is not None and self.spec.on_router


def _layer_position(model: torch.nn.Module, name: str) -> tuple[str, int, int]:
    """``(list path, index in it, list length)`` of the innermost ``ModuleList`` entry holding ``name``."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if parts[cut].isdigit():
            container = model.get_submodule(".".join(parts[:cut]))
            if isinstance(container, torch.nn.ModuleList):
                return ".".join(parts[:cut]), int(parts[cut]), len(container)
    return "", 0, 1


def _candidates(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, SiteSpec | None]]:
    found: list[tuple[str, torch.nn.Module, str, SiteSpec | None]] = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if is_experts_machinery(module) and not is_shadowed(module):
            found.append((name, module, "experts", None))
            continue
        spec = explicit_spec(module)
        if spec is None:
            continue
        if spec.parent_class is not None:
            parent_name, _, child = name.rpartition(".")
            parent = modules.get(parent_name)
            if child != "router" or parent is None or type(parent).__name__ != spec.parent_class:
                continue
        found.append((name, module, spec.kind, spec))
    return found


def find_moe_sites(model: torch.nn.Module) -> list[MoESite]:
    """Every MoE module of ``model`` that can be observed, in model order.

    Raises:
        NoMoELayersError: the model has no MoE layer this adapter observes
            (the message names the family when it is a known unsupported one).
        AdapterError: two MoE modules share one model layer.
    """
    candidates = _candidates(model)
    if not candidates:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        reason = UNSUPPORTED.get(model_type or "")
        detail = (
            f"its family '{model_type}' is not supported: {reason}" if reason else
            "no module was built by transformers' @use_experts_implementation and none matches the "
            "router-level families (moetrace.adapters.hf.families.EXPLICIT_SITES)"
        )
        raise NoMoELayersError(f"{type(model).__name__} has no MoE layer moetrace can observe: {detail}")
    groups: dict[str, int] = {}
    offset = 0
    sites: list[MoESite] = []
    seen: dict[int, str] = {}
    for name, module, kind, spec in candidates:
        group, position, length = _layer_position(model, name)
        if group not in groups:
            groups[group] = offset
            offset += length
        layer_id = groups[group] + position
        if layer_id in seen:
            raise AdapterError(
                f"two MoE modules in one model layer ({seen[layer_id]} and {name}); moetrace numbers one MoE "
                "layer per decoder layer. Instrument a sub-model that has one MoE module per layer"
            )
        seen[layer_id] = name
        num_experts = int(module.num_experts) if spec is None else int(spec.num_experts(module))
        sites.append(MoESite(name, module, kind, num_experts, layer_id, len(sites), spec))
    return sites


def config_top_k(config: object) -> int | None:
    """Experts per token from a transformers configuration (text and MoE sub-configs searched), or ``None``."""
    configs: list[object] = []
    while config is not None and all(config is not c for c in configs):
        configs.append(config)
        config = config.get_text_config() if hasattr(config, "get_text_config") else None
    for config in list(configs):
        for sub in ("ffn_config", "moe_config"):
            if getattr(config, sub, None) is not None:
                configs.append(getattr(config, sub))
    for config in configs:
        for field in _TOP_K_FIELDS:
            value = getattr(config, field, None)
            if isinstance(value, (list, tuple)) and value and len(set(value)) == 1:
                value = value[0]
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def model_top_k(model: torch.nn.Module, sites: Sequence[MoESite]) -> int:
    """Experts per token, from the router modules or the model's configuration.

    Raises:
        AdapterError: when neither gives one value.
    """
    values = {int(site.module.top_k) for site in sites if isinstance(getattr(site.module, "top_k", None), int)}
    if not values:
        from_config = config_top_k(getattr(model, "config", None))
        values = {from_config} if from_config is not None else set()
    if len(values) != 1:
        found = sorted(values) if values else "none"
        raise AdapterError(
            f"cannot tell how many experts each token is routed to (found {found} in the routers and the "
            f"configuration fields {list(_TOP_K_FIELDS)}); pass top_k=<k> to instrument()"
        )
    return values.pop()
