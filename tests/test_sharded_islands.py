"""Sharded islands: layouts, bytes, the per-shard exchange and bad input (the trainings that compare
sharded with replicated islands are in `tests/test_sharded_training.py`)."""

import dataclasses
import json
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from sharded_util import CONFIG, REPO, R, batch, make_core, relative, train

from benchmarks.memory import state_bytes_per_device  # device memory only, from shapes and shardings
from eqx_diloco import ConfigError, fsdp_specs
from eqx_diloco import quantize as q
from eqx_diloco._mesh import build_meshes
from eqx_diloco._outer import mean_outer_gradient, move_to_mesh
from models.transformer import Transformer


@pytest.mark.slow  # compiles; the fast tier keeps test_fsdp_alone_trains_like_replicated
def test_adamw_moments_follow_the_parameters():
    diloco = make_core(fsdp=2, tensor=2, quantize="int4", error_feedback=True, inner_optimizer=optax.adamw(3e-3))
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0)))
    spec = PartitionSpec("diloco", None, "fsdp", "tensor")
    adam = state.opt_state[0]  # adamw: (ScaleByAdamState, ...)
    assert adam.mu.blocks.attn.q.sharding.spec == spec and adam.nu.blocks.attn.v.sharding.spec == spec
    assert adam.count.sharding.spec == PartitionSpec("diloco")
    assert state.global_params.blocks.attn.k.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    momentum = state.outer_states[0][0].trace  # sgd with Nesterov momentum over fragment 0's values
    layouts = {x.sharding.spec for x in jax.tree.leaves(momentum)}
    assert PartitionSpec(None, "fsdp", "tensor") in layouts
    assert {r.sharding.spec for r in state.residuals[0]} >= {spec}


def test_state_bytes_per_device_shrink_with_fsdp():
    model = Transformer(CONFIG, key=jax.random.key(0))
    base = make_core(quantize="int4", error_feedback=True)
    base.abstract(model)
    whole = state_bytes_per_device(base)
    for fsdp in (2, 4):
        core = make_core(fsdp=fsdp, quantize="int4", error_feedback=True)
        core.abstract(model)
        assert state_bytes_per_device(core) <= 1.1 * whole / fsdp, fsdp


@pytest.mark.slow  # compiles; the fast tier keeps test_fsdp_alone_trains_like_replicated
def test_quantized_sync_sends_each_devices_own_shard():
    """The int4 exchange of a sharded island equals a reference that quantizes each device's shard."""
    sharded = make_core(fsdp=2, tensor=2)
    mesh = sharded.mesh
    specs = [PartitionSpec(None, "fsdp", "tensor"), PartitionSpec()]
    shapes = [(4, 32, 64), (32,)]
    key = jax.random.key(3)
    replica_values = [jax.random.normal(jax.random.fold_in(key, i), (R, *s)) for i, s in enumerate(shapes)]
    global_values = [jnp.zeros(s) for s in shapes]
    residuals = [jnp.zeros((R, *s)) for s in shapes]
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    exchange = jax.jit(mean_outer_gradient(mesh, "int4", skip_nonfinite=False, error_feedback=True, specs=specs))
    mean, finite, errors, every_finite = exchange(
        [put(x, PartitionSpec("diloco", *s)) for x, s in zip(replica_values, specs)],
        [put(x, s) for x, s in zip(global_values, specs)],
        [put(x, PartitionSpec("diloco", *s)) for x, s in zip(residuals, specs)],
    )
    assert np.all(np.asarray(finite)) and bool(every_finite)
    # Reference: device (f, t) of replica r sends its block of the first value as one payload; the
    # second value (replicated in the island) travels in a payload of its own.
    deltas = [-np.asarray(x) for x in replica_values]
    want_mean = [np.zeros(s, np.float32) for s in shapes]
    want_error = [np.zeros((R, *s), np.float32) for s in shapes]
    roundtrip = lambda v: np.asarray(q.decode(q.encode(jnp.asarray(v), "int4"), "int4", v.shape))  # noqa: E731
    for r in range(R):
        for f in range(2):
            for t in range(2):
                block = (slice(None), slice(16 * f, 16 * f + 16), slice(32 * t, 32 * t + 32))
                sent = roundtrip(deltas[0][r][block])
                want_mean[0][block] += sent / R
                want_error[0][r][block] = deltas[0][r][block] - sent
        sent = roundtrip(deltas[1][r])
        want_mean[1] += sent / R
        want_error[1][r] = deltas[1][r] - sent
    for got, want in zip(mean, want_mean):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    for got, want in zip(errors, want_error):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_wire_bytes_per_device_are_a_shard_of_the_replicas():
    # A few million parameters (shapes only): each payload's last block is padded, which
    # weighs on a tiny model's shards.
    model = eqx.filter_eval_shape(Transformer, dataclasses.replace(CONFIG, dim=256, vocab_size=1024), key=jax.random.key(0))
    base = make_core(quantize="int4", error_feedback=True)
    base.abstract(model)
    sharded = make_core(fsdp=2, tensor=2, quantize="int4", error_feedback=True)
    sharded.abstract(model)
    # The first sync (fragment 0 = everything at P = 1) after step 4.
    assert sharded.wire_bytes_per_device_at(4) <= 1.01 * base.wire_bytes_at(4) / 4
    assert base.wire_bytes_per_device_at(4) == base.wire_bytes_at(4)
    assert sharded.wire_bytes_at(4) == 4 * sharded.wire_bytes_per_device_at(4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(fsdp=0), "fsdp must be an int >= 1"),
    (dict(tensor=2, param_specs=None), "tensor=2 needs param_specs="),
    (dict(fsdp=4, comm_device="on", overlap_steps=1, num_fragments=2),
     r"\(data_parallel x fsdp x tensor \+ 4 communication devices\) needs 16 devices per process"),
    (dict(fsdp=2, replicas_per_device=2), "replicas_per_device must be 1 with fsdp or tensor > 1"),
    (dict(fsdp=8), "needs 16 devices per process"),
    (dict(fsdp=2, param_specs=lambda m: jax.tree.map(lambda _: PartitionSpec("data"), m)),
     "param_specs names axis 'data'"),
])
def test_bad_island_layouts_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_core(**kwargs).abstract(Transformer(CONFIG, key=jax.random.key(0)))
    assert "\n" not in str(error.value)


