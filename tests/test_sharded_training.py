"""Sharded islands train as replicated ones: every test runs the same training twice on simulated
CPU devices, R = 2 replicas each on one device and R = 2 replicas each sharded over
fsdp 2 x tensor 2 (8 devices), and compares the replicas' losses and the final global model
over three rounds.

The inner optimizer is SGD with momentum: a sharded matmul sums in another order, and Adam
turns a last-bit difference in a near-zero gradient into an lr-sized step (with AdamW the
losses still agree to 2e-7 but single parameters differ by up to 5e-5 of the largest after
12 steps; with SGD everything agrees to 3e-7). `test_adamw_moments_follow_the_parameters`
covers Adam's state.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec
from sharded_util import CONFIG, R, batch, finished_model, make_core, relative, train

from eqx_diloco import Checkpointer, DiLoCo
from models.transformer import Transformer

CASES = {  # name: (DiLoCo arguments of both runs, the sharded run's own extra arguments, tolerance)
    "diloco": (dict(), dict(), 1e-5),
    # The sharded run also keeps theta_g and the outer momentum in host memory.
    "streaming-p3-tau1-host": (dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5),
                               dict(outer_state_memory="host"), 1e-5),
    "ddp": (dict(algorithm="ddp"), dict(), 1e-5),
    "eager": (dict(outer_overlap="eager"), dict(), 1e-5),
}


@pytest.mark.slow  # the fast tier trains the small model of `test_fsdp_alone_trains_like_replicated`
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_islands_train_like_replicated_ones(name):
    overrides, sharded_only, tolerance = CASES[name]
    steps = 3 * overrides.get("sync_period", 4)  # three rounds
    replicated = make_core(**overrides)
    state, losses = train(replicated, steps)
    want = finished_model(replicated, state)
    sharded = make_core(fsdp=2, tensor=2, **overrides, **sharded_only)
    assert dict(sharded.mesh.shape) == {"diloco": 2, "data": 1, "fsdp": 2, "tensor": 2}
    state, got_losses = train(sharded, steps)
    q = state.params.blocks.attn.q
    assert q.sharding.spec == PartitionSpec("diloco", None, "fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (1, 4, 16, 16)  # (R, L, d, d) / (2, 1, 2, 2)
    if sharded_only.get("outer_state_memory") == "host":
        assert {x.sharding.memory_kind for x in jax.tree.leaves((state.global_params, state.outer_states))} == \
            {"pinned_host"}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    assert relative(got_losses, losses) <= tolerance
    for got, expected in zip(finished_model(sharded, state), want):
        assert relative(got, expected) <= tolerance
    assert losses[-1].mean() < losses[0].mean()


def test_fsdp_alone_trains_like_replicated():
    """The default FSDP rule on a model not from models/: R = 2 islands of fsdp 4, three rounds."""
    from custom_model import StackedMLP, make_batch
    from custom_model import loss_fn as mse

    def run(fsdp):
        diloco = DiLoCo(loss_fn=mse, layers=lambda m: m.blocks, num_replicas=R, sync_period=2, fsdp=fsdp,
                        inner_optimizer=optax.sgd(0.05, momentum=0.9), comm_device="off")
        state = diloco.init(StackedMLP(key=jax.random.key(0)))
        losses = []
        for t in range(6):
            state, metrics = diloco.step(state, make_batch(t, R))
            losses.append(np.asarray(metrics["loss"]))
        return np.stack(losses), finished_model(diloco, state), state

    losses, want, _ = run(1)
    got_losses, got, state = run(4)
    blocks = jax.tree.leaves(state.params.blocks)
    assert any("fsdp" in tuple(x.sharding.spec) for x in blocks)
    assert relative(got_losses, losses) <= 1e-5
    assert max(relative(g, w) for g, w in zip(got, want)) <= 1e-5


@pytest.mark.slow  # three trainings
@pytest.mark.parametrize("mode", ["none", "delayed"])
def test_syncs_on_communication_devices_of_a_sharded_island(mode):
    """Overlapped syncs (tau = 1, or delayed outer steps) run on `fsdp` partner devices per island, each
    holding its compute device's shard: float32 trains like the replicated run, and (tau = 1) int4
    with error feedback like the same island syncing on its own devices."""
    overrides = dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5) if mode == "none" else \
        dict(outer_overlap="delayed")
    steps = 3 * overrides.get("sync_period", 4)  # three rounds
    replicated = make_core(**overrides)
    state, losses = train(replicated, steps)
    want = finished_model(replicated, state)
    sharded = make_core(fsdp=2, comm_device="on", **overrides)
    assert dict(sharded.comm_mesh.shape) == {"diloco": 2, "data": 1, "fsdp": 2, "tensor": 1}
    state = sharded.init(Transformer(CONFIG, key=jax.random.key(0)))
    # Where every launched exchange's results live: the communication devices, one shard on each.
    placed, programs = [], sharded.outer if mode == "none" else sharded.overlapped
    name = "launch" if mode == "none" else "sync"  # what dispatches an exchange in each mode
    launch = getattr(programs, name)

    def recording(*args):
        out = launch(*args)
        in_flight = out if mode == "none" else out[1]
        placed.extend(x.sharding for x in jax.tree.leaves(in_flight.outputs[0]))
        return out

    setattr(programs, name, recording)
    state, got_losses = train(sharded, steps, state)
    comm_devices = set(sharded.comm_mesh.devices.flat)
    assert placed and all(set(s.device_set) == comm_devices for s in placed)
    assert any("fsdp" in tuple(s.spec) for s in placed)
    assert relative(got_losses, losses) <= 1e-5
    assert max(relative(g, w) for g, w in zip(finished_model(sharded, state), want)) <= 1e-5

    if mode == "delayed":
        return  # the quantized exchange on communication devices is the same program as tau = 1's
    quantized = dict(overrides, quantize="int4", error_feedback=True)
    on_own = make_core(fsdp=2, comm_device="off", **quantized)
    own_state, own_losses = train(on_own, 12)  # two rounds
    on_comm = make_core(fsdp=2, comm_device="on", **quantized)
    comm_state, comm_losses = train(on_comm, 12)
    assert relative(comm_losses, own_losses) <= 1e-6
    for got, expected in zip(finished_model(on_comm, comm_state), finished_model(on_own, own_state)):
        assert relative(got, expected) <= 1e-6


@pytest.mark.parametrize("fmt,tolerance,more", [
    pytest.param("int4", 1e-2, {}, marks=pytest.mark.slow),
    pytest.param("int4", 1e-2, dict(exchange="two_phase"), marks=pytest.mark.slow),
    pytest.param("int8", 1e-2, dict(outer_overlap="eager"), marks=pytest.mark.slow),
], ids=["int4", "int4-two-phase", "int8-eager"])
def test_quantized_sharded_islands_train_close_to_replicated(fmt, tolerance, more):
    """The scales are per block of a device's shard, so the rounding differs from the replicated
    run's (`test_quantized_sync_sends_each_devices_own_shard` checks the exchange exactly)."""
    overrides = dict(quantize=fmt, error_feedback=True, **more)
    replicated = make_core(**overrides)
    state, losses = train(replicated, 12)
    sharded = make_core(fsdp=2, tensor=2, **overrides)
    sharded_state, sharded_losses = train(sharded, 12)
    assert relative(sharded_losses, losses) <= tolerance
    assert np.all(np.isfinite(sharded_losses)) and sharded_losses[-1].mean() < sharded_losses[0].mean()


