"""The routed-experts wire format: one request's ``[positions, layers, top_k]`` ids as JSON.

:func:`encode_routed_experts` gives ``{"data": base64, "dtype", "shape"}`` with little-endian
bytes in the smallest integer dtype holding the values (and the routes' provenance, when
given); :func:`decode_routed_experts` inverts it. The capturer
(:class:`~moetrace.capturer.RoutedExpertsCapturer`) hands its rows out in this format, and
saved route sets (:mod:`moetrace.routes`) store it; this module loads no torch, so reading
and comparing routes offline never does.
"""

from __future__ import annotations

import base64
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from .provenance import PROVENANCE_KEY, RouteProvenance

if TYPE_CHECKING:
    import torch

__all__ = ["CaptureError", "decode_routed_experts", "encode_routed_experts", "wire_dtype"]


class CaptureError(ValueError):
    """A capture or lookup that would return wrong or foreign data."""


_WIRE_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")


def wire_dtype(array: np.ndarray) -> np.dtype:
    """Smallest integer dtype holding every value of ``array`` (``-1`` forces a signed type)."""
    if array.size == 0:
        return np.dtype(np.uint8)
    lo, hi = int(array.min()), int(array.max())
    for name in _WIRE_DTYPES:
        info = np.iinfo(name)
        if info.min <= lo and hi <= info.max:
            return np.dtype(name)
    raise CaptureError(f"values [{lo}, {hi}] do not fit a 64-bit integer")


def encode_routed_experts(array: np.ndarray | torch.Tensor, provenance: RouteProvenance | None = None) -> dict[str, Any]:
    """``{"data": base64 of little-endian bytes, "dtype": name, "shape": [...]}`` for an integer array.

    With ``provenance`` the payload also carries ``"provenance"`` (run, rank, weight
    version, attempt: :mod:`moetrace.provenance`); the ids' encoding is unchanged.
    """
    torch = sys.modules.get("torch")  # a tensor exists only where torch is loaded: never import it here
    arr = array.detach().cpu().numpy() if torch is not None and isinstance(array, torch.Tensor) else np.asarray(array)
    if arr.dtype.kind not in "iu":
        raise CaptureError(f"routed experts must be integers, got dtype {arr.dtype}")
    dtype = wire_dtype(arr)
    data = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<")).tobytes()
    payload: dict[str, Any] = {"data": base64.b64encode(data).decode("ascii"), "dtype": dtype.name, "shape": list(arr.shape)}
    if provenance is not None:
        payload[PROVENANCE_KEY] = provenance.to_dict()
    return payload


def decode_routed_experts(payload: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_routed_experts` (native-endian array of the encoded dtype)."""
    try:
        data, name, shape = payload["data"], payload["dtype"], [int(s) for s in payload["shape"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CaptureError(f"payload must have 'data', 'dtype' and 'shape' ({exc})") from exc
    if name not in _WIRE_DTYPES:
        raise CaptureError(f"unsupported dtype {name!r}; expected one of {_WIRE_DTYPES}")
    raw = base64.b64decode(data, validate=True)
    dtype = np.dtype(name).newbyteorder("<")
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise CaptureError(f"payload has {len(raw)} bytes but shape {shape} of {name} needs {expected}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(np.dtype(name))
