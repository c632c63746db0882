"""A safe byte encoding for host values that cross a process boundary (island snapshots on disk,
replica values through the coordinator's key-value store).

Whoever can write to the run folder or the coordinator's port would run code in every process that
unpickles what they wrote, so nothing here is pickle: the bytes are a JSON header that describes raw
array bytes, and decoding only ever builds numpy arrays of an allow-listed numeric dtype, plain JSON
values, dicts and lists.

Layout (all offsets in bytes):

- `0:8`: the magic `b"EQXDWIRE"`.
- `8:16`: the header's length H, an unsigned 64-bit little-endian integer.
- `16:16+H`: the header, a UTF-8 JSON object `{"version": 1, "arrays": [...], "tree": ...}`. Each
  entry of `arrays` is `{"dtype": name, "shape": [...], "offset": o, "nbytes": n}`; `tree` is the
  encoded value, plain JSON in which `{"$array": i}` stands for array `i`.
- zero padding up to the data start D, the next multiple of 64 (arrays then start aligned).
- the arrays' bytes, little-endian and C-ordered, array `i` at `D + offset_i`, each offset the next
  multiple of 64 after the previous array (the first at 0); the payload ends with the last array.

The layout is canonical: a decoder recomputes every offset, length and the total size, and refuses a
payload that differs anywhere (`WireFormatError`, one line naming where the payload came from).
"""

import json
import math
import struct
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import ConfigError

MAGIC = b"EQXDWIRE"
VERSION = 1
_ALIGN = 64
_PREFIX = len(MAGIC) + 8
_ARRAY_TAG = "$array"
_MAX_NDIM = 64  # numpy's own limit

# Numeric dtypes only, looked up by name, so a payload's dtype string never reaches `np.dtype` (which
# would also accept object, structured and void dtypes). These cover what crosses today: parameters and
# optimizer states (any float width, bfloat16, complex, int32 counts), uint32 PRNG key data, bool flags.
_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).name: np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, np.float32, np.float64, np.complex64, np.complex128,
              ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
}


class WireFormatError(ConfigError):
    """A payload that is not a well-formed encoding (corrupt, truncated, of another format or version).

    A `ConfigError` so that the command line reports it as one line (exit code 2), like a bad flag.
    """


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _little_endian(x: np.ndarray) -> np.ndarray:
    """`x` C-contiguous with its allow-listed dtype in little-endian byte order (a no-op for most arrays)."""
    # order="C" copies only a non-contiguous array (np.ascontiguousarray would also make a 0-d array 1-d);
    # the dtype turns a non-native byte order native.
    x = np.asarray(x, dtype=_DTYPES[x.dtype.name], order="C")
    return x.byteswap() if sys.byteorder == "big" else x


def encode_chunks(tree: Any) -> list[bytes | np.ndarray]:
    """`tree` encoded, as pieces whose concatenation is `encode(tree)` (write them one after the other
    to a file: large arrays are not copied into one buffer first).

    **Arguments:**

    - `tree`: nested dicts (string keys) and lists or tuples (decoded as lists) of numpy arrays,
      numpy scalars (decoded as 0-d arrays) and JSON scalars (str, int, finite float, bool, None).

    Raises `TypeError` for anything else (an object, a dtype off the allow-list) and `ValueError`
    for a non-finite float scalar or a dict key `"$array"` (the array marker).
    """
    arrays: list[np.ndarray] = []

    def walk(node: Any) -> Any:
        if isinstance(node, (np.ndarray, np.generic)):
            if node.dtype.name not in _DTYPES:
                raise TypeError(f"cannot encode an array of dtype {node.dtype} (allowed: {', '.join(_DTYPES)})")
            arrays.append(_little_endian(np.asarray(node)))
            return {_ARRAY_TAG: len(arrays) - 1}
        if isinstance(node, dict):
            for k in node:
                if not isinstance(k, str):
                    raise TypeError(f"cannot encode a dict key of type {type(k).__name__} (keys must be str)")
                if k == _ARRAY_TAG:
                    raise ValueError(f"cannot encode a dict key {_ARRAY_TAG!r} (it marks an array)")
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        if node is None or isinstance(node, (str, bool, int, float)):
            return node
        raise TypeError(f"cannot encode a value of type {type(node).__name__}")

    entries, offset = [], 0
    skeleton = walk(tree)
    for x in arrays:
        offset = _aligned(offset)
        entries.append({"dtype": x.dtype.name, "shape": list(x.shape), "offset": offset, "nbytes": x.nbytes})
        offset += x.nbytes
    # allow_nan=False: bare NaN / Infinity are not JSON, and the decoder refuses them.
    header = json.dumps({"version": VERSION, "arrays": entries, "tree": skeleton}, allow_nan=False,
                        separators=(",", ":")).encode("utf-8")
    chunks: list[bytes | np.ndarray] = [MAGIC, struct.pack("<Q", len(header)), header]
    position = _PREFIX + len(header)
    data_start = _aligned(position)
    for x, entry in zip(arrays, entries):
        start = data_start + entry["offset"]
        if start > position:
            chunks.append(bytes(start - position))
        # A flat uint8 view: the raw bytes without a copy (and a 0-d array can be viewed once flattened).
        chunks.append(x.reshape(-1).view(np.uint8))
        position = start + x.nbytes
    if position < data_start:  # no array (or only empty ones before the data start): pad to it all the same
        chunks.append(bytes(data_start - position))
    return chunks


