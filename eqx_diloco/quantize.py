"""Wire formats for outer gradients: encode before sending, decode and average in float32.

Each replica quantizes its own outer gradient (a float32 array of any shape) into a
`Payload`, a small pytree of arrays whose shapes depend only on the input shape and the
format. Payloads are exchanged with `all_gather` (which adds a leading replica axis to
every leaf) and every receiver decodes and reduces in float32; a `psum` of quantized
values would overflow or round wrongly.

Blocked formats flatten the array, pad it with zeros to a multiple of `BLOCK_SIZE`
values and store one float32 scale per block. The padding and the scales go on the wire,
so they are counted by `payload_nbytes`.

| format | bits/value (large array) | scale granularity          | rounding                                        |
|--------|--------------------------|----------------------------|-------------------------------------------------|
| none   | 32                       | none                       | none (bit-exact float32)                        |
| bf16   | 16                       | none                       | round to nearest, ties to even (XLA convert)    |
| fp8    | 8 + 32/256 = 8.125       | per block, absmax / 448    | e4m3fn, round to nearest even, saturating       |
| int8   | 8 + 32/256 = 8.125       | per block, absmax / 127    | round to nearest, ties to even; codes -127..127 |
| int4   | 4 + 32/256 = 4.125       | per block, absmax / 7      | round to nearest, ties to even; codes -7..7     |
| e3m0   | 4 + 32/256 = 4.125       | per block, absmax          | nearest representable in the linear domain      |
| int2   | 2 + 32/256 = 2.125       | per block, absmax / 3      | nearest of -3, -1, 1, 3; ties away from zero    |

int4 and e3m0 are bit-packed, two 4-bit codes per uint8 byte (even index in the low
nibble); int2 packs four 2-bit codes per byte (index 4i + j in bits 2j, 2j + 1) and stores
`(q + 3) / 2` for its levels q in {-3, -1, 1, 3} x absmax / 3: four levels and no zero, so
that all four codes carry a magnitude (the values a top-k keeps are never near zero, and
error feedback carries what a level misses). int4 stores `q + 8` (1..15); e3m0 stores a sign bit (bit 3) and a 3-bit
exponent code c (c = 0 is zero, c = 1..7 is `scale * 2**(c - 7)`), i.e. values
`±absmax * 2**-e` for e in 0..6, plus zero.

e3m0 rounds to the nearest representable value in the linear domain (thresholds at the
arithmetic midpoints `0.75 * 2**-e`, and `2**-7` between zero and `2**-6`; ties go away
from zero). This minimizes the absolute error of each value, which is what the averaged
outer gradient sees; log-domain rounding (geometric midpoints) would round more values
up and so inflate magnitudes.

Error per value, with `m` the block's absmax (bounds the tests check):

- bf16: `|err| <= 2**-8 * |x|`.
- fp8: `|err| <= 2**-4 * |x| + 2**-10 * m / 448` (3 mantissa bits; e4m3 subnormals).
- int8: `|err| <= m / 254`. int4: `|err| <= m / 14`. int2: `|err| <= m / 3`.
- e3m0: `|err| <= max(|x| / 3, m * 2**-7)`.

Edge cases (the policy):

- Non-finite input: a NaN or +-Inf anywhere in a block makes that block's scale NaN, so
  the whole block decodes to NaN and the caller's non-finite guard sees it. The block's
  codes are zeroed so the payload is deterministic. "none" and "bf16" have no blocks:
  they carry NaN and Inf through value by value.
- Zeros round-trip exactly, except in int2 (no zero level: a zero in a block whose absmax
  is m decodes to m / 3); an all-zero block has scale 0 and decodes to zeros. The sign
  of every nonzero value is kept (e3m0 and fp8 also keep the sign of -0.0).
- Tiny values in a block with a large absmax flush to zero: below `m / 254` (int8),
  `m / 14` (int4), `m * 2**-7` (e3m0), `2**-10 * m / 448` (fp8).
- Huge magnitudes (e.g. 1e30) are handled by the scale: codes are computed as
  `x / scale` with `|x| <= absmax`, so nothing overflows. Blocks whose absmax is itself
  a float32 subnormal may flush to zero (CPUs may run with flush-to-zero).
"""

import math

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Float32, Shaped

from ._formats import FORMATS as FORMATS  # re-exported: quantize.FORMATS


# Values per float32 scale. 256 keeps scale overhead at 32/256 = 0.125 bits per value
# while a single outlier only coarsens its own 256 neighbours.
BLOCK_SIZE = 256

