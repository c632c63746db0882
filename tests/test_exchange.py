"""The replica-sum exchange (`eqx_diloco._exchange`): two-phase vs a numpy reference, the
one-shot gather vs the previous implementation, skipped replicas, error feedback, wire
bytes and the sync program's memory.

The numpy reference below re-implements every format's rounding from the format
definitions in `quantize`'s docstring (int8, int4, e3m0 entirely in numpy; bf16 and fp8
round with `ml_dtypes` casts, the numpy dtypes JAX itself uses) and the two-phase
chunking from `_exchange`'s docstring. It never calls `quantize.encode`/`decode`.
"""

import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqx_diloco import _exchange, quantize
from eqx_diloco._codec import Codec
from eqx_diloco._exchange import exchange_sum, resolve_method, wire_nbytes
from util import slow_except

ROOT = pathlib.Path(__file__).resolve().parents[1]
B = 256  # quantize.BLOCK_SIZE, restated
QUANTIZED = ("bf16", "fp8", "int8", "int4", "e3m0")


# ----------------------------------------------------------------------------- numpy reference


def np_round_trip(x: np.ndarray, fmt: str) -> np.ndarray:
    """decode(encode(x)) for a 1-D float32 vector, in numpy."""
    x = np.asarray(x, np.float32)
    if fmt == "none":
        return x.copy()
    if fmt == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    n = x.size
    blocks = np.zeros(-(-n // B) * B, np.float32)
    blocks[:n] = x
    blocks = blocks.reshape(-1, B)
    finite = np.isfinite(blocks).all(axis=1)
    blocks[~finite] = 0.0
    absmax = np.abs(blocks).max(axis=1)
    denominator = {"e3m0": 1.0, "fp8": 448.0, "int8": 127.0, "int4": 7.0, "int2": 3.0}[fmt]
    # XLA folds a division by a constant into a product with its float32 reciprocal, so
    # `absmax / 7` in `quantize.encode` is computed as this:
    scale = (absmax * (np.float32(1.0) / np.float32(denominator))).astype(np.float32)
    divisor = np.where(scale > 0, scale, np.float32(1.0))[:, None]
    scaled = (blocks / divisor).astype(np.float32)
    if fmt in ("int8", "int4"):
        limit = 127.0 if fmt == "int8" else 7.0
        values = np.clip(np.round(scaled), -limit, limit).astype(np.float32)  # np.round: ties to even
    elif fmt == "fp8":
        values = np.clip(scaled, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif fmt == "int2":  # levels -3, -1, 1, 3: the sign picks a side, |scaled| >= 2 the outer one
        values = np.where(np.abs(scaled) >= 2, 3.0, 1.0) * np.where(np.signbit(scaled), -1.0, 1.0)
        values = values.astype(np.float32)
    else:  # e3m0: magnitudes 2**-e (e = 0..6) and 0, nearest in the linear domain
        a = np.abs(scaled)
        thresholds = [2.0**-7] + [0.75 * 2.0 ** (c - 6) for c in range(1, 7)]
        code = sum((a >= np.float32(t)).astype(np.int32) for t in thresholds)
        magnitude = np.where(code == 0, 0.0, 2.0 ** (code.astype(np.float32) - 7)).astype(np.float32)
        values = np.where(np.signbit(scaled), -magnitude, magnitude).astype(np.float32)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    return (values * scale[:, None]).astype(np.float32).reshape(-1)[:n]


def np_chunk(n: int, fmt: str, R: int) -> int:
    per = math.ceil(n / R)
    return per if fmt in ("none", "bf16") else B * math.ceil(per / B)


def np_two_phase(xs: np.ndarray, weights: np.ndarray, fmt: str):
    """(total, own_errors (R, n), owned sums (R * c,)) of the two-phase exchange, in numpy."""
    R, n = xs.shape
    c = np_chunk(n, fmt, R)
    padded = np.zeros((R, R * c), np.float32)
    padded[:, :n] = xs
    sent = np.stack([np.concatenate([np_round_trip(padded[r, k * c : (k + 1) * c], fmt) for k in range(R)]) for r in range(R)])
    errors = padded - sent
    sent[weights == 0] = 0.0
    total = np.zeros(R * c, np.float32)
    sums = np.zeros(R * c, np.float32)
    for k in range(R):  # owner k sums its chunk in replica order, then re-rounds the sum
        owned = sent[0, k * c : (k + 1) * c].copy()
        for r in range(1, R):
            owned = (owned + sent[r, k * c : (k + 1) * c]).astype(np.float32)
        reduced = np_round_trip(owned, fmt)
        total[k * c : (k + 1) * c] = reduced
        sums[k * c : (k + 1) * c] = owned
        errors[k, k * c : (k + 1) * c] += owned - reduced
    return total[:n], errors[:, :n], sums


def _block_absmax(x: np.ndarray) -> np.ndarray:
    """Each value's block absmax (blocks of B from index 0; NaN counts as 0)."""
    n = x.size
    padded = np.zeros(-(-n // B) * B, np.float64)
    padded[:n] = np.nan_to_num(np.abs(x), nan=0.0, posinf=0.0)
    return np.repeat(padded.reshape(-1, B).max(axis=1), B)[:n]


def quantization_bound(x: np.ndarray, fmt: str) -> np.ndarray:
    """|decode(encode(x)) - x| bound per value (from `quantize`'s docstring)."""
    m, a = _block_absmax(x), np.abs(x.astype(np.float64))
    return {
        "none": 0.0 * a,
        "bf16": 2.0**-8 * a,
        "fp8": 2.0**-4 * a + 2.0**-10 * m / 448,
        "int8": m / 254,
        "int4": m / 14,
        "e3m0": np.maximum(a / 3, m * 2.0**-7),
    }[fmt]


def assert_matches_reference(got, want, magnitude, flip_bound=None, max_flip_fraction=0.01):
    """`got` equals the numpy reference up to float32 rounding: XLA may fuse a decode's
    product into the following add or subtract (one FMA, one rounding fewer) and so differ
    from numpy's two roundings by an ulp of the block's magnitude (`magnitude`: each
    value's block absmax of what was summed). An ulp in a sum that is then re-quantized can
    move a value across a rounding boundary: such flips must be rare and no bigger than two
    quantization errors of that sum (`flip_bound`)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    diff = np.abs(got - want)[ok]
    tol = 16 * np.finfo(np.float32).eps * magnitude[ok] + 1e-30
    off = diff > tol
    if flip_bound is None:
        assert not off.any(), f"max diff {diff.max()} at tol {tol[np.argmax(diff)]}"
        return
    assert off.mean() <= max_flip_fraction, off.mean()
    assert (diff[off] <= 2 * flip_bound[ok][off] + tol[off]).all()


# ----------------------------------------------------------------------------- jax harness


def make_mesh(R: int, data: int = 1):
    return jax.make_mesh((R, data), ("diloco", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[: R * data])


_FNS = {}


def run_exchange(xs, weights, fmt, method, data: int = 1):
    """exchange_sum under shard_map on an (R, data) mesh: (total, own_errors (R, n))."""
    R = xs.shape[0]
    key = (R, data, fmt, method)
    if key not in _FNS:
        def body(x, w):
            total, own_error = exchange_sum(x[0], w[0], fmt, method=method)
            return total, own_error[None]

        _FNS[key] = jax.jit(jax.shard_map(body, mesh=make_mesh(R, data), in_specs=(P("diloco"), P("diloco")),
                                          out_specs=(P(), P("diloco"))))
    total, errors = _FNS[key](jnp.asarray(xs, jnp.float32), jnp.asarray(weights, jnp.float32))
    return np.asarray(total), np.asarray(errors)


def sample(R: int, n: int, seed: int = 0) -> np.ndarray:
    """Per-replica vectors with varied magnitudes (outliers, zeros, a tie-prone region)."""
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(R, n)).astype(np.float32) * np.float32(1e-3)
    xs[:, ::97] *= 50.0  # outliers set some blocks' scales
    xs[:, 5:40] = 0.0
    xs[:, 300:340] = np.round(xs[:, 300:340] * 4e3) / 4e3  # values on a coarse grid
    return xs


# ----------------------------------------------------------------------------- tests

RS = (2, 3, 4, 8)
N = 3 * B * 4 + 77  # not a multiple of the block size nor of any R


@pytest.mark.parametrize("R", RS)
def test_two_phase_lossless_equals_psum(R):
    xs = sample(R, N, seed=R)
    ones = np.ones(R, np.float32)
    total, errors = run_exchange(xs, ones, "none", "two_phase")
    psum, _ = run_exchange(xs, ones, "none", "psum")
    np.testing.assert_allclose(total, psum, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(total, xs.astype(np.float64).sum(0), rtol=1e-5, atol=1e-8)
    assert not errors.any()


@pytest.mark.parametrize("fmt,R", slow_except([(fmt, R) for fmt in QUANTIZED for R in RS],
                                              fast=[("bf16", 2), ("fp8", 8), ("int8", 3), ("int4", 4), ("e3m0", 8)]))
def test_two_phase_quantized_equals_numpy_reference(R, fmt):
    xs = sample(R, N, seed=10 + R)
    weights = np.ones(R, np.float32)
    weights[R - 1] = 0.0  # the last replica is skipped (and owns a chunk)
    xs[R - 1, 3] = np.nan
    total, errors = run_exchange(xs, weights, fmt, "two_phase")
    ref_total, ref_errors, sums = np_two_phase(xs, weights, fmt)
    n = xs.shape[1]
    magnitude = _block_absmax(np.nansum(np.abs(xs[: R - 1]), axis=0))
    flips = quantization_bound(sums, fmt)[:n]
    assert_matches_reference(total, ref_total, magnitude, flips)
    for r in range(R):
        # Replica r's error is its own rounding, plus e2 on the chunk it owns. The skipped
        # replica's is NaN in its non-finite block, like the reference's.
        mine = _block_absmax(np.abs(xs[r])) + magnitude
        assert_matches_reference(errors[r], ref_errors[r], mine, flips)
    assert np.isfinite(total).all()
    # Close to the exact sum of the kept replicas (a sanity bound, not the equivalence).
    exact = xs[: R - 1].astype(np.float64).sum(0)
    assert np.abs(total - exact).max() <= 0.5 * R * np.abs(xs[: R - 1]).max()


def _old_gather(fmt):
    """The one-shot exchange as `outer.mean_outer_gradient` wrote it before `_exchange`."""

    def body(x, w):
        flat = x[0]
        weight = w[0]
        payload = quantize.encode(flat, fmt)
        residual = flat - quantize.decode(payload, fmt, flat.shape)
        gathered = jax.lax.all_gather(payload, "diloco", to="invarying")
        decoded = quantize.decode(gathered, fmt, flat.shape)
        weights = jax.lax.all_gather(weight, "diloco", to="invarying")
        total = jnp.sum(jnp.where(weights[:, None] > 0, decoded, jnp.zeros_like(decoded)), axis=0)
        return total, residual[None]

    return body


@pytest.mark.parametrize("R", slow_except(RS, fast=[3, 8]))
def test_gather_equals_previous_one_shot_exchange(R):
    mesh = make_mesh(R)
    xs = sample(R, N, seed=20 + R)
    weights = np.ones(R, np.float32)
    weights[0] = 0.0
    xs[0, 100] = np.inf
    for fmt in ("int4",) if R != 4 else quantize.FORMATS:
        old = jax.jit(jax.shard_map(_old_gather(fmt), mesh=mesh, in_specs=(P("diloco"), P("diloco")),
                                    out_specs=(P(), P("diloco"))))
        old_total, old_errors = (np.asarray(a) for a in old(jnp.asarray(xs), jnp.asarray(weights)))
        total, errors = run_exchange(xs, weights, fmt, "gather")
        # Same values; the old reduce may add the R rows in another order than replica order.
        magnitude = _block_absmax(np.nansum(np.abs(xs[1:]), axis=0))
        assert_matches_reference(total, old_total, magnitude)
        np.testing.assert_array_equal(errors, old_errors)
        # and the numpy reference: one round trip per replica, summed in replica order
        reference = np.zeros(N, np.float32)
        for r in range(R):
            if weights[r] > 0:
                reference = (reference + np_round_trip(xs[r], fmt)).astype(np.float32)
        assert_matches_reference(total, reference, magnitude)
        with np.errstate(invalid="ignore"):  # inf - inf in replica 0's skipped block
            own = xs - np.stack([np_round_trip(x, fmt) for x in xs])
        for r in range(R):
            assert_matches_reference(errors[r], own[r], _block_absmax(np.abs(xs[r])))


def test_gather_and_two_phase_share_the_phase_one_rounding():
    """Chunks are whole blocks: the sender's rounding error is the same under both methods."""
    R = 4
    xs = sample(R, N, seed=3)
    ones = np.ones(R, np.float32)
    _, gather_errors = run_exchange(xs, ones, "int4", "gather")
    _, two_phase_errors = run_exchange(xs, ones, "int4", "two_phase")
    c = _exchange.chunk_size(N, "int4", R)
    for r in range(R):
        outside = np.ones(N, bool)
        outside[r * c : (r + 1) * c] = False  # replica r's owned chunk also carries e2
        np.testing.assert_array_equal(two_phase_errors[r][outside], gather_errors[r][outside])
        assert np.abs(two_phase_errors[r][~outside] - gather_errors[r][~outside]).max() > 0


@pytest.mark.parametrize("method", ["psum", "gather", "two_phase"])
def test_skipped_replicas_contribute_nothing(method):
    R = 4
    fmt = "none" if method == "psum" else "int8"
    xs = sample(R, N, seed=7)
    weights = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    garbage = xs.copy()
    garbage[1] = np.nan
    garbage[3] = 1e30
    total, _ = run_exchange(garbage, weights, fmt, method)
    reference, _ = run_exchange(np.where(weights[:, None] > 0, xs, 0.0).astype(np.float32), np.ones(R, np.float32),
                                fmt, method)
    np.testing.assert_array_equal(total, reference)
    none, _ = run_exchange(garbage, np.zeros(R, np.float32), fmt, method)
    assert not none.any()


def test_other_mesh_axes_are_replicated_over():
    R, data = 4, 3
    xs = sample(R, N, seed=5)
    ones = np.ones(R, np.float32)
    for fmt in ("none", "int4"):
        total, errors = run_exchange(xs, ones, fmt, "two_phase", data=data)
        ref_total, ref_errors, sums = np_two_phase(xs, ones, fmt)
        magnitude = _block_absmax(np.abs(xs).sum(axis=0))
        flips = quantization_bound(sums, fmt)[:N]
        assert_matches_reference(total, ref_total, magnitude, flips)
        for r in range(R):
            assert_matches_reference(errors[r], ref_errors[r], magnitude, flips)


def _simulate(deltas: np.ndarray, fmt: str, carry: float):
    """Rounds of two-phase with error feedback (numpy). `carry` scales the owner's e2 in
    its residual (1: the library's choice). Returns per-round transmitted means and residuals."""
    T, R, n = deltas.shape
    residual = np.zeros((R, n), np.float32)
    ones = np.ones(R, np.float32)
    means = []
    for t in range(T):
        x = (deltas[t] + residual).astype(np.float32)
        total, errors, _ = np_two_phase(x, ones, fmt)  # errors: e1 + e2 on the owned chunk
        if carry != 1:  # e1 everywhere, plus carry * e2 on the owned chunk
            e1 = np.stack([x[r] - _phase_one(x[r], fmt, R) for r in range(R)])
            errors = (e1 + np.float32(carry) * (errors - e1)).astype(np.float32)
        means.append(total / R)
        residual = errors
    return np.array(means), residual


def _phase_one(x, fmt, R):
    n = x.size
    c = np_chunk(n, fmt, R)
    padded = np.zeros(R * c, np.float32)
    padded[:n] = x
    return np.concatenate([np_round_trip(padded[k * c : (k + 1) * c], fmt) for k in range(R)])[:n]


def test_error_feedback_makes_the_time_summed_mean_unbiased():
    """Carrying e1 plus the owner's e2 telescopes: sum_t mean_t = sum_t true mean_t - E_T / R."""
    R, T = 4, 30
    n = 2 * B * R
    rng = np.random.default_rng(0)
    # A persistent direction plus noise: deterministic rounding then errs the same way each round.
    deltas = (0.01 * rng.normal(size=(1, R, n)) + 0.003 * rng.normal(size=(T, R, n))).astype(np.float32)
    true = deltas.astype(np.float64).mean(axis=1).sum(axis=0)
    drift = {}
    for carry in (0.0, 1.0, float(R)):
        means, residual = _simulate(deltas, "int4", carry)
        drift[carry] = means.astype(np.float64).sum(axis=0) - true
        if carry == 1.0:
            carried = residual.astype(np.float64).sum(axis=0)
            np.testing.assert_allclose(drift[carry], -carried / R, atol=1e-5)
    size = {k: float(np.sqrt(np.mean(v**2))) for k, v in drift.items()}
    one_round = float(np.sqrt(np.mean(carried**2))) / R
    assert size[1.0] <= 1.01 * one_round  # bounded by one round's residual, whatever T
    assert size[1.0] < 0.5 * size[0.0] and size[1.0] < 0.5 * size[float(R)], size


def test_wire_nbytes_by_hand():
    n = 1_000_000
    # psum: ring all-reduce, 2 (R - 1) / R of 4n bytes
    assert wire_nbytes(n, "none", 2, "psum") == 4_000_000
    assert wire_nbytes(n, "none", 8, "psum") == 7_000_000
    assert wire_nbytes(n, "none", 3, "psum") == 5_333_334  # ceil(16e6 / 3)
    assert wire_nbytes(n, "none", 1, "psum") == 0
    # int4 payload of n values: ceil(n / 256) = 3907 blocks of 128 code bytes + 4 scale bytes
    assert quantize.payload_nbytes((n,), "int4") == 3907 * 132
    assert wire_nbytes(n, "int4", 4, "gather") == 3 * 3907 * 132
    assert wire_nbytes(n, "int8", 8, "gather") == 7 * 3907 * 260
    assert wire_nbytes(n, "bf16", 3, "gather") == 2 * 2 * n
    # two_phase int4 at R = 8: chunk = 256 * ceil(125000 / 256) = 125184 values = 489 blocks
    assert _exchange.chunk_size(n, "int4", 8) == 125_184
    assert wire_nbytes(n, "int4", 8, "two_phase") == 2 * 7 * 489 * 132
    # R = 3: chunk 256 * ceil(333334 / 256) = 333568 = 1303 blocks
    assert wire_nbytes(n, "int8", 3, "two_phase") == 2 * 2 * 1303 * 260
    # bf16 / none chunks are unaligned: ceil(n / R) values
    assert wire_nbytes(n, "bf16", 3, "two_phase") == 2 * 2 * 333_334 * 2
    assert wire_nbytes(n, "none", 4, "two_phase") == 2 * 3 * 250_000 * 4
    assert _exchange.payload_nbytes_for(n, "int4", 8, "two_phase") == 8 * 489 * 132
    assert _exchange.payload_nbytes_for(n, "int4", 8, "gather") == 3907 * 132
    assert wire_nbytes(n, "int4", 8, "auto") == wire_nbytes(n, "int4", 8, "two_phase")


@pytest.mark.parametrize("R", RS)
def test_int4_two_phase_wire_bytes_at_most_014_of_float32_psum(R):
    n = 4_000_000
    ratio = wire_nbytes(n, "int4", R, "two_phase") / wire_nbytes(n, "none", R, "psum")
    assert ratio <= 0.14, ratio
    gather_ratio = wire_nbytes(n, "int4", R, "gather") / wire_nbytes(n, "none", R, "psum")
    assert gather_ratio == pytest.approx(0.129 * R / 2, rel=0.01)  # the one-shot cost grows with R


def test_wire_bytes_match_the_payload_shapes_in_the_program():
    """wire_nbytes two_phase = 2 (R - 1) x the bytes of one chunk's leaves as traced."""
    R, n = 8, 100_000
    c = _exchange.chunk_size(n, "int4", R)
    leaves = jax.tree.leaves(jax.eval_shape(lambda x: quantize.encode(x, "int4"), jax.ShapeDtypeStruct((c,), jnp.float32)))
    chunk_bytes = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)
    assert wire_nbytes(n, "int4", R, "two_phase") == 2 * (R - 1) * chunk_bytes


def test_resolve_method():
    assert resolve_method("auto", 8, "none") == "psum"
    assert resolve_method("auto", 2, "int4") == "gather"
    assert resolve_method("auto", 1, "int4") == "gather"
    assert resolve_method("auto", 3, "int4") == "two_phase"
    # Top-k payloads: gathered up to R = 8 (a second top-k of the reduced sum trains worse), two-phase above.
    assert resolve_method("auto", 8, Codec("int2", topk=0.03)) == "gather"
    assert resolve_method("auto", 9, Codec("int2", topk=0.03)) == "two_phase"
    assert resolve_method("two_phase", 2, "none") == "two_phase"
    with pytest.raises(ValueError):
        resolve_method("psum", 4, "int4")
    with pytest.raises(ValueError):
        resolve_method("ring", 4, "int4")


def _temp_bytes(R: int, n: int, fmt: str, method: str) -> int:
    def body(x, w):
        total, own_error = exchange_sum(x[0], w[0], fmt, method=method)
        return total, own_error[None]

    fn = jax.jit(jax.shard_map(body, mesh=make_mesh(R), in_specs=(P("diloco"), P("diloco")), out_specs=(P(), P("diloco"))))
    compiled = fn.lower(jax.ShapeDtypeStruct((R, n), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.float32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes  # per device


def test_two_phase_temporary_memory_does_not_grow_with_R():
    n = 1 << 20
    for fmt, replicas in (("int4", (2, 4, 8)), ("none", (2, 8))):
        temp = {R: _temp_bytes(R, n, fmt, "two_phase") for R in replicas}
        assert temp[8] < 3 * n * 4 + (1 << 16), (fmt, temp)
        assert temp[8] <= 1.3 * temp[2] + (1 << 16), (fmt, temp)
    # the one-shot float32 exchange holds the (R, n) matrix: the measure does see it
    assert _temp_bytes(8, n, "none", "gather") >= 8 * n * 4


@pytest.mark.slow
def test_wire_benchmark_quick(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "benchmarks.wire", "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=240)
    import json

    result = json.loads((tmp_path / "wire.json").read_text())
    assert result["num_cpu_devices"] >= max(result["replicas"])
    rows = result["rows"]
    assert {row["method"] for row in rows} == {"psum", "gather", "two_phase"}
    for row in rows:
        assert row["wire_bytes"] == wire_nbytes(result["num_values"], row["format"], row["replicas"], row["method"])
        assert row["time_s"] > 0 and row["temp_bytes"] >= 0
    assert "| R |" in (tmp_path / "wire.md").read_text()