def test_bad_param_specs_name_the_leaf():
    model = Transformer(CONFIG, key=jax.random.key(0))

    def on(path, spec):
        return lambda m: eqx.tree_at(path, jax.tree.map(lambda _: PartitionSpec(), m), spec)

    cases = [
        (on(lambda m: m.blocks.attn.q, PartitionSpec("fsdp")), "shards the layer axis of .blocks.attn.q"),
        (on(lambda m: m.embed, PartitionSpec(None, None, "fsdp")), "gives .embed (shape (64, 32)) a spec of 3"),
        (on(lambda m: m.embed, PartitionSpec("fsdp")), "dimension 0 of .embed (size 64) over fsdp = 3"),
        (on(lambda m: m.embed, PartitionSpec("fsdp", "fsdp")), "uses an axis twice"),
        (lambda m: [PartitionSpec()], "must return a tree shaped like the model's arrays"),
    ]
    for specs, message in cases:
        core = make_core(fsdp=3, param_specs=specs)
        with pytest.raises(ConfigError, match=re.escape(message)) as error:
            core.abstract(model)
        assert "\n" not in str(error.value)


@pytest.mark.slow  # compiles; the fast tier keeps test_fsdp_alone_trains_like_replicated
def test_a_model_without_tensor_rules_for_an_odd_width_stays_whole():
    """The FSDP rule skips what it cannot split and never the layer axis."""
    model = Transformer(dataclasses.replace(CONFIG, dim=36, num_heads=4), key=jax.random.key(0))
    specs = fsdp_specs(model, 8, layers=lambda m: m.blocks)
    assert specs.blocks.attn_norm.weight == PartitionSpec()  # (L=4, 36): 8 divides neither allowed dim
    assert specs.embed == PartitionSpec("fsdp")  # (64, 36)
    assert specs.blocks.ffn.up == PartitionSpec(None, None, "fsdp")  # (4, 36, 72)


def test_outer_state_in_host_memory_leaves_device_memory():
    model = Transformer(CONFIG, key=jax.random.key(0))
    params_bytes = sum(x.size * 4 for x in jax.tree.leaves(model)) // 4  # a shard of fsdp 2 x tensor 2
    on_device, on_host = make_core(fsdp=2, tensor=2), make_core(fsdp=2, tensor=2, outer_state_memory="host")
    on_device.abstract(model)
    on_host.abstract(model)
    # theta_g and the outer momentum: two parameter-sized float32 copies (less what stays replicated)
    assert state_bytes_per_device(on_device) - state_bytes_per_device(on_host) >= 1.9 * params_bytes
    kinds = {s.memory_kind for s in jax.tree.leaves((on_host.shardings.global_params, on_host.shardings.outer_states))}
    assert kinds == {"pinned_host"}


def test_outer_state_memory_is_checked():
    with pytest.raises(ConfigError, match="outer_state_memory must be device or host"):
        make_core(outer_state_memory="disk")
    with pytest.raises(ConfigError, match="outer_state_memory host needs outer_overlap none"):
        make_core(outer_state_memory="host", outer_overlap="delayed")


