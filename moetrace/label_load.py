"""Request labels (tenant, workload, session) and the expert load each label produces, live.

A label is a short string attached to a request by whoever sends it (an API
gateway knows the tenant; the client knows the workload). moetrace takes them
through each engine's request metadata where it has one, and keeps the set
bounded: :func:`check_labels` refuses more than :data:`MAX_LABEL_KEYS` keys or
values longer than :data:`MAX_LABEL_CHARS`, and :class:`LabelLoad` tracks at
most ``max_tracked`` distinct values of one key exactly, folding every later
value into :data:`OTHER`.

:class:`LabelLoad` adds a finished request's routes ``[n, L, k]`` (host
numpy, at request completion: never inside a forward) to its label's
``[L, E]`` logical counts. Its :meth:`~LabelLoad.snapshot` gives each label's
share of the hot experts' *excess* (:func:`moetrace.balance.expert_excess`:
load above an even share, additive over labels), its share of tokens, and
how far its expert profile is from everyone else's (JS divergence), the
figures the exporters publish for the top-N labels.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import balance

__all__ = ["MAX_LABEL_CHARS", "MAX_LABEL_KEYS", "OTHER", "LabelError", "LabelLoad", "LabelLoadSnapshot", "check_labels", "hot_cells"]

MAX_LABEL_KEYS = 8
MAX_LABEL_CHARS = 64
OTHER = "other"
"""The label value every value past the tracked ones is folded into."""


class LabelError(ValueError):
    """Labels that are not a small mapping of short strings; the message says which."""


def check_labels(labels: Mapping[str, Any] | None, what: str = "labels") -> dict[str, str]:
    """``labels`` as a ``{str: str}`` dict, validated (``None`` -> ``{}``).

    Raises:
        LabelError: not a mapping, more than :data:`MAX_LABEL_KEYS` keys, a key or
            value that is not a non-empty string of at most :data:`MAX_LABEL_CHARS`.
    """
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise LabelError(f"{what}: expected a mapping of label name -> value, got {type(labels).__name__}")
    if len(labels) > MAX_LABEL_KEYS:
        raise LabelError(f"{what}: {len(labels)} labels; at most {MAX_LABEL_KEYS} per request (keep label sets small)")
    out = {}
    for key, value in labels.items():
        for part, name in ((key, "name"), (value, f"value of {key!r}")):
            if not isinstance(part, str) or not part or len(part) > MAX_LABEL_CHARS:
                raise LabelError(f"{what}: label {name} {part!r} must be a non-empty string of at most {MAX_LABEL_CHARS} characters")
        out[key] = value
    return out


def hot_cells(counts: np.ndarray, hot: int) -> np.ndarray:
    """``[L, hot]`` expert ids of each layer's ``hot`` busiest experts (ties: lowest id) from ``[L, E]`` counts."""
    return np.argsort(-np.asarray(counts), axis=1, kind="stable")[:, :hot]


def route_counts(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E]`` copies per logical expert of one request's routes ``[n, L, k]`` (``-1`` ignored)."""
    ids = np.asarray(routes)
    num_layers = ids.shape[1]
    valid = ids >= 0
    flat = (np.arange(num_layers)[None, :, None] * num_experts + np.where(valid, ids, 0))[valid]
    return np.bincount(flat, minlength=num_layers * num_experts).reshape(num_layers, num_experts)


def routed_tokens(routes: np.ndarray) -> int:
    """Tokens of routes ``[n, L, k]`` that were routed in at least one layer."""
    return int((np.asarray(routes) >= 0).all(axis=2).any(axis=1).sum())


def token_share(tokens: np.ndarray) -> np.ndarray:
    """``[G]`` each group's share of the tokens (zeros when there are none)."""
    total = tokens.sum()
    return tokens / total if total else np.zeros(len(tokens))


def hot_excess_share(counts: np.ndarray, hot: np.ndarray) -> np.ndarray:
    """``[G]`` each group's share of the summed excess of every layer's hot experts that carry any.

    Args:
        counts: ``[G, L, E]`` copies per group.
        hot: ``[L, h]`` the hot experts (:func:`hot_cells` of the summed counts).

    Excess (:func:`moetrace.balance.expert_excess`) is additive over groups, so the
    shares sum to 1; zeros when no hot expert carries excess (an even load).
    """
    rows = np.arange(hot.shape[0])[:, None]
    positive = balance.expert_excess(counts.sum(axis=0))[rows, hot] > 0  # [L, h]
    per_group = (balance.expert_excess(counts)[:, rows, hot] * positive).sum(axis=(1, 2))
    total = per_group.sum()
    return per_group / total if total > 0 else np.zeros(len(counts))


def profile_divergence(counts: np.ndarray) -> np.ndarray:
    """``[G]`` mean over layers of the JS divergence between each group's expert profile and the rest's (``[G, L, E]``)."""
    total = counts.sum(axis=0)
    return np.array([float(balance.js_divergence(c, total - c).mean()) for c in counts])


