"""Wire format of routed experts: smallest dtype, explicit dtype and shape, round trip, errors."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moetrace.wire import CaptureError, decode_routed_experts, encode_routed_experts, wire_dtype


@pytest.mark.parametrize(("values", "dtype"), [
    ([0, 5, 255], "uint8"), ([-1, 0, 127], "int8"), ([0, 256], "uint16"), ([-1, 200], "int16"),
    ([0, 70000], "uint32"), ([-1, 40000], "int32"), ([], "uint8"), ([-(2**40)], "int64"),
])
def test_smallest_dtype(values, dtype):
    assert wire_dtype(np.asarray(values, dtype=np.int64)) == np.dtype(dtype)


def test_round_trip_keeps_values_dtype_and_shape():
    rng = np.random.default_rng(0)
    routed = rng.integers(0, 64, size=(37, 16, 8)).astype(np.int32)
    routed[:, 3] = -1  # a dense layer
    payload = encode_routed_experts(routed)
    assert payload["dtype"] == "int8" and payload["shape"] == [37, 16, 8]
    assert len(base64.b64decode(payload["data"])) == routed.size  # one byte per id
    decoded = decode_routed_experts(json.loads(json.dumps(payload)))
    np.testing.assert_array_equal(decoded, routed)
    # explicit little-endian bytes
    assert base64.b64decode(encode_routed_experts(np.array([258]))["data"]) == b"\x02\x01"
    empty = decode_routed_experts(encode_routed_experts(np.zeros((0, 4, 2), dtype=np.int64)))
    assert empty.shape == (0, 4, 2)


def test_payload_is_smaller_than_json_lists():
    routed = np.random.default_rng(1).integers(0, 64, size=(512, 16, 8))
    encoded = len(json.dumps(encode_routed_experts(routed)))
    listed = len(json.dumps(routed.tolist()))
    assert encoded * 2 < listed


def test_bad_payloads_are_rejected():
    good = encode_routed_experts(np.arange(6).reshape(2, 3))
    with pytest.raises(CaptureError, match="unsupported dtype"):
        decode_routed_experts({**good, "dtype": "float32"})
    with pytest.raises(CaptureError, match="needs 8"):
        decode_routed_experts({**good, "shape": [2, 4]})
    with pytest.raises(CaptureError, match="must have 'data'"):
        decode_routed_experts({"data": good["data"]})
    with pytest.raises(CaptureError, match="must be integers"):
        encode_routed_experts(np.zeros(3, dtype=np.float32))