@pytest.mark.slow  # two trainings and two restores
def test_a_checkpoint_restores_onto_another_island_layout(tmp_path):
    # Saved from an island with its outer state in host memory: restored into device memory on another
    # layout, and into host memory again on its own.
    overrides = dict(quantize="int8", error_feedback=True)
    host = dict(outer_state_memory="host")
    reference = make_core(fsdp=2, tensor=2, **overrides, **host)
    state, _ = train(reference, 12)
    want = finished_model(reference, state)
    first = make_core(fsdp=2, tensor=2, **overrides, **host)
    state, _ = train(first, 6)
    checkpointer = Checkpointer(tmp_path / "ckpt", every=1, keep=2)
    state = first.save(checkpointer, state, force=True)
    checkpointer.wait()
    saved = [np.asarray(x) for x in jax.tree.leaves(state)]
    # Onto fsdp 4: every array (residuals and optimizer moments included) arrives resharded, intact.
    other = make_core(fsdp=4, **overrides)
    restored = other.restore(Checkpointer(tmp_path / "ckpt", every=1, keep=2), Transformer(CONFIG, key=jax.random.key(1)))
    for got, want_leaf, sharding in zip(jax.tree.leaves(restored), saved, jax.tree.leaves(other.shardings)):
        np.testing.assert_array_equal(np.asarray(got), want_leaf)
        assert got.sharding == sharding
    assert restored.params.blocks.attn.q.sharding.spec == PartitionSpec("diloco", None, "fsdp")
    _, losses = train(other, 6, restored, start=6)
    assert np.all(np.isfinite(losses))
    # Onto the layout it was saved from: the run goes on exactly as if never stopped.
    again = make_core(fsdp=2, tensor=2, **overrides, **host)
    state = again.restore(Checkpointer(tmp_path / "ckpt", every=1, keep=2), Transformer(CONFIG, key=jax.random.key(1)))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.global_params)} == {"pinned_host"}
    state, _ = train(again, 6, state, start=6)
    for got, expected in zip(finished_model(again, state), want):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.slow  # an MoE model trained twice
