"""`DiLoCo` itself, on a small model that is not from `models/`, against plain references:
Streaming DiLoCo written out (`streaming_reference`), plain optax loops, and the Nesterov formula.
The trainer's own equivalence tests (marked slow) repeat a few of these through the CLI's path."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from custom_model import DEPTH, StackedMLP, loss_fn, make_batch
from eqx_diloco import DiLoCo
from eqx_diloco._fragments import stack_flags
from streaming_reference import reference_streaming

LR, MU = 0.7, 0.9
MODEL = StackedMLP(key=jax.random.key(0))
PARAMS = eqx.filter(MODEL, eqx.is_inexact_array)


def _grad_fn(p, batch):
    (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(eqx.combine(p, MODEL), batch, None)
    return loss, grads


def _run(diloco, steps, batches, model=MODEL):
    state = diloco.init(model)
    losses = []
    for step in range(steps):
        state, metrics = diloco.step(state, batches(step))
        losses.append(np.asarray(metrics["loss"]))
    return np.stack(losses), state


def _assert_leaves_close(got, want, **tolerance):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tolerance)


@pytest.mark.parametrize(
    "streaming",
    [
        dict(num_fragments=1, sync_period=3),  # plain DiLoCo
        dict(num_fragments=3, sync_period=6),  # streaming, immediate replacement
        dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5, fragment_pattern="sequential"),
        dict(num_fragments=2, sync_period=4, overlap_steps=1, nesterov=False),
        dict(num_fragments=3, sync_period=9, overlap_steps=2, alpha=0.25, num_replicas=4),
    ],
    ids=["P1", "P3", "P3-tau1-alpha.5-seq", "P2-tau1-sgdm", "R4-P3-tau2"],
)
def test_streaming_diloco_matches_the_plain_reference(streaming):
    streaming = dict(streaming)
    nesterov = streaming.pop("nesterov", True)
    R = streaming.setdefault("num_replicas", 2)
    steps = 2 * streaming["sync_period"] + 3  # two rounds of every fragment, then part of a third
    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, inner_optimizer=optax.adamw(3e-3),
                    outer_optimizer=optax.sgd(LR, momentum=MU, nesterov=nesterov), **streaming)
    losses, state = _run(diloco, steps, lambda s: make_batch(s, R))
    in_stack, _ = stack_flags(PARAMS, lambda m: m.blocks)
    ref_losses, ref_theta, ref_global = reference_streaming(
        PARAMS, inner_opt=optax.adamw(3e-3), grad_fn=_grad_fn, batches=lambda s: make_batch(s, R), R=R,
        H=streaming["sync_period"], P=streaming["num_fragments"], tau=streaming.get("overlap_steps", 0),
        alpha=streaming.get("alpha", 0.0), lr=LR, mu=MU, nesterov=nesterov, depth=DEPTH, in_stack=in_stack,
        steps=steps, pattern=streaming.get("fragment_pattern", "strided"),
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
    state, _ = diloco.settle(state)  # a merge still in flight changes no value it has not applied
    _assert_leaves_close(state.params, ref_theta, rtol=1e-4, atol=1e-5)
    _assert_leaves_close(state.global_params, ref_global, rtol=1e-4, atol=1e-5)


def test_one_replica_every_step_with_lr_1_equals_the_data_parallel_baseline():
    """R = 1, H = 1, plain outer SGD with lr 1: each outer step replaces theta_g by the replica."""
    common = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=1, sync_period=1,
                  inner_optimizer=optax.adam(1e-2))
    diloco_losses, diloco_state = _run(DiLoCo(**common, outer_optimizer=optax.sgd(1.0)), 8, lambda s: make_batch(s, 1))
    ddp_losses, ddp_state = _run(DiLoCo(**common, algorithm="ddp"), 8, lambda s: make_batch(s, 1))
    np.testing.assert_allclose(diloco_losses, ddp_losses, rtol=1e-5)
    _assert_leaves_close(diloco_state.global_params, jax.tree.map(lambda x: x[0], ddp_state.params),
                         rtol=1e-5, atol=1e-6)
    assert diloco_losses[-1, 0] < diloco_losses[0, 0]


def test_ddp_with_r_replicas_equals_one_replica_with_r_times_the_batch():
    common = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, sync_period=1, inner_optimizer=optax.adam(1e-2),
                  algorithm="ddp")
    many = DiLoCo(**common, num_replicas=2)
    one = DiLoCo(**common, num_replicas=1)
    many_losses, many_state = _run(many, 4, lambda s: make_batch(s, 2, batch_size=8))
    one_losses, one_state = _run(one, 4, lambda s: jax.tree.map(lambda x: x.reshape(1, 16, *x.shape[2:]),
                                                               make_batch(s, 2, batch_size=8)))
    np.testing.assert_allclose(many_losses.mean(axis=1), one_losses[:, 0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(many_state.params), jax.tree.leaves(one_state.params), strict=True):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(a[0], a[1])  # ddp keeps replicas identical


def test_the_data_axis_splits_the_batch_without_changing_the_math():
    common = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=6, num_fragments=3,
                  inner_optimizer=optax.adam(1e-2))
    flat_losses, flat = _run(DiLoCo(**common), 10, lambda s: make_batch(s, 2))
    grid_losses, grid = _run(DiLoCo(**common, data_parallel=2), 10, lambda s: make_batch(s, 2))
    np.testing.assert_allclose(flat_losses, grid_losses, rtol=1e-5)
    _assert_leaves_close(flat.global_params, grid.global_params, rtol=1e-5, atol=1e-6)


def test_a_sync_applies_nesterov_sgd_to_the_mean_outer_gradient_and_replaces_the_replicas():
    R, H = 4, 3
    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=R, sync_period=H,
                    inner_optimizer=optax.adam(1e-2), outer_optimizer=optax.sgd(LR, momentum=MU, nesterov=True))
    state = diloco.init(MODEL)
    before = jax.device_get(state.global_params)
    replicas = None
    for step in range(H):
        state, metrics = diloco.step(state, make_batch(step, R), before_sync=lambda s: jax.device_get(s.params))
        replicas = metrics["before_sync"] if metrics["before_sync"] is not None else replicas
    assert metrics["synced_fragment"] == 0 and replicas is not None
    delta = jax.tree.map(lambda g, r: g - np.mean(r, axis=0), before, replicas)
    opt = optax.sgd(LR, momentum=MU, nesterov=True)
    leaves = jax.tree.leaves(before)
    updates, _ = opt.update(jax.tree.leaves(delta), opt.init(leaves), leaves)
    _assert_leaves_close(state.global_params, optax.apply_updates(leaves, updates), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.global_params), strict=True):
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))  # alpha = 0: replicas replaced


def _predicates_computed_in_fusions(text: str) -> list[str]:
    """The scalar predicates that a fused computation of compiled HLO `text` computes itself and then
    broadcasts over an array: unoptimised code (the sync programs, on CPU) computes them again for every
    element of it."""
    import re

    found = []
    for computation in text.split("\n\n"):
        ops = dict(re.findall(r"%([\w.-]+) = \S+ ([\w-]+)\(", computation))
        broadcast = re.findall(r"= pred\[[\d,]+\]\{[^}]*\} broadcast\(%([\w.-]+)\), dimensions=\{\}", computation)
        found += [name for name in broadcast if ops.get(name) not in ("parameter", "constant", "bitcast")]
    return found


@pytest.mark.parametrize("flags, programs", [
    (dict(on_nonfinite="stop"), {"sync_and_merge": 0}),
    (dict(on_nonfinite="skip"), {"sync_and_merge": 0}),
    (dict(num_fragments=3, sync_period=6, overlap_steps=1), {"sync": 1, "sync_and_merge": 1}),
    (dict(outer_overlap="delayed"), {"_outer": 0, "_drain": 0}),
    (dict(outer_overlap="eager"), {"_outer": 0, "_drain": 0}),
], ids=["stop", "skip", "streaming", "delayed", "eager"])
def test_a_sync_applies_or_drops_its_outer_step_in_one_conditional(flags, programs):
    """Whether the outer step is applied is one scalar flag, and the values are kept or replaced by one
    conditional (`keep_if`), not by a select per element whose fusion recomputes the flag's chain of
    per-leaf finite checks for each element, as the sync programs' unoptimised code did."""
    from eqx_diloco._rare_programs import rare_program_options

    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, inner_optimizer=optax.adam(1e-2),
                    sync_compiler_options=rare_program_options(1, backend="cpu"), **{"sync_period": 4, **flags})
    state = diloco.init(MODEL)
    for name, group in programs.items():
        program = getattr(diloco.overlapped, name)[group] if diloco.outer is None else diloco.outer._fns[name][group]
        text = program.lower(state).compile().as_text()
        assert text.count(" conditional(") >= 1, name
        assert not _predicates_computed_in_fusions(text), name


