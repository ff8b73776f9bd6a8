"""One spelling of a device for comparisons: ``"cuda"`` becomes ``cuda:<current device>``.

``torch.device("cuda:0") == torch.device("cuda")`` is ``False``, and every real
CUDA tensor reports its index; the recorder and the capturer resolve the
configured device once, at construction, so that a hook's device check is a
plain comparison.
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with the current CUDA device's index filled in when it names CUDA without one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
