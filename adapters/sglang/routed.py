"""SGLang's per-request routed experts, read into moetrace's capture format.

SGLang started with ``--enable-return-routed-experts`` answers a request sent
with ``return_routed_experts=True`` with ``meta_info["routed_experts"]``: the
base64 of the raw little-endian ``int32`` bytes of an array
``[seq_len - 1, L, k]`` (``L`` = the model's layers, ``k`` = experts per
token), ids in SGLang's *logical* expert space.

Token convention. SGLang's rows are the positions that went through a forward
pass: the prompt's ``P`` tokens and every generated token but the last (the
last sampled token is never fed back), ``P + N - 1 = seq_len - 1`` rows for
``N >= 1`` generated tokens, position order. moetrace's capturer uses the same
convention (``moetrace.capturer``, docs/capture.md), so row ``i`` is position
``i`` in both; a request sent with ``routed_experts_start_len=s`` starts at
position ``s`` instead of 0.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..base import AdapterError

if TYPE_CHECKING:
    from moetrace.routes import RouteSet

__all__ = ["answers_routes", "read_routed_experts", "routed_experts_payload"]


def read_routed_experts(answer: Mapping[str, Any] | str, num_layers: int, top_k: int) -> np.ndarray:
    """One request's routed experts ``[positions, L, k]`` (``int32``) from an SGLang answer.

    Args:
        answer: what SGLang returned for the request (``{"meta_info": {...}}``,
            ``Engine.generate``'s dict or the HTTP JSON), its ``meta_info``, or
            the base64 string itself.
        num_layers: the model's layers ``L`` (``num_hidden_layers``).
        top_k: experts per token ``k``.

    Raises:
        AdapterError: the answer holds no routed experts (the server was not
            started with ``--enable-return-routed-experts``, or the request did
            not ask with ``return_routed_experts=True``), or their size does not
            fit ``[*, L, k]``.
    """
    encoded: Any = answer
    if isinstance(answer, Mapping):
        meta = answer.get("meta_info", answer)
        encoded = meta.get("routed_experts") if isinstance(meta, Mapping) else None
    if not isinstance(encoded, str) or not encoded:
        raise AdapterError(
            "the SGLang answer has no meta_info['routed_experts']; start SGLang with "
            "--enable-return-routed-experts and send the request with return_routed_experts=True"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AdapterError(f"meta_info['routed_experts'] is not base64 ({exc})") from exc
    ids = np.frombuffer(raw, dtype="<i4")
    per_position = num_layers * top_k
    if ids.size % per_position:
        raise AdapterError(
            f"meta_info['routed_experts'] holds {ids.size} ids, not a multiple of L*k = {num_layers}*{top_k}; "
            "pass the model's num_hidden_layers and experts per token"
        )
    return ids.reshape(-1, num_layers, top_k).astype(np.int32)


def routed_experts_payload(answer: Mapping[str, Any] | str, num_layers: int, top_k: int) -> dict[str, Any]:
    """The same ids in moetrace's wire format (``moetrace.wire.encode_routed_experts``)."""
    from moetrace.wire import encode_routed_experts

    return encode_routed_experts(read_routed_experts(answer, num_layers, top_k))


def answers_routes(answers: Any, num_layers: int, top_k: int) -> RouteSet:
    """Every request's routed experts from SGLang answers, keyed by SGLang's request id (``meta_info["id"]``).

    ``answers``: a list of answers (``Engine.generate`` dicts or HTTP JSON bodies), or a
    mapping request id -> answer. Rows are the model's layers (``-1`` for dense ones,
    as SGLang returns them), from position 0. SGLang records no provenance: the routes
    carry none (a weight-version check assumes them, :mod:`moetrace.provenance`).

    Raises:
        AdapterError: an answer without routed experts or without a request id, or one id twice.
    """
    from moetrace.routes import RouteSet

    items = list(answers.items()) if isinstance(answers, Mapping) else [(None, a) for a in answers]
    requests: dict[str, tuple[int, np.ndarray]] = {}
    for key, answer in items:
        meta = answer.get("meta_info", {}) if isinstance(answer, Mapping) else {}
        rid = key if key is not None else meta.get("id") if isinstance(meta, Mapping) else None
        if rid is None:
            raise AdapterError("an SGLang answer has no meta_info['id']; give the answers as a mapping request id -> answer")
        if str(rid) in requests:
            raise AdapterError(f"request id {rid!r} appears twice among the answers")
        requests[str(rid)] = (0, read_routed_experts(answer, num_layers, top_k))
    return RouteSet(requests, id_space="logical")
