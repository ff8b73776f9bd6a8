"""Parallel layouts: which ranks route the same tokens, and how to count them once.

A rank's recorder sees the routing of the tokens *that rank* computes. What
that view means depends on the engine's parallel layout:

- **TP attention** (vLLM, SGLang without DP attention): the ranks of one
  tensor-parallel group all run the router on the same hidden states and
  select the same experts for the same tokens. Their views are replicas:
  adding them up would count every token ``tp_size`` times.
- **DP attention** (SGLang ``--enable-dp-attention``) and data-parallel
  replicas (vLLM ``data_parallel_size``): ranks hold different tokens; each
  view is exact and views add up.
- **EP**: ranks hold different experts (physical slots). Under TP attention the
  router output is still replicated; under DP attention each rank dispatches
  its own tokens. Per-rank load comes from the placement, not from adding views.
- **PP**: stages hold different layers of the same tokens; their layer counts
  add up, their tokens are the same tokens.

:class:`RankLayout` records one rank's coordinates; :func:`token_group` names
the group of ranks whose views are replicas of each other, and
:func:`counted_rows` picks one view per group (the lowest rank present), which
is how traces, merges, analysis and Prometheus counters count each token once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["CountedRows", "RankLayout", "counted_rows"]


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _coordinate(name: str, value: object, size: int, size_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < size:
        raise ValueError(f"{name}={value!r} is outside [0, {size_name}={size})")
    return int(value)


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """One rank's place in the engine's parallel layout.

    Args:
        rank: global rank in the world (``torch.distributed`` rank).
        world_size: ranks in the world.
        tp_size, tp_rank: tensor-parallel group size and coordinate.
        dp_size, dp_rank: data-parallel size and coordinate. With TP attention
            these are independent replicas (vLLM's ``data_parallel_size``); with
            DP attention (``attn_tp_size < tp_size``) they are SGLang's attention
            DP groups inside the TP group (``dp_size * attn_tp_size == tp_size``).
        ep_size, ep_rank: expert-parallel size and coordinate (physical slots
            ``[ep_rank * P / ep_size, (ep_rank + 1) * P / ep_size)``).
        pp_size, pp_rank: pipeline stages and this rank's stage.
        attn_tp_size: ranks that run attention on the same tokens; ``None``
            means ``tp_size`` (TP attention).
        router_tp_size: consecutive TP ranks whose routers see the same tokens;
            ``None`` means ``attn_tp_size``. SGLang's DP attention without an
            all-to-all backend gathers every DP group's tokens before the MoE
            layer, so there every TP rank routes the whole batch
            (``router_tp_size = tp_size``); with DeepEP each attention group
            routes its own (``attn_tp_size``).
        source: who described the layout (``"vllm"``, ``"sglang"``,
            ``"reference"``, ``"default"`` when nobody did).

    Raises:
        ValueError: a size is not positive, a coordinate is out of range, or
            the sizes do not fit together (names the values and the rule).
    """

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    attn_tp_size: int | None = None
    router_tp_size: int | None = None
    source: str = "default"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        world = _size("world_size", self.world_size)
        set_(self, "rank", _coordinate("rank", self.rank, world, "world_size"))
        for axis in ("tp", "dp", "ep", "pp"):
            size = _size(f"{axis}_size", getattr(self, f"{axis}_size"))
            set_(self, f"{axis}_size", size)
            set_(self, f"{axis}_rank", _coordinate(f"{axis}_rank", getattr(self, f"{axis}_rank"), size, f"{axis}_size"))
        tp, dp, pp = self.tp_size, self.dp_size, self.pp_size
        attn = tp if self.attn_tp_size is None else _size("attn_tp_size", self.attn_tp_size)
        if tp % attn:
            raise ValueError(f"attn_tp_size={attn} must divide tp_size={tp}")
        set_(self, "attn_tp_size", attn)
        router = attn if self.router_tp_size is None else _size("router_tp_size", self.router_tp_size)
        if router % attn or tp % router:
            raise ValueError(f"router_tp_size={router} must be a multiple of attn_tp_size={attn} and divide tp_size={tp}")
        set_(self, "router_tp_size", router)
        set_(self, "world_size", world)
        if attn < tp:  # DP attention: the DP groups partition the TP group
            if attn * dp != tp:
                raise ValueError(f"with DP attention dp_size * attn_tp_size must equal tp_size, got {dp} * {attn} != {tp}")
            if self.dp_rank != self.tp_rank // attn:
                raise ValueError(f"with DP attention dp_rank must be tp_rank // attn_tp_size = {self.tp_rank // attn}, got {self.dp_rank}")
            expected = tp * pp
        else:
            expected = tp * dp * pp
        if world != expected:
            raise ValueError(f"world_size={world} does not match the layout ({self.describe()} needs {expected} ranks)")

    # ------------------------------------------------------------------ derived
    @property
    def attention(self) -> str:
        """``"tp"`` when the TP group shares the tokens, ``"dp"`` when ranks (or attention groups) hold their own."""
        return "dp" if (self.attn_tp_size or 1) < self.tp_size else "tp"

    @property
    def attn_tp_rank(self) -> int:
        """Coordinate inside the attention TP group."""
        return self.tp_rank % int(self.attn_tp_size or 1)

    @property
    def router_rank(self) -> int:
        """Coordinate inside the group of ranks whose routers see the same tokens (0 = the one counted)."""
        return self.tp_rank % int(self.router_tp_size or 1)

    @property
    def token_group(self) -> int:
        """Index of the group of ranks whose views are replicas: same stage, same DP replica, same router group."""
        router = int(self.router_tp_size or 1)
        replicas = self.dp_size if self.attention == "tp" else 1  # DP attention's groups live inside the TP group
        replica = self.dp_rank if self.attention == "tp" else 0
        return (self.pp_rank * replicas + replica) * (self.tp_size // router) + self.tp_rank // router

    @property
    def replicates_tokens(self) -> bool:
        """True when another rank of the same router group routes these same tokens and counts them."""
        return self.router_rank != 0

    def sizes(self) -> tuple[int, ...]:
        """``(world_size, tp_size, dp_size, ep_size, pp_size, attn_tp_size, router_tp_size)``: what every rank of one run shares."""
        return (self.world_size, self.tp_size, self.dp_size, self.ep_size, self.pp_size, int(self.attn_tp_size or 1), int(self.router_tp_size or 1))

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: sizes, coordinates, derived attention kind and token group, source (``/status``)."""
        return {**dataclasses.asdict(self), "attention": self.attention, "attn_tp_rank": self.attn_tp_rank,
                "router_rank": self.router_rank, "token_group": self.token_group, "replicates_tokens": self.replicates_tokens}

    def describe(self) -> str:
        """A short human form, e.g. ``TP2 (TP attention) EP2``."""
        parts = [f"TP{self.tp_size}"]
        if self.tp_size > 1:
            parts.append(f"({self.attention.upper()} attention)")
        if self.dp_size > 1:
            parts.append(f"DP{self.dp_size}")
        if self.ep_size > 1:
            parts.append(f"EP{self.ep_size}")
        if self.pp_size > 1:
            parts.append(f"PP{self.pp_size}")
        return " ".join(parts)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def independent(cls, rank: int = 0, world_size: int = 1, ep_size: int = 1, ep_rank: int = 0, source: str = "default") -> RankLayout:
        """Every rank routes its own tokens (data parallel; the reference EP runtime): all views add up."""
        return cls(rank=rank, world_size=world_size, dp_size=world_size, dp_rank=rank, ep_size=ep_size, ep_rank=ep_rank, source=source)

    @classmethod
    def tensor_parallel(cls, rank: int, world_size: int, ep_size: int = 1, ep_rank: int = 0, source: str = "default") -> RankLayout:
        """One TP group of ``world_size`` ranks with TP attention: every rank routes the same tokens."""
        return cls(rank=rank, world_size=world_size, tp_size=world_size, tp_rank=rank, ep_size=ep_size, ep_rank=ep_rank, source=source)


class CountedRows(NamedTuple):
    """Which rank rows a total counts: ``assignments [R]`` (one view per token group) and
    ``tokens [R]`` (those of them on the first pipeline stage present: stages share the tokens)."""

    assignments: np.ndarray
    tokens: np.ndarray


def counted_rows(groups: Sequence[int] | np.ndarray, ranks: Sequence[int] | np.ndarray | None = None,
                 pp_ranks: Sequence[int] | np.ndarray | None = None) -> CountedRows:
    """The rank rows whose views are counted: the lowest rank of each token group present.

    Args:
        groups: token group of each row ``[R]`` (:attr:`RankLayout.token_group`).
        ranks: global rank of each row ``[R]`` (default: row order).
        pp_ranks: pipeline stage of each row ``[R]`` (default: all 0).
    """
    groups = np.asarray(groups, dtype=np.int64)
    ranks = np.arange(len(groups)) if ranks is None else np.asarray(ranks, dtype=np.int64)
    stages = np.zeros(len(groups), dtype=np.int64) if pp_ranks is None else np.asarray(pp_ranks, dtype=np.int64)
    mask = np.zeros(len(groups), dtype=bool)
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        mask[members[np.argmin(ranks[members])]] = True
    tokens = mask & (stages == (stages[mask].min() if mask.any() else 0))
    return CountedRows(mask, tokens)