def test_a_communication_mesh_must_partner_every_shard():
    mesh, _ = build_meshes(R, fsdp=2)
    _, unsharded_comm = build_meshes(R, comm_device="on")
    with pytest.raises(ConfigError, match=r"comm_mesh must have the shape \{'diloco': 2, 'data': 1, 'fsdp': 2, "
                                          r"'tensor': 1\} \(a partner device for each shard") as error:
        make_core(mesh=mesh, comm_mesh=unsharded_comm, overlap_steps=1, num_fragments=2)
    assert "\n" not in str(error.value)
    on_compute_devices = Mesh(mesh.devices[:, :1], mesh.axis_names, axis_types=mesh.axis_types)
    with pytest.raises(ConfigError, match="comm_mesh must not share devices with mesh"):
        make_core(mesh=mesh, comm_mesh=on_compute_devices, overlap_steps=1, num_fragments=2)


@pytest.mark.slow  # compiles; the fast tier keeps test_fsdp_alone_trains_like_replicated
@pytest.mark.parametrize("comm", ["off", "on"])
def test_an_outer_sync_gathers_nothing_inside_an_island(comm):
    """The sync's only collectives are the reductions over `diloco` (and the island's finite flags), on
    the island's own devices or on its communication devices (one partner holding each shard)."""
    diloco = make_core(fsdp=2, tensor=2 if comm == "off" else 1, num_fragments=3, sync_period=6, overlap_steps=1,
                       comm_device=comm)
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0)))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    launched = diloco.outer._fns["extract"][1](state)
    if comm == "on":
        launched = move_to_mesh(launched, diloco.mesh, diloco.comm_mesh)
        q_values = launched[0][0]  # the fragment's replica values of the first leaf (attention q)
        assert set(q_values.sharding.device_set) == set(diloco.comm_mesh.devices.flat)
        assert q_values.addressable_shards[0].data.shape[2] == q_values.shape[2] // 2  # a shard, not gathered
    programs = {"launch": diloco.outer._fns["launch"][1].lower(*launched),
                "merge": diloco.outer._fns["merge"][1].lower(abstract),
                "sync_and_merge": diloco.outer._fns["sync_and_merge"][2].lower(abstract)}
    for name, lowered in programs.items():
        text = lowered.compile().as_text()
        assert "all-gather" not in text and "all-to-all" not in text, name
        assert name == "merge" or "all-reduce" in text, name


@pytest.mark.slow  # a process with 16 simulated devices compiles a 1.3B model's programs
def test_a_billion_parameter_island_compiles_on_abstract_inputs(tmp_path):
    out = tmp_path / "memory.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--quick", "--compile", "--train-steps", "0",
                             "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["layouts"]
    assert [r["fsdp"] for r in rows] == [1, 8]
    replicated, sharded = rows
    assert sharded["state_bytes_per_device"] <= 1.1 * replicated["state_bytes_per_device"] / 8
    assert sharded["compiled"]["inner_step"]["argument_bytes"] <= 1.1 * replicated["compiled"]["inner_step"]["argument_bytes"] / 8
    assert sharded["wire_bytes_per_device"] <= 1.01 * replicated["wire_bytes_per_device"] / 8


@pytest.mark.slow  # three trainings
def test_an_elastic_sharded_island_reforms_on_any_layout(tmp_path):
    """An island of fsdp 2 x tensor 2 snapshots whole arrays at its sync boundaries; an island re-formed
    from the snapshot as fsdp 2 x tensor 2 or as one device holds the same state and trains on alike."""
    from eqx_diloco import IslandSnapshots

    model = Transformer(CONFIG, key=jax.random.key(0))
    one = dict(num_replicas=1, num_fragments=2, sync_period=4, overlap_steps=1, alpha=0.5, quantize="int4",
               error_feedback=True, comm_device="off")
    diloco = make_core(fsdp=2, tensor=2, **one)
    snapshots = IslandSnapshots(tmp_path / "island-0")
    state = diloco.init(model)
    for t in range(7):
        state, metrics = diloco.step(state, batch(t)[:1])
        if (metrics["synced_fragment"] is not None or metrics["applied_fragment"] is not None) and diloco.settled:
            snapshots.write(diloco.island_snapshot(state, island=0))
    snapshots.wait()
    S = snapshots.newest()
    assert S is not None and S > 2
    state, _ = train(make_core(fsdp=2, tensor=2, **one), S)
    want = [np.asarray(x) for x in jax.tree.leaves(state)]
    losses = {}
    for layout in (dict(fsdp=2, tensor=2), dict()):
        reformed = make_core(**layout, **one)
        reformed.abstract(model)
        got = reformed.reform(snapshots, island=0, key=jax.random.key(1))
        assert int(got.step) == S
        for a, b in zip(jax.tree.leaves(got), want):
            np.testing.assert_array_equal(np.asarray(a), b)
        _, losses[bool(layout)] = train(reformed, 4, got, start=S)
    # int4 scales are per block of a device's shard: the two layouts round their next syncs differently.
    assert relative(losses[False], losses[True]) <= 1e-3


def test_a_batch_the_island_cannot_split_is_refused():
    diloco = make_core(fsdp=4)
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"batch axis must be divisible by data_parallel x fsdp = 4") as error:
        diloco.step(state, batch(0)[:, :6])
    assert "\n" not in str(error.value)
