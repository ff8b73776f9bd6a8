"""A small multi-layer MoE language model that runs dense (oracle layers) or expert-parallel.

Layer ``i``: ``x += attn(norm(x))``; ``x += ffn(norm(x))`` where ``ffn`` is an
MoE layer, or a dense SwiGLU MLP for the layers in ``ModelConfig.dense_layers``
(as DeepSeek's first dense layers), so the recorder's compact MoE numbering
``0..L_moe-1`` maps to model layer ids with gaps: :attr:`ReferenceMoEModel.moe_layer_ids`.

The token mixer is single-head causal attention. Two entry points:
:meth:`~ReferenceMoEModel.forward` on ``[B, S]`` token ids, and
:meth:`~ReferenceMoEModel.forward_batch` on a flat continuous batch whose keys
and values live in a :class:`KVCache` addressed by KV slot (the serving path).

Every parameter is drawn from a generator seeded by ``(seed, layer, role,
expert)``: a dense model and the EP ranks of an EP model built from the same
:class:`ModelConfig` hold identical weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..batch import PassBatch
from ..config import RecorderConfig
from ..process_recorder import get_recorder
from .ep import EXCHANGE_MODES, EPMoELayer
from .experts import SwiGLUExperts
from .gate import TopKRouter
from .init import derive_seed, seeded_normal
from .moe import MoELayer

__all__ = ["EPSpec", "ForwardBatch", "KVCache", "ModelConfig", "ReferenceMoEModel", "Segment"]

_EMBED, _HEAD, _ATTN, _ROUTER, _EXPERTS, _MLP = 1, 2, 3, 4, 5, 6


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of a :class:`ReferenceMoEModel`.

    Args:
        vocab_size, hidden_size, intermediate_size: ``V``, ``H``, expert FFN width ``I``.
        num_layers: model layers.
        num_experts, top_k: ``E`` and ``k`` of every MoE layer.
        dense_layers: model layer ids that use a dense MLP instead of MoE.
        router_bias: optional per-expert logit bias ``[E]`` for every router
            (e.g. ``tuple(zipf_bias(E, 1.2).tolist())``).
        phase_router_bias: ``((pass phase, bias [E]), ...)``: a further bias every router adds
            on the passes of that pass phase only (see :meth:`ReferenceMoEModel.set_pass_phase`),
            so that e.g. prefill and decode route differently by construction.
        capacity_factor: optional expert capacity (tokens over it are dropped).
        renormalize: renormalise the top-k weights.
        seed: parameter seed.
        dtype: parameter and activation dtype.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    dense_layers: tuple[int, ...] = ()
    router_bias: tuple[float, ...] | None = None
    phase_router_bias: tuple[tuple[str, tuple[float, ...]], ...] = ()
    capacity_factor: float | None = None
    renormalize: bool = True
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} are outside [0, num_layers={self.num_layers})")
        if len(set(self.dense_layers)) == self.num_layers:
            raise ValueError("every layer is dense; leave at least one MoE layer")
        if self.router_bias is not None and len(self.router_bias) != self.num_experts:
            raise ValueError(f"router_bias has {len(self.router_bias)} entries, expected num_experts={self.num_experts}")

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Model layer id of each MoE layer (compact MoE index -> model layer)."""
        return tuple(i for i in range(self.num_layers) if i not in set(self.dense_layers))


