"""`eqx_diloco.DiLoCo` called the wrong way or running into trouble: a second `finish`, the last finite
global model after `NonFiniteError`, a NaN loss with zero gradients, a loss that is not a scalar, and a
state used again after a call donated it. Each is one `eqx_diloco` error naming the rule, or works."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqx_diloco import ConfigError, DiLoCo, NonFiniteError

from custom_model import StackedMLP, loss_fn, make_batch

BAD = 1000.0  # a target value that marks a replica's batch as one its loss masks to NaN


def masked_loss(model, batch, key):
    """The MSE, but NaN for a batch whose first target is BAD: `jnp.where` gives zero gradients
    there, so only the loss says that something went wrong."""
    x, y = batch
    bad = y[0] == BAD
    pred = jax.vmap(model)(x)
    mse = jnp.mean((pred - jnp.where(bad, 0.0, y)) ** 2)
    return jnp.where(bad, jnp.nan, mse), {}


def _diloco(**overrides) -> DiLoCo:
    """2 replicas, H 4, the default outer optimizer (Nesterov momentum 0.3)."""
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=4,
                  inner_optimizer=optax.adamw(3e-3))
    return DiLoCo(**{**kwargs, **overrides})


def _bad_batch(step: int, replicas: list[int]):
    x, y = make_batch(step, 2)
    return x, y.at[jnp.array(replicas), 0].set(BAD)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_a_second_finish_changes_nothing():
    """With outer momentum, a second outer step used to move theta_g again (L12b: max 0.0026)."""
    diloco = _diloco()
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    for step in range(6):  # 6 is not a multiple of H = 4: finish syncs
        state, _ = diloco.step(state, make_batch(step, 2))
    state = diloco.finish(state)
    once = _leaves(diloco.global_model(state))
    state = diloco.finish(state)
    for a, b in zip(once, _leaves(diloco.global_model(state))):
        np.testing.assert_array_equal(a, b)


def test_the_last_finite_global_model_is_readable_after_non_finite_error():
    """L28: the state passed to `step` is donated; the error carries the state the step reached."""
    diloco = _diloco(loss_fn=masked_loss)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    for step in range(4):  # a sync after step 4
        state, _ = diloco.step(state, make_batch(step, 2))
    synced = _leaves(diloco.global_model(state))
    state, _ = diloco.step(state, _bad_batch(4, [1]))  # step 5: NaN loss in replica 1
    with pytest.raises(NonFiniteError, match=r"^non-finite loss \(or gradient\) of replica 1 at step 5; ") as error:
        diloco.step(state, make_batch(5, 2))
    for a, b in zip(synced, _leaves(diloco.global_model(error.value.state))):
        np.testing.assert_array_equal(a, b)  # theta_g of the sync after step 4, finite
    with pytest.raises(ConfigError, match=r"^global_model: this state was donated to an earlier step"):
        diloco.global_model(state)


@pytest.mark.parametrize(("policy", "bad_replicas", "raises"), [
    ("stop", [0], True), ("skip", [0], False), ("skip", [0, 1], True)])
def test_a_nan_loss_with_zero_gradients_meets_the_policy(policy, bad_replicas, raises):
    """A NaN loss whose gradients are zero left the parameters finite: training went on for ever with
    metrics["finite"] False under on_nonfinite="stop"; "skip" now stops once every replica is skipped."""
    diloco = _diloco(loss_fn=masked_loss, on_nonfinite=policy)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    state, metrics = diloco.step(state, _bad_batch(0, bad_replicas))
    assert [bool(f) for f in metrics["finite"]] == [r not in bad_replicas for r in range(2)]
    if not raises:
        for step in range(1, 6):
            state, _ = diloco.step(state, make_batch(step, 2))
        assert all(np.isfinite(x).all() for x in _leaves(diloco.global_model(state)))
        return
    rule = "of replica 0 at step 1; " if policy == "stop" else "in every replica at step 1: on_nonfinite='skip'"
    with pytest.raises(NonFiniteError, match=rf"^non-finite loss \(or gradient\) {rule}"):
        diloco.step(state, make_batch(1, 2))


def test_a_nan_loss_at_the_last_step_is_raised_by_finish():
    diloco = _diloco(loss_fn=masked_loss)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    state, _ = diloco.step(state, _bad_batch(0, [1]))
    with pytest.raises(NonFiniteError, match=r"of replica 1 at step 1; ") as error:
        diloco.finish(state)
    assert error.value.state is not None


def test_losses_unchecked_when_the_caller_checks_them():
    diloco = _diloco(loss_fn=masked_loss, check_losses=False)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    for step in range(3):
        state, metrics = diloco.step(state, _bad_batch(step, [0]))
    assert not bool(metrics["finite"][0])


def test_check_losses_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"^check_losses must be True or False, got 1$"):
        _diloco(check_losses=1)


def test_a_loss_per_example_is_refused_in_one_line():
    """L14: JAX's own `TypeError: Gradient only defined for scalar-output functions`."""
    def per_example(model, batch, key):
        x, y = batch
        return (jax.vmap(model)(x) - y) ** 2, {}

    diloco = _diloco(loss_fn=per_example)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    with pytest.raises(ConfigError) as error:  # raised while tracing: JAX adds a note on its filtered frames
        diloco.step(state, make_batch(0, 2))
    assert str(error.value) == ("loss_fn must return a scalar loss (or (loss, aux)), got a loss of shape (16,): "
                                "average it over the batch")