def test_moe_experts_split_over_tensor_train_like_replicated():
    config = dataclasses.replace(CONFIG, kind="moe", num_experts=4, top_k=2)

    def run(**layout):
        diloco = make_core(routers=lambda m: m.router_mask(), router_sync_period=2, **layout)
        state = diloco.init(Transformer(config, key=jax.random.key(0)))
        losses = []
        for t in range(12):
            state, metrics = diloco.step(state, batch(t))
            losses.append(np.asarray(metrics["loss"]))
        return diloco, state, np.stack(losses)

    _, _, losses = run()
    _, sharded_state, sharded_losses = run(fsdp=2, tensor=2)
    up = sharded_state.params.blocks.ffn.up  # (R, L, experts, dim, hidden)
    assert tuple(up.sharding.spec)[:3] == ("diloco", None, "tensor")
    assert relative(sharded_losses, losses) <= 1e-5


@pytest.mark.slow  # a Llama-layout model trained twice
def test_llama_layout_split_over_tensor_trains_like_replicated():
    """SwiGLU (gate and up split by columns), grouped-query attention (2 key/value heads: one per tensor
    device) and q/k/v biases (split with their projections' columns) on fsdp 2 x tensor 2."""
    config = dataclasses.replace(CONFIG, mlp="swiglu", num_kv_heads=2, qkv_bias=True, ffn_dim=48)

    def run(**layout):
        diloco = make_core(**layout)
        state = diloco.init(Transformer(config, key=jax.random.key(0)))
        losses = []
        for t in range(12):
            state, metrics = diloco.step(state, batch(t))
            losses.append(np.asarray(metrics["loss"]))
        return diloco, state, np.stack(losses)

    replicated, state, losses = run()
    sharded, sharded_state, sharded_losses = run(fsdp=2, tensor=2)
    attn, ffn = sharded_state.params.blocks.attn, sharded_state.params.blocks.ffn
    assert attn.k.sharding.spec == PartitionSpec("diloco", None, "fsdp", "tensor")
    assert attn.k.addressable_shards[0].data.shape == (1, 4, 16, 8)  # (R, L, d, 2 heads x 8) / (2, 1, 2, 2)
    assert tuple(attn.k_bias.sharding.spec)[:3] == ("diloco", None, "tensor")
    assert ffn.gate.sharding.spec == ffn.up.sharding.spec == PartitionSpec("diloco", None, "fsdp", "tensor")
    assert relative(sharded_losses, losses) <= 1e-5
    for got, expected in zip(finished_model(sharded, sharded_state), finished_model(replicated, state)):
        assert relative(got, expected) <= 1e-5
    assert losses[-1].mean() < losses[0].mean()
