"""Which requests, or which labels (tenant, workload, session), make an expert or a rank hot.

Input: per-request routes (a routes file from the capturer, SGLang's or
vLLM's ``routed_experts``, the reference serving loop), with labels where the
requests carried them. Everything is counted in logical expert space.

For each layer's hot experts, the figure is each group's share of the
expert's **excess** (:func:`moetrace.balance.expert_excess`: copies above an
even share of the layer). Excess is additive over groups, so the shares of
one expert sum to 1, and a group that sends many tokens but spreads them
evenly has a share near 0 however large its share of the load. The same for
the hottest EP rank of each layer (contiguous placement over ``ep_size``).

Per group: its share of the tokens, its share of the summed excess of every
layer's hot experts, their ratio (lift), and how far its expert profile is
from the rest's (mean JS divergence over layers). For labels, a permutation
test says whether a group takes more of the excess than the same number of
requests drawn at random would (the labels shuffled over requests,
``permutations`` times, seeded); a *culprit* is a label whose p-value is
below ``alpha`` divided by the number of labels (Bonferroni). A workload in
which the labels are mixed at random names no culprit.

Memory: ``[Q, L, E]`` int32 per-request counts (``Q`` requests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import balance
from ..label_load import (
    OTHER,
    hot_cells,
    hot_excess_share,
    profile_divergence,
    route_counts,
    routed_tokens,
    token_share,
)
from ..routes import RoutesError, RouteSet

__all__ = ["ATTRIBUTION_SCHEMA", "Attribution", "attribute"]

ATTRIBUTION_SCHEMA = "moetrace-attribution"
BY = ("request", "label")
#: Label values analysed one by one; the rest (fewest tokens) are summed into ``"other"``.
MAX_GROUPS = 64
NO_LABEL = "-"


@dataclasses.dataclass
class Attribution:
    """The attribution of one routes set (see the module docstring); :meth:`to_dict` is the JSON."""

    by: str
    key: str | None
    groups: list[str]
    group_requests: np.ndarray  # [G]
    group_tokens: np.ndarray  # [G]
    group_counts: np.ndarray  # [G, L, E]
    layer_ids: list[int]
    hot: np.ndarray  # [L, h]
    ep_size: int
    p_values: np.ndarray | None  # [G] (labels only)
    alpha: float
    top: int

    @property
    def total(self) -> np.ndarray:
        """``[L, E]`` copies of every request."""
        return self.group_counts.sum(axis=0)

    @property
    def token_share(self) -> np.ndarray:
        return token_share(self.group_tokens)

    @property
    def hot_excess_share(self) -> np.ndarray:
        """``[G]`` share of the summed excess of every layer's hot experts (:func:`moetrace.label_load.hot_excess_share`)."""
        return hot_excess_share(self.group_counts, self.hot)

    @property
    def divergence(self) -> np.ndarray:
        """``[G]`` mean over layers of the JS divergence of a group's profile from the rest's."""
        return profile_divergence(self.group_counts)

    @property
    def culprits(self) -> list[str]:
        """Labels that take significantly more of the hot experts' excess than random groups of their size."""
        if self.p_values is None:
            return []
        threshold = self.alpha / max(len(self.groups), 1)
        share, tokens = self.hot_excess_share, self.token_share
        return [g for g, p, s, t in zip(self.groups, self.p_values, share, tokens, strict=True) if p < threshold and s > t]

    def _contributors(self, values: np.ndarray, excess: float) -> list[dict[str, Any]]:
        """The groups with the largest shares of one cell's excess ``values [G]``."""
        order = np.argsort(-values, kind="stable")[: self.top]
        return [{"who": self.groups[g], "share_of_excess": float(values[g] / excess)} for g in order if excess > 0]

    def to_dict(self) -> dict[str, Any]:
        total = self.total
        excess_total = balance.expert_excess(total)
        excess_groups = balance.expert_excess(self.group_counts)
        layers = []
        for i, layer in enumerate(self.layer_ids):
            hot = []
            for e in self.hot[i]:
                x = float(excess_total[i, e])
                if x <= 0:
                    continue
                load = self.group_counts[:, i, e]
                entry = {"expert": int(e), "count": int(total[i, e]), "excess": x,
                         "contributors": self._contributors(excess_groups[:, i, e], x)}
                for c in entry["contributors"]:
                    c["share_of_load"] = float(load[self.groups.index(c["who"])] / total[i, e])
                hot.append(entry)
            row: dict[str, Any] = {"layer": int(layer), "hot_experts": hot}
            if self.ep_size > 1:
                ranks = balance.rank_load(self.group_counts[:, i, :], self.ep_size)  # [G, R]
                rank_total = ranks.sum(axis=0)
                r = int(np.argmax(rank_total))
                x = float(balance.expert_excess(rank_total)[r])
                row["hottest_rank"] = {"rank": r, "load": int(rank_total[r]), "excess": x,
                                       "contributors": self._contributors(balance.expert_excess(ranks)[:, r], x)}
            layers.append(row)
        share, tokens, div = self.hot_excess_share, self.token_share, self.divergence
        groups = []
        for g, name in enumerate(self.groups):
            groups.append({
                "who": name, "requests": int(self.group_requests[g]), "tokens": int(self.group_tokens[g]),
                "token_share": float(tokens[g]), "hot_excess_share": float(share[g]),
                "lift": float(share[g] / tokens[g]) if tokens[g] else None, "divergence": float(div[g]),
                "p_value": None if self.p_values is None else float(self.p_values[g]),
            })
        groups.sort(key=lambda d: -d["hot_excess_share"])
        return {
            "schema": ATTRIBUTION_SCHEMA, "schema_version": 1, "by": self.by, "key": self.key,
            "requests": int(self.group_requests.sum()), "tokens": int(self.group_tokens.sum()),
            "ep_size": self.ep_size, "layers": layers, "groups": groups[: max(self.top, len(self.culprits))],
            "culprits": self.culprits, "alpha": self.alpha,
        }


