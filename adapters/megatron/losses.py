"""Megatron's own per-layer MoE losses (aux loss, z-loss, ...), read from its tracker.

Megatron accumulates each tracked loss per layer into a ``[num_layers]`` tensor indexed
by ``layer_number - 1`` (only layers whose ``set_layer_number`` was called are tracked)
and clears it in ``track_moe_metrics``. Where it lives:

- megatron-core <= 0.16: ``moe_utils.get_moe_layer_wise_logging_tracker()``, a dict
  ``name -> {"values": tensor, ...}`` (tested, 0.16.1);
- 0.17+: ``moe_logging.MoEMetricsTracker.get_instance().metrics``, a dict
  ``name -> entry`` with ``entry.values`` (handled by feature detection; not run here:
  0.17+ needs Python 3.12).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["megatron_aux_losses"]


def _tracker() -> dict[str, Any]:
    try:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker  # 0.17+
    except ImportError:
        MoEMetricsTracker = None
    if MoEMetricsTracker is not None:
        instance = MoEMetricsTracker.get_instance()
        entries = getattr(instance, "metrics", None)
        if entries is None:
            entries = instance._metrics
        return {name: entry.values for name, entry in entries.items()}
    from megatron.core.transformer.moe import moe_utils

    return {name: entry["values"] for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items()}


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