def test_keep_if_returns_one_tree_or_the_other_whole():
    from eqx_diloco._tree import keep_if

    new = {"a": jax.numpy.array([1.0, jax.numpy.nan]), "b": (jax.numpy.arange(3),)}
    old = {"a": jax.numpy.array([2.0, 3.0]), "b": (jax.numpy.zeros(3, jax.numpy.int32),)}
    chosen = jax.jit(keep_if)
    for pred, want in [(True, new), (False, old)]:
        got = chosen(jax.numpy.bool_(pred), new, old)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("quantize, on_nonfinite, want", [
    ("none", "stop", ["all-reduce"]), ("none", "skip", ["all-reduce"]),
    ("int4", "stop", ["all-gather", "all-gather", "all-reduce"]),
])
def test_a_blocking_sync_crosses_the_replicas_in_as_few_collectives_as_its_exchange_needs(quantize, on_nonfinite, want):
    """Whether every replica's outer gradient was finite is counted inside the exchange, in one collective
    with the values' psum (or the quantized exchange's count): across processes each collective costs a
    round trip, so a float32 sync is one all-reduce, not one for the values and one for the flags."""
    import re

    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=3,
                    inner_optimizer=optax.adam(1e-2), quantize=quantize, on_nonfinite=on_nonfinite)
    state = diloco.init(MODEL)
    text = diloco.outer._fns["sync_and_merge"][0].lower(state).compile().as_text()
    collectives = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", text)
    assert sorted(collectives) == want