def encode(tree: Any) -> bytes:
    """`tree` (see `encode_chunks`) as one bytes object."""
    return b"".join(encode_chunks(tree))


def decode(buffer: bytes | bytearray | memoryview, *, source: str) -> Any:
    """The value `encode` turned into `buffer`.

    Arrays are views into `buffer` (writable only if `buffer` is), so the bytes are not copied.

    **Arguments:**

    - `buffer`: the encoded bytes.
    - `source`: where they came from (a file, a process), for the error message.

    Raises `WireFormatError` (a `ConfigError`, a `ValueError`) if `buffer` is not exactly a
    well-formed encoding; nothing in it is ever executed.
    """
    def refuse(reason: str) -> WireFormatError:
        return WireFormatError(f"{source} is not a valid eqx_diloco payload ({reason}); it was not loaded")

    view = memoryview(buffer).cast("B")
    size = view.nbytes
    if size < _PREFIX or bytes(view[: len(MAGIC)]) != MAGIC:
        raise refuse("no eqx_diloco header: wrong magic bytes or too short")
    (header_len,) = struct.unpack("<Q", view[len(MAGIC): _PREFIX])
    if header_len > size - _PREFIX:
        raise refuse(f"truncated: the header says {header_len} bytes, {size - _PREFIX} follow")

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        header = json.loads(bytes(view[_PREFIX: _PREFIX + header_len]).decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise refuse(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != {"version", "arrays", "tree"}:
        raise refuse("the header is not an object with exactly the keys version, arrays and tree")
    if header["version"] != VERSION or isinstance(header["version"], bool):
        raise refuse(f"format version {header['version']!r}, this eqx_diloco reads version {VERSION}")
    if not isinstance(header["arrays"], list):
        raise refuse("the header's arrays is not a list")

    data_start = _aligned(_PREFIX + header_len)
    arrays, end = [], 0
    for i, entry in enumerate(header["arrays"]):
        arrays.append(_array(view, entry, i, data_start, _aligned(end), refuse))
        end = _aligned(end) + arrays[-1].nbytes
    if size != data_start + end:
        raise refuse(f"{size} bytes where the header describes {data_start + end}")

    used = [False] * len(arrays)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if _ARRAY_TAG not in node:
                return {k: walk(v) for k, v in node.items()}
            i = node[_ARRAY_TAG]
            if len(node) != 1 or not _is_int(i) or not 0 <= i < len(arrays) or used[i]:
                raise refuse(f"a bad array reference {node!r}")
            used[i] = True
            return arrays[i]
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    try:
        tree = walk(header["tree"])
    except RecursionError:
        raise refuse("the tree is nested too deeply") from None
    if not all(used):
        raise refuse(f"array {used.index(False)} is described but never used")
    return tree


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true would otherwise pass as 1


def _array(view: memoryview, entry: Any, i: int, data_start: int, offset: int,
           refuse: Callable[[str], WireFormatError]) -> np.ndarray:
    """Array `i` of the payload in `view`, after checking its header `entry` against the canonical layout."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "offset", "nbytes"}:
        raise refuse(f"array {i}: not an object with exactly the keys dtype, shape, offset and nbytes")
    dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise refuse(f"array {i}: dtype {entry['dtype']!r} is not allowed (allowed: {', '.join(_DTYPES)})")
    shape = entry["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(_is_int(n) and n >= 0 for n in shape):
        raise refuse(f"array {i}: shape {shape!r} is not a list of at most {_MAX_NDIM} sizes >= 0")
    nbytes = math.prod(shape) * dtype.itemsize
    if not _is_int(entry["nbytes"]) or entry["nbytes"] != nbytes:
        raise refuse(f"array {i}: nbytes {entry['nbytes']!r}, but {shape} of {dtype.name} is {nbytes} bytes")
    if not _is_int(entry["offset"]) or entry["offset"] != offset:
        raise refuse(f"array {i}: offset {entry['offset']!r}, expected {offset}")
    if data_start + offset + nbytes > view.nbytes:
        raise refuse(f"truncated: array {i} ends at byte {data_start + offset + nbytes} of {view.nbytes}")
    x = np.frombuffer(view, dtype=dtype, count=math.prod(shape), offset=data_start + offset).reshape(shape)
    if sys.byteorder == "big":
        x = x.byteswap()
    if dtype == np.bool_ and x.size and x.view(np.uint8).max() > 1:
        raise refuse(f"array {i}: bool bytes other than 0 and 1")
    return x

