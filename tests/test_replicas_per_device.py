"""K replicas per device (`replicas_per_device`): R replicas on R / K mesh rows, vmapped inside each.

The placement of replicas on devices must not change what is computed: every test runs the
same training with K = 1 (one device per replica) and with K > 1, and compares losses, the
global model and the state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from custom_model import StackedMLP, loss_fn, make_batch
from jax.sharding import PartitionSpec

from eqx_diloco import Checkpointer, ConfigError, DiLoCo
from eqx_diloco._exchange import exchange_sum
from eqx_diloco._mesh import build_meshes
from util import slow_except

R = 4


def _core(K: int | None, **overrides) -> DiLoCo:
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=R, sync_period=4,
                  inner_optimizer=optax.adamw(3e-3), replicas_per_device=K, comm_device="off")
    return DiLoCo(**{**kwargs, **overrides})


def _train(diloco: DiLoCo, steps: int, state=None, start: int = 0):
    state = diloco.init(StackedMLP(key=jax.random.key(0))) if state is None else state
    losses = []
    for t in range(start, start + steps):
        state, metrics = diloco.step(state, make_batch(t, R))
        losses.append(np.asarray(metrics["loss"]))
    return state, np.stack(losses)


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize(
    "overrides,tolerance",
    [
        (dict(), 1e-5),
        pytest.param(dict(num_fragments=2, overlap_steps=1, alpha=0.5), 1e-5, marks=pytest.mark.slow),  # tau = 1
        (dict(quantize="int4", error_feedback=True), 1e-3),  # two-phase exchange at R = 4
        pytest.param(dict(quantize="int4", error_feedback=True, exchange="gather"), 1e-3, marks=pytest.mark.slow),
        pytest.param(dict(outer_overlap="eager", quantize="int8", error_feedback=True), 1e-3, marks=pytest.mark.slow),
        pytest.param(dict(algorithm="ddp"), 1e-5, marks=pytest.mark.slow),
    ],
    ids=["diloco", "streaming-tau1", "int4-ef-two-phase", "int4-ef-gather", "eager-int8", "ddp"],
)
def test_r_replicas_on_one_device_equal_r_replicas_on_r_devices(overrides, tolerance):
    results = {}
    for K in (1, 4):
        diloco = _core(K, **overrides)
        assert diloco.mesh.shape["diloco"] == R // K and diloco.replicas_per_device == K
        state, losses = _train(diloco, 12)
        state = diloco.finish(state)
        results[K] = losses, jax.tree.leaves(diloco.global_model(state)), diloco.sent_bytes_at(7)
    losses, model, sent = results[1]
    for K in (4,):
        assert _relative(results[K][0], losses) <= tolerance, K
        for got, want in zip(results[K][1], model):
            assert _relative(got, want) <= tolerance, K
        assert results[K][2] == sent  # bytes are counted per replica, wherever it lives
    assert np.all(np.isfinite(losses)) and losses[-1].mean() < losses[0].mean()


@pytest.mark.slow  # three trainings of the small model
def test_a_checkpoint_resumes_onto_another_replicas_per_device(tmp_path):
    overrides = dict(num_fragments=2, overlap_steps=1, quantize="int8", error_feedback=True)
    reference = _core(1, **overrides)
    expected, expected_losses = _train(reference, 12)
    expected = jax.tree.leaves(reference.global_model(reference.finish(expected)))

    first = _core(1, **overrides)
    state, _ = _train(first, 6)
    checkpointer = Checkpointer(tmp_path / "ckpt", every=1, keep=2)
    first.save(checkpointer, state)
    checkpointer.wait()

    second = _core(4, **overrides)
    state = second.restore(Checkpointer(tmp_path / "ckpt", every=1, keep=2), StackedMLP(key=jax.random.key(0)))
    assert int(state.step) == 6
    state, losses = _train(second, 6, state, start=6)
    got = jax.tree.leaves(second.global_model(second.finish(state)))
    assert _relative(losses, expected_losses[6:]) <= 1e-3
    for a, b in zip(got, expected):
        assert _relative(a, b) <= 1e-3


@pytest.mark.parametrize("fmt,method", slow_except([("none", "psum"), ("int4", "gather"), ("int4", "two_phase"),
                                                     ("e3m0", "two_phase"), ("none", "two_phase")],
                                                    fast=[("int4", "gather"), ("int4", "two_phase")]))
def test_exchange_sum_of_local_rows_equals_one_row_per_device(fmt, method):
    n = 300  # not a multiple of the block size: the two-phase chunks are padded
    scale = jnp.arange(1, R + 1, dtype=jnp.float32)[:, None]
    values = jax.random.normal(jax.random.key(3), (R, n), jnp.float32) * scale
    if method != "psum":  # magnitudes 1e8 apart make float32 addition order-sensitive: a wrong order shows.
        # big = 7 * 2**24 decodes exactly in every format (int4 scale 2**24, e3m0 scale big), so the sums do
        # not depend on whether the compiler fuses a decode's multiply into the add (it may, at any -O level).
        big = float(7 * 2**24)
        values = values.at[:, :4].set(jnp.array([[big, 1, 1, 1], [-big, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]))
    weights = jnp.array([1.0, 1.0, 1.0, 0.0], jnp.float32)  # replica 3 left out
    outputs = {}
    for K in (1, 2, 4):
        mesh, _ = build_meshes(R, replicas_per_device=K)

        def body(x, w):
            total, own_error = exchange_sum(x, w, fmt, method=method)
            return total, own_error

        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("diloco"), PartitionSpec("diloco")),
                                    out_specs=(PartitionSpec(), PartitionSpec("diloco"))))
        outputs[K] = [np.asarray(x) for x in run(values, weights)]
    for K in (2, 4):
        if method == "psum":  # the local sum comes first: float32 order may differ
            np.testing.assert_allclose(outputs[K][0], outputs[1][0], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(outputs[K][1], outputs[1][1], rtol=1e-6, atol=1e-6)
        else:  # every sum in replica order, every chunk with its owner: bit for bit
            np.testing.assert_array_equal(outputs[K][0], outputs[1][0])
            # An own error (value - decoded) may be one fused multiply-add or two roundings, as the compiler
            # chooses per program: equal to float32 rounding (an error given to the wrong replica is O(1)).
            np.testing.assert_allclose(outputs[K][1], outputs[1][1], rtol=0, atol=1e-6)
    if fmt == "none":
        expected = (values * weights[:, None]).sum(0)
        np.testing.assert_allclose(outputs[1][0], expected, rtol=1e-5, atol=1e-5)


def test_replicas_are_packed_only_when_devices_run_short():
    have = len(jax.devices())  # tests/conftest.py gives this process 12 CPU devices
    mesh, _ = build_meshes(4)
    assert mesh.shape["diloco"] == 4  # devices enough: one replica each
    mesh, _ = build_meshes(2 * have)
    assert mesh.shape["diloco"] == have  # twice as many replicas as devices: two each
    # An automatic communication device gives way before replicas are packed for it.
    mesh, comm_mesh = build_meshes(have, comm_device="auto")
    assert mesh.shape["diloco"] == have and comm_mesh is None
    mesh, comm_mesh = build_meshes(have // 2, comm_device="auto")
    assert mesh.shape["diloco"] == have // 2 and comm_mesh is not None
    with pytest.raises(ConfigError, match=r"^replicas_per_device must divide the replicas of each process"):
        build_meshes(4, replicas_per_device=3)
    with pytest.raises(ConfigError, match=r"needs 24 devices per process, process 0 has 12 \(cpu\); on CPU call"):
        build_meshes(2 * have, replicas_per_device=1)


def test_too_few_accelerator_devices_say_how_to_share_them():
    from eqx_diloco._mesh import too_few_devices

    error = str(too_few_devices(4, process=0, have=1, platform="gpu", comm=False, local_replicas=2))
    assert error == ("(num_replicas / replicas_per_device) x (data_parallel) needs 4 devices per process, process 0 "
                     "has 1 (gpu); lower data_parallel or raise replicas_per_device (a divisor of 2) so that the "
                     "replicas share the 1 gpu devices")
    from eqx_diloco.lm.config import flag_names

    assert "--mesh.replicas-per-device" in flag_names(error) and "--mesh.data" in flag_names(error)
    # With every replica on one device already, only fewer devices per replica can help.
    packed = str(too_few_devices(2, process=0, have=1, platform="gpu", comm=False, local_replicas=2, per_device=2))
    assert packed.endswith("; lower data_parallel to fit the 1 gpu devices")


def test_with_one_replica_nothing_counts_as_sent():
    diloco = _core(None, num_replicas=1)
    diloco.init(StackedMLP(key=jax.random.key(0)))
    assert diloco.sent_bytes_at(3) == 0 and diloco.ddp_step_bytes == 0


def test_cli_flag_rules_name_the_flag():
    from eqx_diloco.lm._layout import devices_needed
    from eqx_diloco.lm.config import Config, DiLoCoConfig, ElasticConfig, MeshConfig, validate

    with pytest.raises(ConfigError, match=r"^--mesh\.replicas-per-device must divide --diloco\.num-replicas "
                                          r"\(got K=3, R=4\)$"):
        validate(Config(diloco=DiLoCoConfig(num_replicas=4), mesh=MeshConfig(replicas_per_device=3)))
    with pytest.raises(ConfigError, match=r"^--mesh\.replicas-per-device must be >= 0"):
        validate(Config(mesh=MeshConfig(replicas_per_device=-1)))
    with pytest.raises(ConfigError, match=r"^--elastic\.enabled needs one replica per process and device"):
        validate(Config(mesh=MeshConfig(replicas_per_device=2), elastic=ElasticConfig(enabled=True)))
    # CPU runs simulate one device per row of K replicas.
    assert devices_needed(Config(diloco=DiLoCoConfig(num_replicas=4), mesh=MeshConfig(replicas_per_device=2))) == 2
    assert devices_needed(Config(diloco=DiLoCoConfig(num_replicas=4))) == 4