@pytest.mark.parametrize("call", ["step", "finish", "global_model"])
def test_a_donated_state_used_again_is_refused_in_one_line(call):
    """L16: JAX's own `RuntimeError: Array has been deleted`."""
    diloco = _diloco()
    first = diloco.init(StackedMLP(key=jax.random.key(0)))
    state, _ = diloco.step(first, make_batch(0, 2))
    state, _ = diloco.step(state, make_batch(1, 2))
    with pytest.raises(ConfigError, match=rf"^{call}: this state was donated to an earlier step, finish or save, "
                                          r"which deleted its arrays: pass the state that call returned$"):
        if call == "step":
            diloco.step(first, make_batch(2, 2))
        elif call == "finish":
            diloco.finish(first)
        else:
            diloco.global_model(first)


@pytest.mark.parametrize(("argument", "value", "message"), [
    ("num_replicas", True, "num_replicas must be an int >= 1 (got True)"),
    ("num_fragments", True, "num_fragments must be an int >= 1 (got True)"),
    ("overlap_steps", 0.5, "overlap_steps must be an int >= 0 (got 0.5)"),
    ("router_sync_period", False, "router_sync_period must be an int >= 0 (got False)"),
    ("alpha", float("nan"), "alpha must be a number in [0, 1] (got nan)"),
])
def test_a_bool_or_fraction_for_a_count_is_refused(argument, value, message):
    """L19: True counted as 1 and overlap_steps 0.5 were accepted."""
    with pytest.raises(ConfigError) as error:
        _diloco(**{argument: value})
    assert str(error.value) == message


@pytest.mark.parametrize(("every", "keep", "message"), [
    (-1, 3, "Checkpointer every must be an int >= 0 (got -1)"),
    (1, 0, "Checkpointer keep must be an int >= 1 (got 0)"),
    (True, 3, "Checkpointer every must be an int >= 0 (got True)"),
])
def test_a_checkpointer_schedule_that_cannot_be_is_refused(tmp_path, every, keep, message):
    """L22: every=-1, keep=0 were accepted."""
    from eqx_diloco import Checkpointer

    with pytest.raises(ConfigError) as error:
        Checkpointer(tmp_path / "ckpt", every=every, keep=keep)
    assert str(error.value) == message


def test_metadata_that_is_not_json_is_refused_before_the_save(tmp_path):
    """L21: a TypeError in orbax's writer thread, then `Event loop is closed` (296 lines, 7 tracebacks)."""
    from eqx_diloco import Checkpointer

    diloco = _diloco()
    checkpointer = Checkpointer(tmp_path / "ckpt", every=1, keep=2)
    state, _ = diloco.step(diloco.init(StackedMLP(key=jax.random.key(0))), make_batch(0, 2))
    with pytest.raises(ConfigError) as error:
        diloco.save(checkpointer, state, metadata={"f": object()})
    assert str(error.value) == ("metadata must be JSON: a dict or dataclass of strings, numbers, booleans, None, lists "
                                "and dicts with string keys (Object of type object is not JSON serializable)")
    state = diloco.save(checkpointer, state, metadata={"f": 1})  # the state was not donated: it saves
    checkpointer.wait()
    assert checkpointer.steps() == [1]
    checkpointer.close()


def test_a_model_without_float_arrays_is_refused():
    """L15: JAX's `ValueError: vmap wrapped function must be passed at least one argument`."""
    import equinox as eqx

    class Counts(eqx.Module):
        table: jax.Array

    with pytest.raises(ConfigError, match=r"^model has no floating-point arrays: DiLoCo trains those"):
        _diloco(layers=None).init(Counts(jnp.arange(4)))