def _label_key(routes: RouteSet, key: str | None) -> str:
    keys = sorted({k for labels in routes.labels.values() for k in labels})
    if key is not None:
        if key not in keys:
            raise RoutesError(f"no request carries the label {key!r}; the labels here are {keys or 'none (save_routes(labels=...))'}")
        return key
    if len(keys) != 1:
        raise RoutesError(f"choose the label to group by (--by label:NAME); the requests carry {keys or 'no labels (save_routes(labels=...))'}")
    return keys[0]


def attribute(
    routes: RouteSet,
    *,
    by: str = "label",
    key: str | None = None,
    ep_size: int = 1,
    hot: int | None = None,
    top: int = 5,
    permutations: int = 1000,
    alpha: float = 0.01,
    seed: int = 0,
) -> Attribution:
    """Attribute each layer's hot experts and hottest rank to the requests or labels that drove them.

    Args:
        routes: per-request routes (:func:`moetrace.routes.load_routes`); physical
            routes are mapped to logical ids through their map.
        by: ``"request"`` (every request its own group) or ``"label"``.
        key: the label name (needed when requests carry several).
        ep_size: EP ranks for the rank figures (contiguous placement); 1: none.
        hot: hot experts per layer (default: the hottest 10%).
        top: contributors listed per hot expert, groups listed.
        permutations: label shuffles of the significance test (labels only).
        alpha: family-wise significance level of a culprit.
        seed: seed of the shuffles.

    Raises:
        RoutesError: no routed requests, labels missing, ids without an expert count.
        ValueError: a bad ``by``, ``ep_size``, ``top``, ``permutations`` or ``alpha``.
    """
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    if top < 1 or permutations < 1 or not 0 < alpha < 1:
        raise ValueError(f"top and permutations must be positive and alpha in (0, 1); got {top}, {permutations}, {alpha}")
    rs = routes.logical()
    if not rs.requests:
        raise RoutesError("no requests to attribute")
    arrays = {rid: arr for rid, (_, arr) in rs.requests.items()}
    num_layers = {a.shape[1] for a in arrays.values()}
    if len(num_layers) != 1:
        raise RoutesError(f"requests have different layer counts {sorted(num_layers)}; they are not routes of one model")
    num_experts = rs.num_experts or int(max(int(a.max(initial=-1)) for a in arrays.values())) + 1
    if num_experts < 2:
        raise RoutesError("the routes hold no expert ids")
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the {num_experts} experts")
    rids = sorted(arrays)
    counts = np.stack([route_counts(arrays[r], num_experts) for r in rids]).astype(np.int32)  # [Q, L, E]
    tokens = np.array([routed_tokens(arrays[r]) for r in rids], dtype=np.int64)
    label_key = None
    if by == "request":
        names, member = rids, np.arange(len(rids))
    else:
        label_key = _label_key(rs, key)
        values = [rs.labels.get(r, {}).get(label_key, NO_LABEL) for r in rids]
        by_tokens: dict[str, int] = {}
        for v, t in zip(values, tokens, strict=True):
            by_tokens[v] = by_tokens.get(v, 0) + int(t)
        names = sorted(by_tokens, key=lambda v: (-by_tokens[v], v))
        if len(names) > MAX_GROUPS:
            names = [*names[: MAX_GROUPS - 1], OTHER]
        index = {v: i for i, v in enumerate(names)}
        member = np.array([index.get(v, len(names) - 1) for v in values])
    num_groups = len(names)
    one_hot = np.zeros((num_groups, len(rids)), dtype=np.int64)
    one_hot[member, np.arange(len(rids))] = 1
    group_counts = (one_hot @ counts.reshape(len(rids), -1)).reshape(num_groups, *counts.shape[1:])
    total = group_counts.sum(axis=0)
    cells = hot_cells(total, hot or balance.hot_expert_count(num_experts))
    layer_ids = rs.layer_ids if rs.layer_ids is not None and len(rs.layer_ids) == counts.shape[1] else list(range(counts.shape[1]))
    p_values = None
    if by == "label" and num_groups > 1:
        p_values = _permutation_p_values(counts, member, num_groups, cells, permutations, np.random.default_rng(seed))
    return Attribution(by, label_key, list(names), np.bincount(member, minlength=num_groups), one_hot @ tokens, group_counts,
                       [int(x) for x in layer_ids], cells, ep_size, p_values, alpha, top)


def _permutation_p_values(counts: np.ndarray, member: np.ndarray, num_groups: int, cells: np.ndarray, permutations: int,
                          rng: np.random.Generator) -> np.ndarray:
    """``[G]`` one-sided p-values of each group's hot-excess share under label shuffles.

    Excess is additive, so a group's share is the sum of its requests' own
    hot-cell excesses ``h[q]`` over the total; a shuffle only regroups ``h``.
    """
    rows = np.arange(cells.shape[0])[:, None]
    positive = balance.expert_excess(counts.sum(axis=0))[rows, cells] > 0  # [L, h]
    per_request = (balance.expert_excess(counts)[:, rows, cells] * positive).sum(axis=(1, 2))  # [Q]
    observed = np.bincount(member, weights=per_request, minlength=num_groups)
    exceed = np.zeros(num_groups, dtype=np.int64)
    for _ in range(permutations):
        shuffled = np.bincount(rng.permutation(member), weights=per_request, minlength=num_groups)
        exceed += shuffled >= observed - 1e-9
    return (1 + exceed) / (1 + permutations)
