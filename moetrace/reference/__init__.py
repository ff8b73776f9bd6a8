"""Reference MoE runtime: the embedded engine that moetrace's demo and tests run.

- :class:`TopKRouter` (with :func:`zipf_bias` / :func:`olmoe_bias` skew),
  :class:`SwiGLUExperts`, the dense oracle :class:`MoELayer`;
- :func:`build_dispatch_layout` / :class:`DispatchLayout` (re-exported from
  :mod:`moetrace.dispatch_layout`) and :class:`EPMoELayer`, whose experts are really
  sharded over ``torch.distributed`` ranks (``exact`` or ``padded`` exchange);
- :class:`ReferenceMoEModel` (dense layers interleaved, dense or EP),
  :func:`launch` for multi-rank runs;
- :class:`ServingLoop` (continuous batching with :class:`KVSlotAllocator`,
  :class:`ReqToTokenPool` and routed-experts capture);
- :func:`replay` of recorded routes into a forward (dense and EP).

Every MoE layer reports to the recorder; see docs/reference-runtime.md.
"""

from ..dispatch_layout import DispatchLayout, build_dispatch_layout
from .ep import EXCHANGE_MODES, EPMoELayer
from .experts import SwiGLUExperts
from .gate import TopKRouter, fitted_bias, olmoe_bias, zipf_bias
from .kv import KVSlotAllocator, ReqToTokenPool, SlotError
from .launcher import WorkerError, default_backend, free_port, launch, timed_steps
from .model import EPSpec, ForwardBatch, KVCache, ModelConfig, ReferenceMoEModel, Segment
from .moe import MoELayer
from .replay import replay
from .serving import Progress, Request, RequestResult, ServingLoop, routed_positions

__all__ = [
    "EXCHANGE_MODES",
    "DispatchLayout",
    "EPMoELayer",
    "EPSpec",
    "ForwardBatch",
    "KVCache",
    "KVSlotAllocator",
    "MoELayer",
    "ModelConfig",
    "Progress",
    "ReferenceMoEModel",
    "ReqToTokenPool",
    "Request",
    "RequestResult",
    "Segment",
    "ServingLoop",
    "SlotError",
    "SwiGLUExperts",
    "TopKRouter",
    "WorkerError",
    "build_dispatch_layout",
    "default_backend",
    "fitted_bias",
    "free_port",
    "launch",
    "olmoe_bias",
    "replay",
    "routed_positions",
    "timed_steps",
    "zipf_bias",
]