_BLOCKED = ("fp8", "int8", "int4", "e3m0", "int2")
_CODE_BITS = {"fp8": 8, "int8": 8, "int4": 4, "e3m0": 4, "int2": 2}
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INT_MAX = {"int8": 127, "int4": 7, "int2": 3}
_E3M0_CODES = 7  # nonzero magnitudes 2**0 .. 2**-6
# Nearest-value thresholds on a = |x| / absmax: code c = number of thresholds a reaches.
# Between zero and 2**-6 the midpoint is 2**-7; between 2**(c-7) and 2**(c-6) it is
# 0.75 * 2**(c-6). All are exact in float32.
_E3M0_THRESHOLDS = (2.0**-7,) + tuple(0.75 * 2.0 ** (c - 6) for c in range(1, _E3M0_CODES))


class Payload(eqx.Module):
    """The encoded form of one array, as it goes on the wire.

    **Fields:**

    - `data`: the codes. "none": the float32 array itself (input shape); "bf16": bfloat16
      of the input shape; "fp8"/"int8": `(blocks, BLOCK_SIZE)` float8_e4m3fn/int8;
      "int4"/"e3m0": `(blocks, BLOCK_SIZE // 2)` uint8, two codes per byte; "int2":
      `(blocks, BLOCK_SIZE // 4)` uint8, four codes per byte.
    - `scales`: `(blocks,)` float32 per-block scales for blocked formats, else None.

    Leaves may carry extra leading axes (e.g. the replica axis an `all_gather` adds);
    `decode` passes them through.
    """

    data: Shaped[Array, "..."]
    scales: Float32[Array, "... blocks"] | None


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _num_blocks(size: int) -> int:
    return -(-size // BLOCK_SIZE)


def _pack_nibbles(codes: Shaped[Array, "blocks block"]) -> Shaped[Array, "blocks half"]:
    """Two uint8 codes in 0..15 per byte: even index in the low nibble, odd in the high."""
    pairs = codes.reshape(codes.shape[0], BLOCK_SIZE // 2, 2)  # explicit sizes: -1 fails on 0 blocks
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: Shaped[Array, "*lead blocks half"]) -> Shaped[Array, "*lead blocks block"]:
    """Inverse of `_pack_nibbles` (over any leading axes)."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], BLOCK_SIZE)


def _pack_crumbs(codes: Shaped[Array, "blocks block"]) -> Shaped[Array, "blocks quarter"]:
    """Four uint8 codes in 0..3 per byte: index 4i + j in bits 2j and 2j + 1 of byte i."""
    quads = codes.reshape(codes.shape[0], BLOCK_SIZE // 4, 4)
    return quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)


def _unpack_crumbs(packed: Shaped[Array, "*lead blocks quarter"]) -> Shaped[Array, "*lead blocks block"]:
    """Inverse of `_pack_crumbs` (over any leading axes)."""
    quads = jnp.stack([(packed >> shift) & 0x3 for shift in (0, 2, 4, 6)], axis=-1)
    return quads.reshape(*packed.shape[:-1], BLOCK_SIZE)


def encode(x: Float[Array, "..."], fmt: str) -> Payload:
    """Quantize one array for the wire.

    Pure jnp, so it can be traced by `jax.jit` (with `fmt` static) and mapped by `jax.vmap`.

    **Arguments:**

    - `x`: the array to send (any shape; cast to float32 first).
    - `fmt`: one of `FORMATS`.

    **Returns:** a `Payload` whose leaf shapes and dtypes depend only on `x.shape` and `fmt`.
    """
    _check(fmt)
    x = jnp.asarray(x).astype(jnp.float32)
    if fmt == "none":
        return Payload(data=x, scales=None)
    if fmt == "bf16":
        return Payload(data=x.astype(jnp.bfloat16), scales=None)

    blocks_n = _num_blocks(x.size)
    flat = x.reshape(-1)
    # Zero padding never raises a block's absmax, so it does not change the real values' codes.
    flat = jnp.pad(flat, (0, blocks_n * BLOCK_SIZE - x.size))
    blocks = flat.reshape(blocks_n, BLOCK_SIZE)

    finite = jnp.all(jnp.isfinite(blocks), axis=-1)
    # Non-finite blocks get zero codes (deterministic payload) and a NaN scale (below).
    blocks = jnp.where(finite[:, None], blocks, 0.0)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)

    if fmt == "e3m0":
        scale = absmax
    elif fmt == "fp8":
        scale = absmax / _FP8_MAX
    elif fmt == "int2":
        # A product, not absmax / 3: XLA may turn a division by 3 into a product with 1/3,
        # and eager and jitted encodes must agree bit for bit.
        scale = absmax * jnp.float32(1 / 3)
    else:
        scale = absmax / _INT_MAX[fmt]
    # An all-zero block (or one whose scale underflowed) divides by 1: its codes are zero
    # either way, and decode multiplies them by the stored scale of 0.
    divisor = jnp.where(scale > 0, scale, 1.0)[:, None]
    scaled = blocks / divisor

    if fmt == "fp8":
        # |scaled| <= 448 up to one rounding of the division; clip so the cast can never
        # hit e4m3fn's NaN (it has no infinity).
        data = jnp.clip(scaled, -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
    elif fmt == "int8":
        data = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    elif fmt == "int4":
        q = jnp.clip(jnp.round(scaled), -7, 7)
        data = _pack_nibbles((q + 8).astype(jnp.uint8))
    elif fmt == "int2":
        # Levels -3, -1, 1, 3 (x absmax / 3), codes 0..3: the sign picks a side (signbit, so
        # tiny values and -0.0 keep theirs), |scaled| >= 2 the outer level.
        outer = jnp.abs(scaled) >= 2.0
        code = jnp.where(jnp.signbit(scaled), jnp.where(outer, 0, 1), jnp.where(outer, 3, 2))
        data = _pack_crumbs(code.astype(jnp.uint8))
    else:  # e3m0
        a = jnp.abs(scaled)
        code = jnp.zeros(a.shape, jnp.uint8)
        for threshold in _E3M0_THRESHOLDS:
            code = code + (a >= threshold).astype(jnp.uint8)
        # signbit (not x < 0) so that -0.0 keeps its sign too.
        sign = jnp.signbit(scaled).astype(jnp.uint8) << 3
        data = _pack_nibbles(sign | code)

    scale = jnp.where(finite, scale, jnp.nan)
    return Payload(data=data, scales=scale)


def decode(payload: Payload, fmt: str, shape: tuple[int, ...]) -> Float32[Array, "..."]:
    """Dequantize a payload back to float32.

    Traceable by `jax.jit` (with `fmt` and `shape` static) and `jax.vmap`.

    **Arguments:**

    - `payload`: the output of `encode(x, fmt)` for an `x` of shape `shape`. Its leaves may
      have extra leading axes (e.g. a replica axis from `all_gather`); they are kept.
    - `fmt`: the format it was encoded with.
    - `shape`: the shape of the original array.

    **Returns:** a float32 array of shape `(*leading_axes, *shape)`.
    """
    _check(fmt)
    shape = tuple(shape)
    size = math.prod(shape)
    if fmt in ("none", "bf16"):
        # "none" is returned unchanged (bit-exact); the cast is a no-op for float32.
        return payload.data.astype(jnp.float32)

    assert payload.scales is not None
    data = payload.data
    lead = data.shape[:-2]
    if fmt == "fp8":
        values = data.astype(jnp.float32)
    elif fmt == "int8":
        values = data.astype(jnp.float32)
    elif fmt == "int4":
        values = _unpack_nibbles(data).astype(jnp.float32) - 8.0
    elif fmt == "int2":
        values = 2.0 * _unpack_crumbs(data).astype(jnp.float32) - 3.0
    else:  # e3m0
        nibbles = _unpack_nibbles(data)
        code = nibbles & 0x7
        magnitude = jnp.asarray((0.0,) + tuple(2.0 ** (c - _E3M0_CODES) for c in range(1, _E3M0_CODES + 1)))
        magnitude = magnitude.astype(jnp.float32)[code]
        values = jnp.where((nibbles >> 3) != 0, -magnitude, magnitude)

    # Multiplying by a NaN scale turns the whole block NaN (the non-finite policy).
    out = values * payload.scales[..., None]
    out = out.reshape(*lead, data.shape[-2] * BLOCK_SIZE)[..., :size]
    return out.reshape(*lead, *shape)


def payload_nbytes(shape: tuple[int, ...], fmt: str) -> int:
    """Exact bytes on the wire for one array: codes, padding and scales.

    Equals the sum of `leaf.nbytes` over `encode(x, fmt)` for an `x` of shape `shape`.

    **Arguments:**

    - `shape`: shape of the array being sent.
    - `fmt`: one of `FORMATS`.
    """
    _check(fmt)
    size = math.prod(shape)
    if fmt == "none":
        return 4 * size
    if fmt == "bf16":
        return 2 * size
    blocks_n = _num_blocks(size)
    return blocks_n * (BLOCK_SIZE * _CODE_BITS[fmt] // 8 + 4)


def bits_per_value(fmt: str) -> float:
    """Effective bits per value of a large array (block-aligned), scales included.

    **Arguments:**

    - `fmt`: one of `FORMATS`.
    """
    _check(fmt)
    if fmt == "none":
        return 32.0
    if fmt == "bf16":
        return 16.0
    return _CODE_BITS[fmt] + 32 / BLOCK_SIZE