@dataclasses.dataclass(frozen=True)
class LabelLoadSnapshot:
    """Per-label figures at one moment (``G`` labels, ``OTHER`` last when present).

    Attributes:
        key: the label name tracked.
        labels: ``[G]`` label values.
        requests, tokens: ``[G]`` requests and routed tokens added.
        counts: ``[G, L, E]`` logical copies.
        hot: ``[L, h]`` each layer's hottest experts over all labels.
    """

    key: str
    labels: list[str]
    requests: np.ndarray
    tokens: np.ndarray
    counts: np.ndarray
    hot: np.ndarray

    @property
    def token_share(self) -> np.ndarray:
        """``[G]`` each label's share of the routed tokens."""
        return token_share(self.tokens)

    @property
    def hot_excess_share(self) -> np.ndarray:
        """``[G]`` each label's share of the hot experts' excess (:func:`hot_excess_share`)."""
        return hot_excess_share(self.counts, self.hot)

    @property
    def divergence(self) -> np.ndarray:
        """``[G]`` how far each label's expert profile is from the rest's (:func:`profile_divergence`)."""
        return profile_divergence(self.counts)


class LabelLoad:
    """Live per-label expert load of finished requests, bounded in labels.

    Args:
        num_layers, num_experts: ``L`` and logical ``E`` of the routes added.
        key: the label name to group by (``"tenant"``...); requests without it count as ``"-"``.
        max_tracked: distinct values kept exactly; later ones are folded into :data:`OTHER`.
        hot: hot experts per layer (default: the hottest 10%, :func:`moetrace.balance.hot_expert_count`).
    """

    def __init__(self, num_layers: int, num_experts: int, key: str, max_tracked: int = 64, hot: int | None = None) -> None:
        if num_layers < 1 or num_experts < 2:
            raise ValueError(f"num_layers must be >= 1 and num_experts >= 2, got {num_layers} and {num_experts}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be positive, got {max_tracked}")
        check_labels({key: "x"}, "key")
        self.num_layers, self.num_experts, self.key, self.max_tracked = num_layers, num_experts, key, max_tracked
        self.hot = hot or balance.hot_expert_count(num_experts)
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}
        self._counts = np.zeros((max_tracked + 1, num_layers, num_experts), dtype=np.int64)  # last row: OTHER
        self._requests = np.zeros(max_tracked + 1, dtype=np.int64)
        self._tokens = np.zeros(max_tracked + 1, dtype=np.int64)

    def add(self, labels: Mapping[str, str] | None, routes: np.ndarray) -> None:
        """Count one finished request's logical routes ``[n, L, k]`` (``-1`` rows ignored) under its label.

        Raises:
            LabelError: invalid labels.
            ValueError: routes of another shape, or ids outside ``[-1, E)``.
        """
        value = check_labels(labels).get(self.key, "-")
        ids = np.asarray(routes)
        if ids.ndim != 3 or ids.shape[1] != self.num_layers:
            raise ValueError(f"routes must be [n, {self.num_layers}, k], got shape {ids.shape}")
        if ids.size and (ids.min() < -1 or ids.max() >= self.num_experts):
            raise ValueError(f"routes hold ids outside [-1, {self.num_experts}): logical ids are expected (map physical ids first)")
        counts = route_counts(ids, self.num_experts)
        tokens = routed_tokens(ids)
        with self._lock:
            row = self._index.get(value)
            if row is None:
                row = len(self._index) if len(self._index) < self.max_tracked else self.max_tracked
                if row < self.max_tracked:
                    self._index[value] = row
            self._counts[row] += counts
            self._requests[row] += 1
            self._tokens[row] += tokens

    def snapshot(self, top: int | None = None) -> LabelLoadSnapshot:
        """The ``top`` labels by tokens (all tracked when ``None``) and :data:`OTHER` holding the rest."""
        with self._lock:
            counts, requests, tokens = self._counts.copy(), self._requests.copy(), self._tokens.copy()
            index = dict(self._index)
        names = sorted(index, key=lambda v: (-tokens[index[v]], v))
        keep = names if top is None else names[:top]
        rest = [index[v] for v in names if v not in keep] + [self.max_tracked]
        rows = [index[v] for v in keep]
        labels = list(keep)
        stack = [counts[rows], counts[rest].sum(axis=0, keepdims=True)]
        req = [requests[rows], requests[rest].sum(keepdims=True)]
        tok = [tokens[rows], tokens[rest].sum(keepdims=True)]
        if requests[rest].sum():
            labels.append(OTHER)
        else:
            stack, req, tok = stack[:1], req[:1], tok[:1]
        all_counts = np.concatenate(stack) if labels else np.zeros((0, self.num_layers, self.num_experts), np.int64)
        return LabelLoadSnapshot(
            key=self.key, labels=labels, requests=np.concatenate(req) if labels else np.zeros(0, np.int64),
            tokens=np.concatenate(tok) if labels else np.zeros(0, np.int64), counts=all_counts,
            hot=hot_cells(all_counts.sum(axis=0) if labels else np.zeros((self.num_layers, self.num_experts)), self.hot),
        )
