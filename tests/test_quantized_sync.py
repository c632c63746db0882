"""Quantized outer gradients inside the sync: bytes on the wire, lossless equivalence, error feedback."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco import quantize
from eqx_diloco.lm import Trainer
from util import read_metrics, train_losses


def _sent_bytes(make_config, fmt, **diloco):
    config = make_config(model=dict(dim=64, num_heads=2, num_layers=2), diloco=dict(quantize=fmt, **diloco),
                         train=dict(steps=4, log_every=4))
    config = dataclasses.replace(config, run_dir=config.run_dir.parent / fmt)
    Trainer(config, verbose=False).run()
    return [r for r in read_metrics(config.run_dir) if "loss" in r][-1]["sent_bytes"]


@pytest.mark.slow
def test_sent_bytes_ratios_from_metrics(make_config):
    full = _sent_bytes(make_config, "none")
    ratios = {fmt: _sent_bytes(make_config, fmt) / full for fmt in ("bf16", "fp8", "int8", "int4", "e3m0")}
    assert ratios["bf16"] == 0.5
    assert 0.25 <= ratios["fp8"] <= 0.26 and 0.25 <= ratios["int8"] <= 0.26
    assert ratios["int4"] <= 0.14 and ratios["e3m0"] <= 0.14


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["gather", "two_phase"])
def test_lossless_payload_exchange_equals_psum_in_training(make_config, monkeypatch, exchange):
    """Force format `none` through a payload exchange: same run as the psum path."""
    import eqx_diloco._outer as outer

    psum = make_config(diloco=dict(num_replicas=4, sync_period=2), train=dict(steps=6))
    Trainer(psum, verbose=False).run()
    original = outer.mean_outer_gradient
    monkeypatch.setattr(outer, "mean_outer_gradient", lambda *a, **kw: original(*a, **{**kw, "exchange": exchange}))
    gathered = dataclasses.replace(psum, run_dir=psum.run_dir.parent / exchange)
    trainer = Trainer(gathered, verbose=False)
    trainer.run()
    np.testing.assert_allclose(train_losses(psum.run_dir), train_losses(gathered.run_dir), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int4", "e3m0"])
def test_quantized_training_tracks_float32_and_keeps_replicas_in_step(make_config, fmt):
    base = make_config(diloco=dict(num_replicas=2, sync_period=2), train=dict(steps=8))
    Trainer(base, verbose=False).run()
    config = dataclasses.replace(base, run_dir=base.run_dir.parent / fmt,
                                 diloco=dataclasses.replace(base.diloco, quantize=fmt))
    trainer = Trainer(config, verbose=False)
    trainer.run()
    a, b = train_losses(base.run_dir), train_losses(config.run_dir)
    assert a[:2] == b[:2]  # identical before the first sync takes effect
    np.testing.assert_allclose(a, b, rtol=0.05)
    assert a != b
    for leaf in jax.tree.leaves(trainer.state.params):
        np.testing.assert_array_equal(leaf[0], leaf[1])  # replicas replaced by the same global values


@pytest.mark.slow
def test_error_feedback_keeps_the_quantization_residual(make_config):
    config = make_config(diloco=dict(num_replicas=2, sync_period=3, quantize="int4", error_feedback=True))
    trainer = Trainer(config, verbose=False)
    state, _ = trainer.initial_state()
    for step in range(3):
        state, _ = trainer.inner_step(state, jax.device_put(trainer.batches.batch(step), trainer.batch_sharding))
    g = trainer.fragmenter.get(jax.device_get(state.global_params), 0)
    r = trainer.fragmenter.get(jax.device_get(state.params), 0, layer_axis=1)
    state, _ = trainer.outer.sync(state, 0)
    for replica in range(2):
        flat = jnp.concatenate([(gv - rv[replica]).ravel() for gv, rv in zip(g, r)])
        expected = flat - quantize.decode(quantize.encode(flat, "int4"), "int4", flat.shape)
        got = jnp.concatenate([e[replica].ravel() for e in jax.device_get(state.residuals[0])])
        np.testing.assert_allclose(got, expected, atol=1e-7)
        assert float(jnp.abs(got).max()) > 0


@pytest.mark.slow
def test_wire_bytes_follow_the_collective(make_config):
    """At R = 4, int4 two-phase moves ~1/8 of the float32 ring all-reduce; the one-shot gather twice that."""
    lines = {}
    for name, diloco in {
        "f32": dict(),
        "gather": dict(quantize="int4", exchange="gather"),
        "two_phase": dict(quantize="int4", exchange="two_phase"),
    }.items():
        config = make_config(diloco=dict(num_replicas=4, sync_period=2, **diloco), train=dict(steps=4))
        config = dataclasses.replace(config, run_dir=config.run_dir.parent / name)
        trainer = Trainer(config, verbose=False)
        trainer.run()
        lines[name] = [line for line in read_metrics(config.run_dir) if "wire_bytes" in line][-1]
        n = sum(x.size for x in jax.tree.leaves(trainer.abstract_model))
        syncs = 2  # steps 2 and 4
        if name == "f32":
            assert lines[name]["wire_bytes"] == syncs * -(-2 * 3 * 4 * n // 4)  # ring all-reduce
            assert lines[name]["sent_bytes"] == syncs * 4 * n
    f32 = lines["f32"]["wire_bytes"]
    assert lines["two_phase"]["wire_bytes"] <= 0.14 * f32
    assert lines["gather"]["wire_bytes"] > 1.9 * lines["two_phase"]["wire_bytes"]
    assert lines["gather"]["sent_bytes"] <= lines["two_phase"]["sent_bytes"]  # two-phase pads to 4 chunks


@pytest.mark.slow
def test_a_non_finite_replica_leaves_no_nan_residual(make_config):
    """Error feedback + skip: a replica whose outer gradient is NaN must not store a NaN residual
    (it would re-poison that replica at every later sync of the group)."""
    config = make_config(diloco=dict(num_replicas=2, sync_period=2, quantize="int4", error_feedback=True),
                         train=dict(on_nonfinite="skip"))
    trainer = Trainer(config, verbose=False)
    state, _ = trainer.initial_state()
    for step in range(2):
        state, _ = trainer.inner_step(state, jax.device_put(trainer.batches.batch(step), trainer.batch_sharding))
    poison = jax.jit(lambda s: dataclasses.replace(s, params=jax.tree.map(lambda x: x.at[1].set(jnp.nan), s.params)))
    state, finite = trainer.outer.sync(poison(state), 0)
    assert np.asarray(finite).tolist() == [True, False]
    residuals = jax.device_get(state.residuals[0])
    assert all(np.isfinite(r).all() for r in residuals)
    assert all(np.all(r[1] == 0) for r in residuals) and any(np.abs(r[0]).max() > 0 for r in residuals)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.global_params)))