@dataclasses.dataclass(frozen=True)
class EPSpec:
    """How this process takes part in expert parallelism.

    Args:
        ep_size, ep_rank: EP world size and this rank.
        mode: ``"exact"`` or ``"padded"`` exchange.
        max_tokens: largest local batch (``padded`` mode).
        group: ``torch.distributed`` group (default: the world).
    """

    ep_size: int
    ep_rank: int
    mode: str = "exact"
    max_tokens: int | None = None
    group: Any = None

    def __post_init__(self) -> None:
        if self.mode not in EXCHANGE_MODES:
            raise ValueError(f"mode must be one of {EXCHANGE_MODES}, got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of one request's tokens inside a flat batch (host metadata).

    ``num_tokens`` new tokens at positions ``prefix_len .. prefix_len+num_tokens-1``
    of request slot ``req_pool_idx``.
    """

    req_pool_idx: int
    prefix_len: int
    num_tokens: int


@dataclasses.dataclass
class ForwardBatch:
    """One serving pass.

    Attributes:
        input_ids: ``[T]`` token ids, segments back to back.
        out_cache_loc: ``[T]`` KV slot each new token is written to.
        segments: the requests' runs, in ``input_ids`` order.
        req_to_token: ``[max_requests, max_len]`` request slot -> KV slots table.
    """

    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    segments: Sequence[Segment]
    req_to_token: torch.Tensor


class KVCache:
    """Per-layer keys and values ``[num_layers, num_slots, H]`` addressed by KV slot."""

    def __init__(self, num_layers: int, num_slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.k = torch.zeros((num_layers, num_slots, hidden_size), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]


class _RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Attention(torch.nn.Module):
    """Single-head causal attention; ``qkv`` and ``o`` projections ``[H, H]``."""

    def __init__(self, hidden: int, seed: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        std = hidden**-0.5
        self.w = torch.nn.Parameter(seeded_normal((4, hidden, hidden), std, seed).to(dtype=dtype, device=device))

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, H]`` -> ``[B, S, H]``, causal within each sequence."""
        q, k, v = x @ self.w[0], x @ self.w[1], x @ self.w[2]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) @ self.w[3]

    def cached(self, x: torch.Tensor, layer: int, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """``x [T, H]`` of a flat batch -> ``[T, H]``; writes the new keys/values at ``out_cache_loc``."""
        q, k, v = x @ self.w[0], x @ self.w[1], x @ self.w[2]
        cache.k[layer].index_copy_(0, batch.out_cache_loc, k)
        cache.v[layer].index_copy_(0, batch.out_cache_loc, v)
        outputs, start = [], 0
        for seg in batch.segments:
            total = seg.prefix_len + seg.num_tokens
            slots = batch.req_to_token[seg.req_pool_idx, :total]
            mask = torch.ones((seg.num_tokens, total), dtype=torch.bool, device=x.device).tril(seg.prefix_len)
            outputs.append(
                F.scaled_dot_product_attention(
                    q[start : start + seg.num_tokens], cache.k[layer][slots], cache.v[layer][slots], attn_mask=mask
                )
            )
            start += seg.num_tokens
        mixed = torch.cat(outputs) if outputs else x.new_zeros((0, x.shape[1]))
        return mixed @ self.w[3]


class _Block(torch.nn.Module):
    def __init__(self, layer_id: int, attn: _Attention, ffn: torch.nn.Module, hidden: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.norm1, self.norm2 = _RMSNorm(hidden, dtype, device), _RMSNorm(hidden, dtype, device)
        self.attn, self.ffn = attn, ffn

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, (MoELayer, EPMoELayer))

    def mlp(self, x: torch.Tensor, recorder: Any, capturer: Any) -> torch.Tensor:
        h = self.norm2(x)
        if self.is_moe:
            return self.ffn(h, recorder=recorder, capturer=capturer)
        return self.ffn.expert(0, h)


class ReferenceMoEModel(torch.nn.Module):
    """Embedding, ``num_layers`` blocks (attention + MoE or dense MLP), final norm, LM head.

    Args:
        config: shapes and seed.
        ep: expert-parallel spec; ``None`` runs every MoE layer with the dense
            oracle :class:`~moetrace.reference.moe.MoELayer`.
        device: where parameters live.
    """

    def __init__(self, config: ModelConfig, *, ep: EPSpec | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config, self.ep = config, ep
        c, dtype, device = config, config.dtype, torch.device(device)
        self.device_ = device
        self.embed = torch.nn.Parameter(seeded_normal((c.vocab_size, c.hidden_size), 1.0, derive_seed(c.seed, _EMBED)).to(dtype=dtype, device=device))
        self.head = torch.nn.Parameter(seeded_normal((c.vocab_size, c.hidden_size), c.hidden_size**-0.5, derive_seed(c.seed, _HEAD)).to(dtype=dtype, device=device))
        self.final_norm = _RMSNorm(c.hidden_size, dtype, device)
        bias = None if c.router_bias is None else torch.tensor(c.router_bias, dtype=torch.float32)
        blocks = []
        for layer_id in range(c.num_layers):
            attn = _Attention(c.hidden_size, derive_seed(c.seed, layer_id, _ATTN), dtype, device)
            if layer_id in c.dense_layers:
                ffn: torch.nn.Module = SwiGLUExperts(c.hidden_size, c.intermediate_size, 1, seed=derive_seed(c.seed, layer_id, _MLP), dtype=dtype, device=device)
            else:
                ffn = self._moe_layer(layer_id, len([b for b in blocks if b.is_moe]), bias, device)
            blocks.append(_Block(layer_id, attn, ffn, c.hidden_size, dtype, device))
        self.blocks = torch.nn.ModuleList(blocks)

    def _moe_layer(self, layer_id: int, moe_index: int, bias: torch.Tensor | None, device: torch.device) -> torch.nn.Module:
        c = self.config
        phase_bias = {phase: torch.tensor(b, dtype=torch.float32) for phase, b in c.phase_router_bias}
        router = TopKRouter(c.hidden_size, c.num_experts, c.top_k, renormalize=c.renormalize, bias=bias, phase_bias=phase_bias,
                            seed=derive_seed(c.seed, layer_id, _ROUTER), dtype=c.dtype, device=device)
        seed = derive_seed(c.seed, layer_id, _EXPERTS)
        if self.ep is None:
            experts = SwiGLUExperts(c.hidden_size, c.intermediate_size, c.num_experts, seed=seed, dtype=c.dtype, device=device)
            return MoELayer(router, experts, capacity_factor=c.capacity_factor, moe_index=moe_index, layer_id=layer_id)
        ep = self.ep
        if c.num_experts % ep.ep_size:
            raise ValueError(f"ep_size={ep.ep_size} does not divide num_experts={c.num_experts}")
        per_rank = c.num_experts // ep.ep_size
        experts = SwiGLUExperts(c.hidden_size, c.intermediate_size, per_rank, ep.ep_rank * per_rank, seed=seed, dtype=c.dtype, device=device)
        return EPMoELayer(router, experts, ep_size=ep.ep_size, ep_rank=ep.ep_rank, group=ep.group, mode=ep.mode,
                          max_tokens=ep.max_tokens, capacity_factor=c.capacity_factor, moe_index=moe_index, layer_id=layer_id)

    def set_pass_phase(self, phase: str) -> None:
        """The pass phase of the next passes (a name of :data:`moetrace.pass_phase.PASS_PHASES`): every
        router adds its ``phase_router_bias`` for it. Host state; the recorder's own phase is separate
        (``recorder.set_pass_phase``)."""
        for module in self.modules():
            if isinstance(module, TopKRouter):
                module.pass_phase = phase

    # ------------------------------------------------------------------ introspection
    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Model layer id of each MoE layer; pass as ``RecorderConfig(layer_ids=...)``."""
        return self.config.moe_layer_ids

    @property
    def moe_layers(self) -> list[MoELayer | EPMoELayer]:
        """The MoE layers in compact order."""
        return [b.ffn for b in self.blocks if b.is_moe]  # type: ignore[misc]

    def set_expert_delay(self, seconds: float) -> None:
        """Sleep ``seconds`` inside every EP layer's ``expert`` phase on this rank (straggler injection)."""
        if self.ep is None:
            raise ValueError("expert delay injection needs an EP model (ep=EPSpec(...)); the dense oracle has no ranks")
        if seconds < 0:
            raise ValueError(f"expert delay must be >= 0 seconds, got {seconds}")
        for layer in self.moe_layers:
            layer.expert_delay_s = float(seconds)  # type: ignore[union-attr]

    def recorder_config(self, **fields: Any) -> RecorderConfig:
        """A :class:`RecorderConfig` matching this model (and EP rank); ``fields`` override."""
        c = self.config
        base: dict[str, Any] = {
            "num_layers": len(self.moe_layer_ids), "num_physical_experts": c.num_experts, "top_k": c.top_k,
            "ep_size": self.ep.ep_size if self.ep else 1, "ep_rank": self.ep.ep_rank if self.ep else 0,
            "layer_ids": self.moe_layer_ids, "hidden_size": c.hidden_size,
            "dtype_bytes": torch.empty((), dtype=c.dtype).element_size(), "device": self.device_, "engine": "moetrace.reference",
        }
        base.update(fields)
        return RecorderConfig(**base)

    def new_kv_cache(self, num_slots: int) -> KVCache:
        """A zeroed :class:`KVCache` with ``num_slots`` slots for this model."""
        c = self.config
        return KVCache(c.num_layers, num_slots, c.hidden_size, c.dtype, self.device_)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, *, recorder: Any = None, capturer: Any = None, forward_pass_id: int | None = None) -> torch.Tensor:
        """``input_ids [B, S]`` -> logits ``[B, S, V]`` (causal within each row; no KV cache)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got {list(input_ids.shape)}")
        b, s = input_ids.shape
        recorder = get_recorder() if recorder is None else recorder
        with recorder.with_forward_pass(forward_pass_id):
            x = self.embed[input_ids]
            for block in self.blocks:
                x = x + block.attn.dense(block.norm1(x))
                x = x + block.mlp(x.reshape(b * s, -1), recorder, capturer).reshape(b, s, -1)
            return self.final_norm(x) @ self.head.t()

    def forward_batch(self, batch: ForwardBatch, cache: KVCache, *, recorder: Any = None, capturer: Any = None,
                      forward_pass_id: int | None = None, pass_batch: PassBatch | None = None) -> torch.Tensor:
        """One continuous-batching pass -> logits ``[num_segments, V]`` at each segment's last token.

        ``batch`` may be empty (0 tokens): under EP the rank still joins every collective.
        ``pass_batch``: the same batch as the recorder reads it (request ids, positions, phase).
        """
        recorder = get_recorder() if recorder is None else recorder
        with recorder.with_forward_pass(forward_pass_id, batch=pass_batch):
            x = self.embed[batch.input_ids]
            for block in self.blocks:
                x = x + block.attn.cached(block.norm1(x), block.layer_id, batch, cache)
                x = x + block.mlp(x, recorder, capturer)
            lengths = [seg.num_tokens for seg in batch.segments]
            ends = torch.tensor(lengths, dtype=torch.int64, device=x.device).cumsum(0) - 1
            return self.final_norm(x[ends]) @ self.head.t()
