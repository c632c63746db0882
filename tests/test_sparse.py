"""Top-k sparse outer gradients (`topk=`, `_codec.Codec`) and the int2 format.

The sparse exchange is checked against a plain numpy reference (top-k per chunk, quantize the
kept values, scatter into zeros, add the replicas, divide by the count), its byte counts
against the leaves of real payloads, a resume with residuals in flight against an
uninterrupted run, and every bad argument against its one-line refusal.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from custom_model import StackedMLP, loss_fn, make_batch
from jax.sharding import PartitionSpec
from test_exchange import np_round_trip
from util import resume_through_a_checkpoint

from eqx_diloco import ConfigError, DiLoCo
from eqx_diloco._codec import Codec, elias_fano_decode, elias_fano_encode, elias_fano_nbytes
from eqx_diloco._exchange import exchange_sum, wire_nbytes
from eqx_diloco._mesh import build_meshes


def np_topk_round_trip(x: np.ndarray, codec: Codec) -> np.ndarray:
    """decode(encode(x)) of the sparse codec, in numpy: per chunk the k largest magnitudes (ties
    to the lower index), their values in position order through the quantizer, chunk after
    chunk, scattered back."""
    n, C, k = x.size, codec.chunk_for(x.size), codec.k_for(x.size)
    chunks = np.zeros(-(-n // C) * C, np.float32)
    chunks[:n] = x
    chunks = chunks.reshape(-1, C)
    order = np.sort(np.argsort(-np.abs(chunks), axis=1, kind="stable")[:, :k], axis=1)
    kept = np.take_along_axis(chunks, order, axis=1)
    values = np_round_trip(kept.reshape(-1), codec.fmt).reshape(kept.shape)
    out = np.zeros_like(chunks)
    np.put_along_axis(out, order, values, axis=1)
    return out.reshape(-1)[:n]


def _exchange(codec: Codec, xs: np.ndarray, weights: np.ndarray, method: str, per_device: int = 1):
    R = xs.shape[0]
    mesh, _ = build_meshes(R, replicas_per_device=per_device)
    body = lambda x, w: exchange_sum(x, w, codec, method=method)  # noqa: E731
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("diloco"), PartitionSpec("diloco")),
                                out_specs=(PartitionSpec(), PartitionSpec("diloco"))))
    total, own_error = run(jnp.asarray(xs), jnp.asarray(weights))
    return np.asarray(total), np.asarray(own_error)


@pytest.mark.parametrize("fmt", ["none", "int2", "int4"])
@pytest.mark.parametrize("R", [2, 4])
def test_sparse_gather_equals_the_numpy_reference(fmt, R):
    codec = Codec(fmt, topk=0.05, chunk=64)
    n = 1000  # not a multiple of the chunk: the last one is padded
    xs = np.array(jax.random.normal(jax.random.key(R), (R, n)), np.float32)
    xs *= np.logspace(-3, 1, n, dtype=np.float32)  # magnitudes spread, as outer gradients are
    weights = np.ones(R, np.float32)
    weights[-1] = 0.0  # the last replica is left out (its values may be anything)
    xs[-1, 7] = np.nan
    total, own_error = _exchange(codec, xs, weights, "gather")
    sent = np.stack([np_topk_round_trip(x, codec) for x in xs[:-1]])
    np.testing.assert_allclose(total, sent.sum(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(own_error[:-1], xs[:-1] - sent, rtol=1e-6, atol=1e-6)
    # k entries of each chunk are sent (int4 may round a kept one to zero; int2 has no zero).
    kept = np.count_nonzero(sent[0])
    expected = math.ceil(n / 64) * codec.k_for(n)
    assert kept == expected if fmt != "int4" else kept <= expected


@pytest.mark.parametrize("per_device", [1, 2])
def test_sparse_two_phase_resparsifies_and_its_errors_telescope(per_device):
    """Two-phase with top-k: the owner of each chunk re-sparsifies the sum; every replica's own
    error plus the owner's carries exactly what did not arrive (sum of errors = sum of inputs -
    total), so error feedback loses nothing."""
    R, n = 4, 2048
    codec = Codec("int4", topk=0.03, chunk=256)
    xs = np.array(jax.random.normal(jax.random.key(7), (R, n)), np.float32)
    weights = np.ones(R, np.float32)
    total, own_error = _exchange(codec, xs, weights, "two_phase", per_device)
    np.testing.assert_allclose(own_error.sum(0) + total, xs.sum(0), rtol=1e-5, atol=1e-5)
    # The reduced sum is itself sparse: at most k entries per top-k chunk.
    assert np.count_nonzero(total) <= (n // 256) * codec.k_for(256)
    reference, _ = _exchange(codec, xs, weights, "two_phase", 1)
    np.testing.assert_array_equal(total, reference)  # replicas sharing devices change nothing


@pytest.mark.parametrize("C,k", [(8, 1), (8, 8), pytest.param(16, 15, marks=pytest.mark.slow),
                                 pytest.param(256, 7, marks=pytest.mark.slow), (1000, 3), (65536, 1311)])
def test_elias_fano_positions_round_trip_in_about_log2_c_over_k_plus_2_bits(C, k):
    rng = np.random.default_rng(C + k)
    positions = np.sort(np.stack([rng.choice(C, k, replace=False) for _ in range(4)]), axis=1).astype(np.int32)
    positions[0], positions[1] = np.arange(C - k, C), np.arange(k)  # the largest and the smallest positions
    code = elias_fano_encode(jnp.asarray(positions), C)
    assert code.dtype == jnp.uint8 and code.shape == (4, elias_fano_nbytes(C, k))
    np.testing.assert_array_equal(elias_fano_decode(code, C, k), positions)
    assert 8 * elias_fano_nbytes(C, k) <= k * (math.log2(C / k) + 2) + 15  # 15: the two parts' last bytes


@pytest.mark.parametrize("codec", [Codec("int2", 0.03, 256), Codec("int4", 0.1, 1024), Codec("none", 0.01, 64),
                                   Codec("int2"), Codec("int2", 0.03), Codec("bf16", 0.5, 8)], ids=str)
def test_payload_bytes_are_exact(codec):
    for n in (1, 255, 256, 1000, 5000, 70_000):
        payload = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((n,), jnp.float32))
        assert codec.nbytes(n) == sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(payload))


@pytest.mark.parametrize("chunk", [256, 65536])
def test_top3_percent_int2_at_r8_moves_under_a_twentieth_of_float32(chunk):
    n, R = 10_000_000, 8
    codec = Codec("int2", topk=0.03, chunk=chunk)
    dense = wire_nbytes(n, "none", R, "auto")
    two_phase, gather = wire_nbytes(n, codec, R, "two_phase"), wire_nbytes(n, codec, R, "gather")
    assert wire_nbytes(n, codec, R, "auto") == gather  # what `auto` picks for top-k at R = 8
    assert two_phase / dense <= 0.05
    assert gather / dense <= 0.05
    assert two_phase < gather  # at R = 8 the two-phase exchange sends 2 (R - 1) / R payloads, not R - 1


def _core(**overrides) -> DiLoCo:
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=6,
                  inner_optimizer=optax.adamw(3e-3), quantize="int2", error_feedback=True, topk=0.05,
                  topk_chunk=16)
    return DiLoCo(**{**kwargs, **overrides})


@pytest.mark.slow  # two trainings of the small model
def test_resume_with_sparse_residuals_in_flight_is_bit_exact(tmp_path):
    make = lambda: _core(num_fragments=3, overlap_steps=1)  # noqa: E731
    model = StackedMLP(key=jax.random.key(0))
    reference = make()
    state = reference.init(model)
    for step in range(14):
        state, _ = reference.step(state, make_batch(step, 2))
    expected = jax.device_get(reference.settle(state)[0])

    first = make()
    state = first.init(model)
    for step in range(8):  # fragment 0's sync was launched after step 7 and is still in flight
        state, _ = first.step(state, make_batch(step, 2))
    assert any(bool(jnp.any(r != 0)) for r in jax.tree.leaves(state.residuals))
    second, state = resume_through_a_checkpoint(first, state, make, model, tmp_path / "ckpt")
    for step in range(8, 14):
        state, _ = second.step(state, make_batch(step, 2))
    for a, b in zip(jax.tree.leaves(jax.device_get(second.settle(state)[0])), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("overrides", [pytest.param(dict(outer_overlap="eager"), marks=pytest.mark.slow),
                                       pytest.param(dict(num_fragments=3, overlap_steps=1), marks=pytest.mark.slow),
                                       pytest.param(dict(num_replicas=4, exchange="two_phase"), marks=pytest.mark.slow),
                                       pytest.param(dict(num_replicas=4, outer_overlap="eager"), marks=pytest.mark.slow)],
                         ids=["eager", "streaming", "r4", "eager-r4-two-phase"])
def test_sparse_syncs_train_with_every_overlap(overrides):
    diloco = _core(**overrides)
    R = diloco.num_replicas
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    losses = []
    for step in range(36):
        state, metrics = diloco.step(state, make_batch(step, R))
        losses.append(float(jnp.mean(metrics["loss"])))
    model = diloco.global_model(diloco.finish(state))
    assert all(np.isfinite(losses)) and np.mean(losses[-6:]) < 0.7 * np.mean(losses[:6])
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(model) if isinstance(x, jax.Array))
    assert 0 < diloco.bits_per_parameter < 32


@pytest.mark.parametrize("overrides,message", [
    (dict(topk=0.0), "topk must be a density in (0, 1] (got 0.0)"),
    (dict(topk=1.5), "topk must be a density in (0, 1] (got 1.5)"),
    (dict(error_feedback=False), "topk needs error_feedback"),
    (dict(topk_chunk=100), "topk_chunk must divide 65536 and be >= 8"),
    (dict(algorithm="ddp", quantize="none", error_feedback=False), "topk applies to algorithm diloco only"),
])
def test_bad_topk_arguments_are_refused_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        _core(**overrides)
    assert "\n" not in str(e.value)


def test_cli_names_the_topk_flags():
    from eqx_diloco.lm.config import Config, DiLoCoConfig, validate

    cases = [(dict(topk=0.03), r"^--diloco\.topk needs --diloco\.error-feedback"),
             (dict(topk=2.0, error_feedback=True), r"^--diloco\.topk must be a density in \(0, 1\]"),
             (dict(topk=0.03, error_feedback=True, topk_chunk=3), r"^--diloco\.topk-chunk must divide 65536")]
    for fields, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            validate(Config(diloco=DiLoCoConfig(**fields)))
    validate(Config(diloco=DiLoCoConfig(topk=0.03, error_feedback=True, quantize="int2")))


@pytest.mark.slow  # trains twice; test_benchmarks runs Muon inside the trainer
def test_muon_inside_is_any_optax_optimizer():
    """The core takes any optax optimizer: Muon on the stacked (layer, out, in) matrices, AdamW
    on the rest (MuLoCo's recipe), with a 2-bit top-k sync."""
    from eqx_diloco.lm.optimizers import muon_dimensions

    muon = optax.contrib.muon(0.02, adam_learning_rate=3e-3, muon_weight_dimension_numbers=muon_dimensions)
    diloco = _core(inner_optimizer=muon)
    model = StackedMLP(key=jax.random.key(0))
    state = diloco.init(model)
    dims = muon_dimensions(eqx.filter(model, eqx.is_array))  # what one replica's optimizer sees
    # The stacked block weights (layer, out, in) are Muon's; biases, embedding and head AdamW's.
    assert dims.blocks.linear.weight == optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    assert dims.blocks.linear.bias is None and dims.embed.weight is None and dims.head.weight is None
    losses = []
    for step in range(30):
        state, metrics = diloco.step(state, make_batch(step, 2))
        losses.append(float(jnp.mean(metrics["loss"])))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


@pytest.mark.slow  # compiles two exchanges; the fast tier keeps the numpy references of both
def test_sent_values_follow_the_exchange_chunks():
    """What eager's mailbox records as a replica's own share is what its exchange sends: under
    two-phase a top-k per chunk of ceil(n / R) values, under gather one of the whole vector."""
    from eqx_diloco._exchange import chunk_size, sent_values

    n, R = 1000, 4
    codec = Codec("int2", topk=0.02, chunk=65536)
    x = np.array(jax.random.normal(jax.random.key(11), (n,)), np.float32)
    c = chunk_size(n, codec, R)
    padded = np.zeros(R * c, np.float32)
    padded[:n] = x
    per_chunk = np.concatenate([np_topk_round_trip(padded[i * c : (i + 1) * c], codec) for i in range(R)])[:n]
    np.testing.assert_allclose(np.asarray(sent_values(jnp.asarray(x), codec, R, "two_phase")), per_chunk, rtol=1e-6)
    whole = np_topk_round_trip(x, codec)
    np.testing.assert_allclose(np.asarray(sent_values(jnp.asarray(x), codec, R, "gather")), whole, rtol=1e-6)
    assert not np.allclose(per_chunk, whole)  # the two differ: the mailbox must know which


def test_error_feedback_decay_is_sparselocos_accumulator_against_numpy():
    """With `error_feedback=beta`, each sync sends topk(delta + beta e) and keeps the rest as e
    (SparseLoCo's accumulator); over two syncs the residuals equal a numpy run of that rule."""
    beta, R = 0.5, 2
    diloco = _core(error_feedback=beta, sync_period=2)
    codec = diloco.wire
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    group = diloco.groups[0]
    carried = np.zeros((R, sum(x.size for x in jax.tree.leaves(group.get(state.global_params)))), np.float32)
    for sync in range(2):
        for step in range(2):
            state, _ = diloco.inner_step(state, make_batch(2 * sync + step, R))
        anchor = np.concatenate([np.ravel(x) for x in group.get(jax.device_get(state.global_params))])
        replicas = [np.concatenate([np.ravel(x[r]) for x in group.get(jax.device_get(state.params), layer_axis=1)])
                    for r in range(R)]
        state, _ = diloco.outer.sync(state, 0)
        got = np.stack([np.concatenate([np.ravel(e[r]) for e in jax.device_get(state.residuals[0])])
                        for r in range(R)])
        for r in range(R):
            sent = anchor - replicas[r] + np.float32(beta) * carried[r]
            np.testing.assert_allclose(got[r], sent - np_topk_round_trip(sent, codec), atol=1e-6)
        assert np.abs(got).max() > 0
        carried = got


@pytest.mark.parametrize("value", [0.0, 1.5, -0.5])
def test_an_error_feedback_decay_outside_0_1_is_refused_with_one_line(value):
    with pytest.raises(ConfigError, match=re.escape(f"error_feedback must be True, False or a decay in (0, 1] "
                                                    f"(got {value})")) as e:
        _core(error_feedback=value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("diloco", "message"), [
    (dict(error_feedback_decay=0.9, quantize="int2"),
     "--diloco.error-feedback-decay 0.9 needs --diloco.error-feedback (it decays its residual)"),
    (dict(error_feedback_decay=1.5, quantize="int2", error_feedback=True),
     "--diloco.error-feedback-decay must be in (0, 1] (got 1.5)"),
    (dict(error_feedback_decay=0.0, quantize="int2", error_feedback=True),
     "--diloco.error-feedback-decay must be in (0, 1] (got 0.0)"),
])
def test_cli_refuses_a_bad_error_feedback_decay_with_one_line(diloco, message):
    from eqx_diloco.lm.config import Config, DiLoCoConfig, validate

    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        validate(Config(diloco=DiLoCoConfig(**diloco)))
    validate(Config(diloco=DiLoCoConfig(error_feedback_decay=0.95, error_feedback=True, quantize="int2")))
