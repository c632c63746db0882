"""Wire formats of outer gradients: round trips, error bounds, edge cases, byte counts, tracing."""

import functools

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqx_diloco.quantize import (
    BLOCK_SIZE,
    FORMATS,
    Payload,
    bits_per_value,
    decode,
    encode,
    payload_nbytes,
)
from util import slow_except

BLOCKED = ("fp8", "int8", "int4", "e3m0", "int2")
QUANTIZED = ("bf16",) + BLOCKED


_encode = jax.jit(encode, static_argnames="fmt")


@functools.partial(jax.jit, static_argnames="fmt")
def _round_trip(x, fmt):
    return decode(encode(x, fmt), fmt, x.shape)


def round_trip(x, fmt):
    """decode(encode(x)) as numpy (jitted: one compile per shape instead of one per op)."""
    return np.asarray(_round_trip(jnp.asarray(x, jnp.float32), fmt))


def block_absmax(x: np.ndarray) -> np.ndarray:
    """Each value's block absmax, in the input's shape (the reference for the error bounds)."""
    flat = np.abs(x.reshape(-1))
    blocks = -(-flat.size // BLOCK_SIZE)
    padded = np.zeros(blocks * BLOCK_SIZE, np.float32)
    padded[: flat.size] = flat
    m = padded.reshape(blocks, BLOCK_SIZE).max(axis=1)
    return np.repeat(m, BLOCK_SIZE)[: flat.size].reshape(x.shape)


def error_bound(fmt: str, x: np.ndarray) -> np.ndarray:
    """Per-value worst-case |decode(encode(x)) - x| of each format (as in the module docstring)."""
    ax = np.abs(x).astype(np.float64)
    m = block_absmax(x).astype(np.float64)
    bound = {
        "none": 0.0 * ax,
        "bf16": 2.0**-8 * ax,  # 8 significant bits, round to nearest
        "fp8": 2.0**-4 * ax + 2.0**-10 * m / 448,  # 4 significant bits; subnormal step 2**-9
        "int8": m / 254,  # half a step of absmax / 127
        "int4": m / 14,  # half a step of absmax / 7
        "int2": m / 3,  # half a step of 2 absmax / 3, and zero (no zero level) decodes to absmax / 3
        "e3m0": np.maximum(ax / 3, m * 2.0**-7),  # worst at 0.75 * 2**-e; below 2**-6 half of 2**-6
    }[fmt]
    # Slack for the float32 rounding of the scale, the division and the multiply.
    return bound * (1 + 1e-5) + (1e-6 * m if fmt in BLOCKED else 0.0)


def random_gradient(key, shape, spread=True):
    """Normal values with per-row magnitudes spread over many decades (like real gradients)."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape)
    if spread:
        x = x * 10.0 ** jax.random.uniform(k2, shape[:1] + (1,) * (len(shape) - 1), minval=-6, maxval=3)
    return np.array(x)  # a writable copy


def test_formats_and_unknown_format():
    assert FORMATS == ("none", "bf16", "fp8", "int8", "int4", "e3m0", "int2")
    for fn in (lambda: encode(jnp.zeros(3), "int3"), lambda: payload_nbytes((3,), "fp16")):
        with pytest.raises(ValueError, match="unknown quantization format"):
            fn()


# ---------------------------------------------------------------- byte counts


@pytest.mark.parametrize("fmt", slow_except(FORMATS, fast=["none", "int4", "e3m0", "int2"]))
def test_payload_nbytes_equals_leaf_bytes(fmt):
    # Real encodes (scalar, empty, padded, multi-dimensional) ...
    for shape in [(), (0,), (257,), (3, 100)]:
        payload = _encode(jnp.ones(shape), fmt=fmt)
        assert isinstance(payload, Payload)
        assert sum(leaf.nbytes for leaf in jax.tree.leaves(payload)) == payload_nbytes(shape, fmt)
    # ... and, without compiling, the traced output shapes of more.
    for shape in [(1,), (255,), (256,), (2, 3, 4, 5), (1000, 33)]:
        out = jax.eval_shape(functools.partial(encode, fmt=fmt), jax.ShapeDtypeStruct(shape, jnp.float32))
        assert sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(out)) == payload_nbytes(shape, fmt)


def test_payload_nbytes_includes_padding_and_scales():
    # 257 values need two blocks: 512 padded codes plus two float32 scales.
    assert payload_nbytes((257,), "int8") == 2 * BLOCK_SIZE + 2 * 4
    assert payload_nbytes((257,), "int4") == 2 * BLOCK_SIZE // 2 + 2 * 4
    assert payload_nbytes((257,), "none") == 257 * 4


def test_compression_ratios_and_bits_per_value():
    shape = (1024, 1024)
    n = 1024 * 1024
    ratio = {fmt: payload_nbytes(shape, fmt) / (4 * n) for fmt in FORMATS}
    assert ratio["none"] == 1.0
    assert ratio["bf16"] == 0.5
    assert ratio["fp8"] == pytest.approx(0.25, rel=0.03)
    assert ratio["int8"] == pytest.approx(0.25, rel=0.03)
    assert ratio["int4"] <= 0.14
    assert ratio["e3m0"] <= 0.14
    for fmt in FORMATS:
        # Measured on a block-aligned array, the effective bits per value are exact.
        assert payload_nbytes(shape, fmt) * 8 / n == bits_per_value(fmt)
        # The real encoder agrees without running it.
        out = jax.eval_shape(functools.partial(encode, fmt=fmt), jax.ShapeDtypeStruct(shape, jnp.float32))
        assert sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(out)) == payload_nbytes(shape, fmt)


# ---------------------------------------------------------------- exact round trips


def test_none_is_bit_exact():
    x = np.array([0.0, -0.0, 1.5, -3e38, 1e-45, np.nan, np.inf, -np.inf], np.float32)
    payload = encode(jnp.asarray(x), "none")
    assert payload.scales is None and payload.data.dtype == jnp.float32
    y = round_trip(x, "none")
    np.testing.assert_array_equal(y.view(np.uint32), x.view(np.uint32))


def test_bf16_exact_for_representable_values():
    x = random_gradient(jax.random.key(0), (40, 50)).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(round_trip(x, "bf16"), x)


def test_fp8_exact_for_representable_values():
    # Every finite e4m3fn value (including subnormals, +-448 and -0) times 2**k: the block
    # absmax is 448 * 2**k, so the scale is exactly 2**k.
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes = codes[np.isfinite(codes)]
    for k in (-40, 0, 40):
        x = np.concatenate([codes * np.float32(2.0**k), np.zeros(2, np.float32)])  # one full block
        assert x.size == BLOCK_SIZE
        np.testing.assert_array_equal(round_trip(x, "fp8"), x)


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_int_exact_for_multiples_of_the_step(fmt, qmax):
    rng = np.random.default_rng(1)
    for k in (-30, -3, 0, 30):
        # Power-of-two step: q * step is exact, so the round trip is bit-exact.
        q = rng.integers(-qmax, qmax + 1, size=(4, BLOCK_SIZE)).astype(np.float32)
        q[:, 0] = qmax  # the block absmax, so the step is absmax / qmax = 2**k
        x = (q * np.float32(2.0**k)).reshape(-1)
        np.testing.assert_array_equal(round_trip(x, fmt), x)
    # Any absmax: multiples of absmax / qmax come back to within a float32 rounding.
    q = rng.integers(-qmax, qmax + 1, size=(3, BLOCK_SIZE)).astype(np.float32)
    q[:, 0] = -qmax
    x = (q * np.float32(0.37 / qmax)).reshape(-1)
    np.testing.assert_allclose(round_trip(x, fmt), x, rtol=1e-6, atol=0)


def test_e3m0_exact_for_representable_values():
    rng = np.random.default_rng(2)
    for m in (0.37, 1.0, 1e30, 1e-30):
        e = rng.integers(0, 7, size=(3, BLOCK_SIZE))
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=(3, BLOCK_SIZE))
        x = sign * np.float32(m) * np.exp2(-e).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = 0.0  # zero is representable too
        x[:, 0] = m  # the block absmax
        x = x.reshape(-1)
        np.testing.assert_array_equal(round_trip(x, "e3m0"), x)


def test_e3m0_rounds_to_nearest_in_linear_domain():
    # Block absmax 1; the representable magnitudes are 0 and 2**-6 .. 2**0.
    a = [1.0, 0.75, 0.7499, 0.5, 0.37, 0.3, 2.0**-6, 2.0**-7, 0.0077, 1e-4]
    want = [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 2.0**-6, 2.0**-6, 0.0, 0.0]
    x = np.array(a + [-v for v in a], np.float32)
    np.testing.assert_array_equal(round_trip(x, "e3m0"), np.array(want + [-v for v in want], np.float32))


def test_int4_and_e3m0_bit_layout():
    # Two codes per byte, even index in the low nibble. int4 stores q + 8.
    x = np.zeros(BLOCK_SIZE, np.float32)
    x[:4] = [7.0, -7.0, 0.0, 1.0]
    data = np.asarray(_encode(jnp.asarray(x), fmt="int4").data)
    assert data.shape == (1, BLOCK_SIZE // 2) and data.dtype == np.uint8
    assert data[0, 0] == (15 | 1 << 4) and data[0, 1] == (8 | 9 << 4) and data[0, 2] == 0x88
    # e3m0: sign bit 3, exponent code c (value absmax * 2**(c - 7), c = 0 is zero).
    x[:4] = [1.0, -0.5, 0.0, 2.0**-6]
    data = np.asarray(_encode(jnp.asarray(x), fmt="e3m0").data)
    assert data[0, 0] == (7 | (8 | 6) << 4) and data[0, 1] == (0 | 1 << 4) and data[0, 2] == 0


# ---------------------------------------------------------------- error bounds


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_random_values_within_the_format_step(fmt):
    x = random_gradient(jax.random.key(3), (37, 53))  # not a multiple of the block size
    y = round_trip(x, fmt)
    assert y.shape == x.shape and y.dtype == np.float32
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= error_bound(fmt, x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_and_signs(fmt):
    zeros = np.zeros((5, 300), np.float32)
    np.testing.assert_array_equal(round_trip(zeros, fmt), zeros)
    x = random_gradient(jax.random.key(4), (5, 300), spread=False)
    x[:, ::7] = 0.0
    y = round_trip(x, fmt)
    if fmt == "int2":  # no zero level: a zero inside a nonzero block becomes +-absmax / 3
        third = block_absmax(x)[:, ::7] / 3
        np.testing.assert_allclose(np.abs(y[:, ::7]), third, rtol=1e-6)
        x[:, ::7] = y[:, ::7]  # the sign checks below are about the other values
    else:
        np.testing.assert_array_equal(y[:, ::7], 0.0)  # zeros inside a nonzero block stay zero
    assert np.all(y * x >= 0)  # no value changes sign (small ones may flush to zero)
    big = np.abs(x) >= 0.5 * block_absmax(x)
    np.testing.assert_array_equal(np.sign(y[big]), np.sign(x[big]))


@pytest.mark.parametrize("fmt", BLOCKED)
def test_tiny_values_flush_to_zero_in_a_large_block(fmt):
    x = np.full(BLOCK_SIZE, 1e-12, np.float32)
    x[1::2] = -1e-12
    x[0] = 1.0
    y = round_trip(x, fmt)
    assert y[0] == pytest.approx(1.0, rel=1e-6)
    if fmt == "int2":  # no zero level: tiny values take the smallest one, with their sign
        np.testing.assert_allclose(y[1:], np.sign(x[1:]) / 3, rtol=1e-6)
    else:
        np.testing.assert_array_equal(y[1:], 0.0)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_huge_and_tiny_magnitudes_use_the_scale(fmt):
    base = random_gradient(jax.random.key(5), (4, BLOCK_SIZE), spread=False)
    # Whole blocks at 1e30 and 1e-30, next to ordinary ones: per-block scales keep each accurate.
    x = (base * np.array([[1e30], [1.0], [1e-30], [1e-3]], np.float32)).reshape(-1)
    y = round_trip(x, fmt)
    assert np.all(np.isfinite(y))
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= error_bound(fmt, x))
    if fmt == "e3m0":
        # The block absmax is the scale itself, so it comes back exactly at any magnitude.
        np.testing.assert_array_equal(block_absmax(y), block_absmax(x))
    assert np.count_nonzero(y[: 3 * BLOCK_SIZE]) > 2 * BLOCK_SIZE  # no block flushed wholesale


# ---------------------------------------------------------------- non-finite policy


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_policy(fmt):
    x = random_gradient(jax.random.key(6), (4 * BLOCK_SIZE,), spread=False)
    x[5] = np.nan  # block 0
    x[BLOCK_SIZE + 9] = np.inf  # block 1
    x[2 * BLOCK_SIZE + 200] = -np.inf  # block 2; block 3 stays finite
    y = round_trip(x, fmt).reshape(4, BLOCK_SIZE)
    xb = x.reshape(4, BLOCK_SIZE)
    if fmt in BLOCKED:
        # The whole block decodes to NaN so that a non-finite guard downstream trips.
        assert np.all(np.isnan(y[:3]))
        assert np.all(np.isfinite(y[3]))
        assert np.all(np.abs(y[3] - xb[3]) <= error_bound(fmt, xb[3]))
    else:
        # Unblocked formats carry NaN / +-Inf value by value.
        np.testing.assert_array_equal(np.isnan(y), np.isnan(xb))
        np.testing.assert_array_equal(np.isposinf(y), np.isposinf(xb))
        np.testing.assert_array_equal(np.isneginf(y), np.isneginf(xb))
    if fmt in BLOCKED:
        # The codes of a poisoned block are zeroed: the payload does not depend on garbage.
        payload = _encode(jnp.asarray(x), fmt=fmt)
        zero_codes = {"int4": 0x88, "int2": 0xAA}.get(fmt, 0x00)  # the code of 0 (int2: of +absmax / 3)
        assert np.all(np.asarray(payload.data[:3]).view(np.uint8) == zero_codes)


# ---------------------------------------------------------------- tracing


@pytest.mark.parametrize("fmt", slow_except(FORMATS, fast=["none", "int4", "e3m0", "int2"]))
def test_vmap_and_all_gather_of_payloads(fmt):
    replicas, shape = 3, (10, 30)
    x = jnp.asarray(random_gradient(jax.random.key(8), (replicas, *shape)))
    individual = np.stack([round_trip(x[r], fmt) for r in range(replicas)])

    @jax.jit
    def gather_then_decode(x):
        # Encode under vmap: every leaf gains the leading replica axis, like an all_gather.
        gathered = jax.vmap(functools.partial(encode, fmt=fmt))(x)
        by_vmap = jax.vmap(functools.partial(decode, fmt=fmt, shape=shape))(gathered)
        by_lead = decode(gathered, fmt, shape)  # leading axes pass through decode as well
        return gathered, by_vmap, by_lead

    gathered, by_vmap, by_lead = gather_then_decode(x)
    single = jax.eval_shape(functools.partial(encode, fmt=fmt), x[0])
    assert jax.tree.structure(gathered) == jax.tree.structure(single)
    for leaf, one in zip(jax.tree.leaves(gathered), jax.tree.leaves(single)):
        assert leaf.shape == (replicas, *one.shape) and leaf.dtype == one.dtype
    np.testing.assert_array_equal(np.asarray(by_vmap), individual)
    np.testing.assert_array_equal(np.asarray(by_lead), individual)

    # A real collective: each replica encodes, all_gathers the payload pytree over the
    # replica axis, decodes every replica's payload and averages in float32.
    def exchange(xr):
        payload = jax.lax.all_gather(encode(xr, fmt), "diloco")
        return jnp.mean(decode(payload, fmt, shape), axis=0)

    means = jax.jit(jax.vmap(exchange, axis_name="diloco"))(x)
    expected = individual.mean(axis=0)
    for r in range(replicas):
        np.testing.assert_allclose(np.asarray(means[r]), expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("fmt", slow_except(FORMATS, fast=["none", "int4", "e3m0", "int2"]))
def test_eager_matches_jit_and_casts_input(fmt):
    # Eager (op by op) and jitted encode agree bit for bit; non-float32 input is cast first.
    x = jnp.asarray([1.0, -0.5, 0.25, 0.0, 3e-3, -7.0], jnp.bfloat16)
    eager = encode(x, fmt)
    jitted = _encode(x, fmt=fmt)
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    y = decode(eager, fmt, x.shape)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y), round_trip(x, fmt))
    x32 = np.asarray(x.astype(jnp.float32))
    assert np.all(np.abs(np.asarray(y) - x32) <= error_bound(fmt, x32))
