"""Bring your own model: a stacked MLP regressor (not from `models/`) through the public core API."""

import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from eqx_diloco import ConfigError, DiLoCo

from custom_model import DEPTH, IN_DIM, WIDTH, StackedMLP, loss_fn, make_batch
from util import resume_through_a_checkpoint


def _replicated_copies_equal(tree) -> bool:
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        if any(not np.array_equal(shards[0], s) for s in shards[1:]):
            return False
    return True


@pytest.mark.slow
def test_streaming_int4_error_feedback_trains_a_custom_model():
    diloco = DiLoCo(
        loss_fn=loss_fn,
        layers=lambda model: model.blocks,
        num_replicas=2,
        sync_period=6,
        inner_optimizer=optax.adamw(3e-3),
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        num_fragments=3,
        overlap_steps=1,
        alpha=0.5,
        quantize="int4",
        error_feedback=True,
    )
    model = StackedMLP(key=jax.random.key(0))
    state = diloco.init(model)
    losses, synced = [], []
    for step in range(36):
        state, metrics = diloco.step(state, make_batch(step, 2))
        assert metrics["loss"].shape == (2,) and metrics["mse"].shape == (2,)
        losses.append(np.asarray(metrics["loss"]))
        synced.append(metrics["synced_fragment"])
    assert synced[:6] == [None, 0, None, 1, None, 2] and synced[7] == 0  # t = 2, 4, 6, 8
    assert np.mean(losses[-6:]) < 0.5 * np.mean(losses[:3])
    final = diloco.global_model(state)
    assert isinstance(final, StackedMLP)
    assert final.blocks.linear.weight.shape == (DEPTH, WIDTH, WIDTH)
    state, _ = diloco.settle(state)
    assert _replicated_copies_equal(state.global_params)
    assert _replicated_copies_equal(state.outer_states)
    # The global model has learned too: its loss on fresh data is below the initial model's.
    x, y = make_batch(999, 1)
    before, _ = loss_fn(model, (x[0], y[0]), None)
    after, _ = loss_fn(final, (x[0], y[0]), None)
    assert float(after) < 0.5 * float(before)


def test_one_replica_every_step_plain_outer_sgd_equals_a_plain_optax_loop():
    inner = optax.adam(1e-2)
    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=1, sync_period=1,
                    inner_optimizer=inner, outer_optimizer=optax.sgd(1.0))
    model = StackedMLP(key=jax.random.key(3))
    state = diloco.init(model)
    core_losses = []
    for step in range(12):
        state, metrics = diloco.step(state, make_batch(step, 1))
        core_losses.append(float(metrics["loss"][0]))

    @eqx.filter_jit
    def plain_step(model, opt_state, batch):
        (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, batch, None)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction computes float ** int32
            updates, opt_state = inner.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = inner.init(eqx.filter(model, eqx.is_inexact_array))
    plain_losses = []
    for step in range(12):
        x, y = make_batch(step, 1)
        model, opt_state, loss = plain_step(model, opt_state, (x[0], y[0]))
        plain_losses.append(float(loss))
    np.testing.assert_allclose(core_losses, plain_losses, rtol=1e-5)
    final = diloco.global_model(state)
    for a, b in zip(jax.tree.leaves(eqx.filter(final, eqx.is_array)), jax.tree.leaves(eqx.filter(model, eqx.is_array))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_model_without_layer_stack_trains_with_one_fragment():
    mlp = eqx.nn.MLP(IN_DIM, "scalar", 8, 2, key=jax.random.key(0))
    diloco = DiLoCo(loss_fn=loss_fn, layers=None, num_replicas=2, sync_period=2, inner_optimizer=optax.adam(1e-2))
    state = diloco.init(mlp)
    for step in range(4):
        state, metrics = diloco.step(state, make_batch(step, 2))
    assert np.all(np.isfinite(np.asarray(metrics["loss"])))
    assert isinstance(diloco.global_model(state), eqx.nn.MLP)


def _core(**overrides):
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=6,
                  inner_optimizer=optax.adam(1e-2))
    return DiLoCo(**{**kwargs, **overrides})


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(layers=lambda m: (m.blocks, m.embed)), "layers= must select arrays with a common leading"),
        (dict(layers=lambda m: m.nope), "layers= does not select"),
        (dict(num_fragments=4, sync_period=12), "num_fragments - 1 = 3 must divide the 4 stacked layers"),
        (dict(layers=None, num_fragments=3), "layers=None allows only 1"),
    ],
)
def test_bad_layers_are_refused_with_the_argument_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _core(**overrides).init(StackedMLP(key=jax.random.key(0)))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(num_replicas=0), "num_replicas must be an int >= 1"),
        (dict(num_fragments=4), "sync_period must be divisible by num_fragments"),
        (dict(num_fragments=3, overlap_steps=2), "overlap_steps must be < sync_period / num_fragments"),
        (dict(alpha=1.5), "alpha must be in [0, 1]"),
        (dict(quantize="int3"), "quantize must be one of"),
        (dict(error_feedback=True), "error_feedback needs a lossy quantize format"),
        (dict(algorithm="ddp", num_fragments=3), "num_fragments applies to algorithm diloco only"),
        (dict(num_replicas=50, replicas_per_device=1), "eqx_diloco.use_cpu_devices(50)"),
        (dict(num_replicas=4, replicas_per_device=3), "replicas_per_device must divide num_replicas (got K=3, R=4)"),
        (dict(replicas_per_device=0), "replicas_per_device must be an int >= 1 or None"),
    ],
)
def test_bad_arguments_are_refused_with_the_argument_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _core(**overrides)


