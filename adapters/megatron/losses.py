"""Megatron's own per-layer MoE losses (aux loss, z-loss, ...), read from its tracker.

Megatron accumulates each tracked loss per layer into a ``[num_layers]`` tensor indexed
by ``layer_number - 1`` (only layers whose ``set_layer_number`` was called are tracked)
and clears it in ``track_moe_metrics``. Where it lives:

- megatron-core <= 0.17: ``moe_utils.get_moe_layer_wise_logging_tracker()``, a dict
  ``name -> {"values": tensor, ...}`` (run: 0.16.1);
- 0.18+: ``moe_logging.get_moe_metrics_tracker().metrics``, a dict ``name -> MetricEntry``
  with ``entry.values`` (chosen by feature detection; checked against the 0.18.2 and 0.19.2
  source by tests/megatron/test_contract.py, not run: 0.17+ needs Python 3.12).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["megatron_aux_losses"]


def _tracker() -> dict[str, Any]:
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # 0.18+
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        return {name: entry["values"] for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items()}
    return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}


def megatron_aux_losses(layers: Sequence[torch.nn.Module]) -> dict[str, np.ndarray]:
    """``name -> [L]`` Megatron's tracked loss of each given MoE layer (NaN where it has no layer number).

    Values are Megatron's (unscaled by the loss coefficient, as it logs them),
    summed over the micro-batches since its tracker was last cleared.
    """
    out: dict[str, np.ndarray] = {}
    numbers = [getattr(layer, "layer_number", None) for layer in layers]
    for name, values in _tracker().items():
        host = values.detach().float().cpu().numpy()
        out[name] = np.array([host[n - 1] if isinstance(n, int) and 0 < n <= host.shape[0] else np.nan for n in numbers])
    return out
