"""The byte encoding of values that cross a process boundary (`eqx_diloco._wire`): what is sent comes
back exactly (bfloat16, 0-d and empty arrays, JSON scalars), and anything malformed, pickle above all,
is refused with one line naming its source, never executed."""

import json
import os
import pickle
import shlex
import struct

import ml_dtypes
import numpy as np
import pytest

from eqx_diloco import ConfigError
from eqx_diloco._wire import MAGIC, WireFormatError, decode, encode, encode_chunks


class RunsCode:
    """Unpickling this runs a shell command that creates `marker` (what an attacker's payload would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def malicious_pickle(marker) -> bytes:
    payload = pickle.dumps(RunsCode(marker))
    pickle.loads(payload)  # the payload is live: unpickled, it does run
    assert marker.exists()
    marker.unlink()
    return payload


def _split(buffer: bytes) -> tuple[dict, bytes]:
    """(header, array bytes) of an encoding, by the layout the module docstring gives."""
    (length,) = struct.unpack("<Q", buffer[8:16])
    start = -(-(16 + length) // 64) * 64
    return json.loads(buffer[16: 16 + length]), buffer[start:]


def _frame(raw: bytes, data: bytes) -> bytes:
    """An encoding with header bytes `raw` and array bytes `data`."""
    start = -(-(16 + len(raw)) // 64) * 64
    return MAGIC + struct.pack("<Q", len(raw)) + raw + bytes(start - 16 - len(raw)) + data


def _join(header: dict, data: bytes) -> bytes:
    return _frame(json.dumps(header).encode(), data)


def _assert_same(a, b) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8) if a.ndim else a, b.view(np.uint8) if b.ndim else b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b


def test_round_trip_of_what_crosses_a_process_boundary():
    rng = np.random.default_rng(0)
    tree = {
        "step": 12, "island": 0, "name": "snapshot", "lr": 0.25, "flag": True, "none": None,
        "shared": {"global_params": [rng.normal(size=(3, 5)).astype(np.float32),
                                    rng.normal(size=(7,)).astype(ml_dtypes.bfloat16),
                                    np.array(2.5, np.float32)],  # 0-d
                   "outer_states": [np.zeros((0,), np.float32), np.zeros((2, 0, 3), np.int32),  # empty
                                    np.asarray(7, np.int32)],
                   "mail_mean": []},
        "own": {"keys": [np.array([1, 2**32 - 1], np.uint32)], "flags": [np.array([True, False])],
                "fp8": [np.arange(4, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)],
                "mixed": [np.arange(3, dtype=np.int8), np.arange(3, dtype=np.uint64), np.ones(2, np.float16),
                          np.ones(2, np.float64), np.ones(2, np.complex64), np.ones(1, np.int64)]},
    }
    _assert_same(tree, decode(encode(tree), source="test"))
    assert b"".join(encode_chunks(tree)) == encode(tree)


def test_numpy_scalars_tuples_byte_order_and_strides_are_normalised():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = decode(encode({"scalar": np.float32(1.5), "pair": (1, "a"), "strided": x[:, ::2], "big": x.astype(">f4")}),
                 source="test")
    assert isinstance(out["scalar"], np.ndarray) and out["scalar"].shape == () and out["scalar"] == 1.5
    assert out["pair"] == [1, "a"]
    np.testing.assert_array_equal(out["strided"], x[:, ::2])
    assert out["big"].dtype == np.float32 and out["big"].dtype.isnative
    np.testing.assert_array_equal(out["big"], x)


def test_arrays_are_aligned_views_writable_only_from_a_writable_buffer():
    data = encode({"a": np.arange(3, dtype=np.float64), "b": np.arange(5, dtype=np.int64)})
    frozen = decode(data, source="test")
    assert not frozen["a"].flags.writeable
    thawed = decode(bytearray(data), source="test")
    thawed["a"][0] = 9.0  # a loaded snapshot can be modified in place
    assert thawed["a"][0] == 9.0
    header, _ = _split(data)
    assert [e["offset"] % 64 for e in header["arrays"]] == [0, 0]


def test_what_cannot_be_encoded_is_refused_at_the_sender():
    with pytest.raises(TypeError, match="dtype object"):
        encode({"x": np.array([object()], dtype=object)})
    with pytest.raises(TypeError, match="dtype"):
        encode({"x": np.zeros(2, dtype=[("a", np.float32)])})
    with pytest.raises(TypeError, match="type set"):
        encode({"x": {1, 2}})
    with pytest.raises(TypeError, match="keys must be str"):
        encode({1: 2})
    with pytest.raises(ValueError, match=r"\$array"):
        encode({"$array": 0})
    with pytest.raises(ValueError):
        encode({"loss": float("nan")})  # not JSON


def test_a_pickle_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = malicious_pickle(marker)
    with pytest.raises(WireFormatError, match="^the test payload is not a valid eqx_diloco payload .*magic"):
        decode(payload, source="the test payload")
    assert not marker.exists()


GOOD = encode({"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": [np.ones((), np.int32)], "meta": {"k": 1}})


def _edit(change, pad: int = 0) -> bytes:
    """GOOD with its header changed by `change` (and `pad` zero bytes after its arrays)."""
    header, data = _split(GOOD)
    change(header)
    return _join(header, data + bytes(pad))


@pytest.mark.parametrize("payload, message", [
    (b"", "wrong magic bytes or too short"),
    (GOOD[:10], "wrong magic bytes or too short"),
    (b"EQXDWIRF" + GOOD[8:], "wrong magic"),
    (GOOD[:16] + b"{", "truncated: the header says"),
    (GOOD[:-1], "truncated: array 1"),
    (GOOD + b"\0", "bytes where the header describes"),
    (MAGIC + struct.pack("<Q", 2**64 - 1) + GOOD[16:], "truncated: the header says"),
    (MAGIC + struct.pack("<Q", 3) + b"abc" + bytes(45), "the header is not JSON"),
    (MAGIC + struct.pack("<Q", 2) + b"\xff\xfe" + bytes(46), "the header is not JSON"),
    (_edit(lambda h: h.update(version=2)), "format version 2"),
    (_edit(lambda h: h.update(version=True)), "format version True"),
    (_edit(lambda h: h.pop("tree")), "exactly the keys version, arrays and tree"),
    (_edit(lambda h: h.update(extra=1)), "exactly the keys version, arrays and tree"),
    (_edit(lambda h: h.update(arrays={})), "arrays is not a list"),
    (_edit(lambda h: h["arrays"][0].update(dtype="O")), "dtype 'O' is not allowed"),
    (_edit(lambda h: h["arrays"][0].update(dtype="|O")), "dtype '|O' is not allowed"),
    (_edit(lambda h: h["arrays"][0].update(dtype="V12")), "dtype 'V12' is not allowed"),
    (_edit(lambda h: h["arrays"][0].update(dtype="<f4")), "dtype '<f4' is not allowed"),  # names only
    (_edit(lambda h: h["arrays"][0].update(dtype=["float32"])), "is not allowed"),
    (_edit(lambda h: h["arrays"][0].update(nbytes=20)), "nbytes 20, but [2, 3] of float32 is 24 bytes"),
    (_edit(lambda h: h["arrays"][0].update(shape=[2, 4])), "nbytes 24, but [2, 4] of float32 is 32 bytes"),
    (_edit(lambda h: h["arrays"][0].update(shape=[2, -3])), "is not a list of at most 64 sizes >= 0"),
    (_edit(lambda h: h["arrays"][0].update(shape=[True, 6])), "is not a list of at most 64 sizes >= 0"),
    (_edit(lambda h: h["arrays"][0].update(shape=[1] * 65, nbytes=4)), "at most 64"),
    (_edit(lambda h: h["arrays"][0].update(shape=[2**62, 2**62], nbytes=2**126)), "truncated: array 0"),
    (_edit(lambda h: h["arrays"][1].update(offset=0)), "array 1: offset 0, expected 64"),
    (_edit(lambda h: h["arrays"][0].pop("offset")), "exactly the keys dtype, shape, offset and nbytes"),
    (_edit(lambda h: h["arrays"].append({"dtype": "uint8", "shape": [0], "offset": 128, "nbytes": 0}), pad=60),
     "array 2 is described but never used"),
    (_edit(lambda h: h["tree"].update(x={"$array": 1})), "a bad array reference"),  # used twice
    (_edit(lambda h: h["tree"].update(x={"$array": 5})), "a bad array reference"),
    (_edit(lambda h: h["tree"].update(x={"$array": "0"})), "a bad array reference"),
    (_edit(lambda h: h["tree"].update(x={"$array": 0, "more": 1})), "a bad array reference"),
    (_edit(lambda h: h["tree"].update(meta=float("nan"))), "NaN is not JSON"),
])
def test_malformed_payloads_are_refused_with_one_line(payload, message):
    with pytest.raises(WireFormatError) as error:
        decode(payload, source="the replica values of process 3")
    text = str(error.value)
    assert text.startswith("the replica values of process 3 is not a valid eqx_diloco payload (") and "\n" not in text
    assert message in text
    assert isinstance(error.value, ConfigError) and isinstance(error.value, ValueError)


def test_deep_nesting_and_bad_bools_are_refused():
    deep = b'{"version":1,"arrays":[],"tree":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(WireFormatError, match="the header is not JSON"):
        decode(_frame(deep, b""), source="x")
    assert decode(_frame(b'{"version":1,"arrays":[],"tree":' + b"[" * 50 + b"]" * 50 + b"}", b""), source="x")
    header, _ = _split(encode({"flags": np.array([True, False, True])}))
    assert decode(_join(header, b"\x01\x00\x01"), source="x")["flags"].tolist() == [True, False, True]
    with pytest.raises(WireFormatError, match="bool bytes other than 0 and 1"):
        decode(_join(header, b"\x01\x02\x00"), source="x")