def test_a_model_of_another_shape_is_refused():
    diloco = _core()
    diloco.init(StackedMLP(key=jax.random.key(0)))
    with pytest.raises(ConfigError, match="another structure or shape"):
        diloco.init(eqx.nn.MLP(IN_DIM, "scalar", 8, 2, key=jax.random.key(0)))


@pytest.mark.slow  # two runs and an Orbax round trip (about 4 s)
def test_checkpoint_through_the_core_resumes_bit_exactly_with_a_sync_in_flight(tmp_path):
    make = lambda: _core(num_fragments=3, overlap_steps=1, alpha=0.5, quantize="int8", error_feedback=True)  # noqa: E731
    model = StackedMLP(key=jax.random.key(0))

    reference = make()
    state = reference.init(model)
    for step in range(14):
        state, _ = reference.step(state, make_batch(step, 2))
    expected = jax.device_get(reference.settle(state)[0])

    first = make()
    state = first.init(model)
    for step in range(8):  # step 8 launched fragment 0's sync; its merge is due after step 9
        state, metrics = first.step(state, make_batch(step, 2))
    assert metrics["synced_fragment"] == 0
    second, restored = resume_through_a_checkpoint(first, state, make, model, tmp_path / "ckpt",
                                                   metadata={"note": "custom model"})
    assert int(restored.step) == 8
    state = restored
    for step in range(8, 14):
        state, _ = second.step(state, make_batch(step, 2))
    resumed = jax.device_get(second.settle(state)[0])
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_core_imports_no_bundled_model_and_no_application_package():
    code = (
        "import sys, eqx_diloco; [getattr(eqx_diloco, n) for n in eqx_diloco.__all__];"
        "app = ('models', 'eqx_diloco.lm', 'tyro', 'rich', 'matplotlib', 'tensorboardX');"
        "bad = [m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in app)];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_readme_library_example_runs_as_written(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    match = re.search(r"<!-- library-example -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md lost its library example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    # It learns: the global model's held-out error is at most half that of predicting 0.
    printed = re.search(r"held-out MSE ([0-9.]+) \(predicting 0: ([0-9.]+)\)", result.stdout)
    assert printed, f"the example no longer prints its held-out error: {result.stdout[-2000:]}"
    mse, baseline = float(printed.group(1)), float(printed.group(2))
    assert baseline > 0.3 and mse <= 0.5 * baseline, (mse, baseline)


@pytest.mark.parametrize(("overlap_steps", "comm_device"), [(0, "auto"), (1, "auto"), (1, "off")],
                         ids=["tau0", "tau1", "tau1-no-comm-device"])
def test_syncs_compiled_ahead_compile_nothing_at_their_first_round(overlap_steps, comm_device):
    """`compile_outer_ahead` compiles (or loads) every fragment's sync programs before training, so
    the step that reaches a fragment's first sync lowers and compiles nothing."""
    lowered = []

    def listen(event, duration, **kwargs):
        if event.endswith("jaxpr_to_mlir_module_duration"):  # one per program lowered
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        diloco = DiLoCo(loss_fn=loss_fn, layers=lambda model: model.blocks, num_replicas=2, sync_period=4,
                        inner_optimizer=optax.adamw(3e-3), outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
                        num_fragments=2, overlap_steps=overlap_steps, alpha=0.5, comm_device=comm_device)
        state = diloco.init(StackedMLP(key=jax.random.key(0)))
        state, _ = diloco.step(state, make_batch(0, 2))  # the step program, compiled at its first call
        diloco.compile_outer_ahead(state)
        lowered.clear()
        for step in range(1, 8):  # each fragment's first sync (t = 2 and 4) and, with tau = 1, its merge
            state, metrics = diloco.step(state, make_batch(step, 2))
        state, _ = diloco.settle(state)
        jax.block_until_ready(state)
        assert lowered == [], f"{len(lowered)} programs were lowered after compile_outer_ahead"
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("shape", [(2, 3), (4, 1, 3, 1)], ids=["diloco-data", "four-axes"])
def test_the_collective_that_connects_a_syncs_processes_runs_over_diloco_only(shape):
    """`connect_sync_processes`' psum groups the devices as a sync's own psum over `diloco` does (one
    process here: the trainer runs it only across processes, where it also waits for the others)."""
    from jax.sharding import Mesh

    from eqx_diloco._compile_ahead import _count_over_diloco, connect_sync_processes
    from eqx_diloco._mesh import AXES

    axes = AXES[:len(shape)]
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)
    counts = _count_over_diloco(mesh, None)
    assert counts.shape == shape and counts.sharding.spec == jax.sharding.PartitionSpec(*axes)
    np.testing.assert_array_equal(np.asarray(counts), np.full(shape, shape[0]))
    connect_sync_processes([mesh, None, mesh])  # a single process: nothing to connect, nothing run
