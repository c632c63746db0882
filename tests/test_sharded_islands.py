"""Sharded islands: a replica spread over `fsdp x tensor` devices trains exactly as a replicated one.

Every equivalence test runs the same training twice on simulated CPU devices: R = 2 replicas
each on one device, and R = 2 replicas each sharded over fsdp 2 x tensor 2 (8 devices), and
compares the replicas' losses and the final global model.

The inner optimizer is SGD with momentum: a sharded matmul sums in another order, and Adam
turns a last-bit difference in a near-zero gradient into an lr-sized step (with AdamW the
losses still agree to 2e-7 but single parameters differ by up to 5e-5 of the largest after
12 steps; with SGD everything agrees to 3e-7). `test_adamw_moments_follow_the_parameters`
covers Adam's state.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from eqx_diloco import Checkpointer, ConfigError, DiLoCo, fsdp_specs
from eqx_diloco import quantize as q
from eqx_diloco._outer import mean_outer_gradient
from models import TransformerConfig
from models.transformer import Transformer, lm_loss

REPO = Path(__file__).resolve().parents[1]
R, SEQ, BATCH = 2, 16, 8
CONFIG = TransformerConfig(num_layers=4, dim=32, num_heads=4, mlp_ratio=2, vocab_size=64, dtype="float32")


def loss_fn(model, tokens, key):
    return lm_loss(model, tokens)


def tensor_rules(fsdp: int):
    """The bundled Transformer's tensor rules with FSDP on the free dimensions."""
    return lambda m: fsdp_specs(m, fsdp, layers=lambda m: m.blocks, base=m.tensor_specs(), tensor=2)


def make_core(fsdp: int = 1, tensor: int = 1, **overrides) -> DiLoCo:
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=R, sync_period=4,
                  inner_optimizer=optax.sgd(0.1, momentum=0.9), comm_device="off", fsdp=fsdp, tensor=tensor)
    if tensor > 1:
        kwargs["param_specs"] = tensor_rules(fsdp)
    return DiLoCo(**{**kwargs, **overrides})


def batch(t: int):
    """Counting sequences from random starts: learnable, so the loss falls within a few steps."""
    starts = jax.random.randint(jax.random.fold_in(jax.random.key(7), t), (R, BATCH, 1), 0, CONFIG.vocab_size)
    return (starts + jnp.arange(SEQ + 1)[None, None, :]) % CONFIG.vocab_size


def train(diloco: DiLoCo, steps: int, state=None, start: int = 0):
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0))) if state is None else state
    losses = []
    for t in range(start, start + steps):
        state, metrics = diloco.step(state, batch(t))
        losses.append(np.asarray(metrics["loss"]))
    return state, np.stack(losses)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def finished_model(diloco, state):
    return [np.asarray(x) for x in jax.tree.leaves(diloco.global_model(diloco.finish(state)))]


CASES = {
    "diloco": (dict(), 1e-5),
    "streaming-p3-tau1": (dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5), 1e-5),
    "ddp": (dict(algorithm="ddp"), 1e-5),
    "eager": (dict(outer_overlap="eager"), 1e-5),
    "delayed": (dict(outer_overlap="delayed"), 1e-5),
}


@pytest.mark.slow  # the fast tier trains the small model of `test_fsdp_alone_trains_like_replicated`
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_islands_train_like_replicated_ones(name):
    overrides, tolerance = CASES[name]
    steps = 3 * overrides.get("sync_period", 4)  # three rounds
    replicated = make_core(**overrides)
    state, losses = train(replicated, steps)
    want = finished_model(replicated, state)
    sharded = make_core(fsdp=2, tensor=2, **overrides)
    assert dict(sharded.mesh.shape) == {"diloco": 2, "data": 1, "fsdp": 2, "tensor": 2}
    state, got_losses = train(sharded, steps)
    q = state.params.blocks.attn.q
    assert q.sharding.spec == PartitionSpec("diloco", None, "fsdp", "tensor")
    assert q.addressable_shards[0].data.shape == (1, 4, 16, 16)  # (R, L, d, d) / (2, 1, 2, 2)
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


def state_bytes_per_device(diloco: DiLoCo) -> int:
    """Bytes of the train state on the busiest device, from the state's shapes and shardings."""
    per_device: dict = {}
    for x, sharding in zip(jax.tree.leaves(diloco.abstract_state), jax.tree.leaves(diloco.shardings)):
        shard = sharding.shard_shape(x.shape)
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + int(np.prod(shard)) * x.dtype.itemsize
    return max(per_device.values())


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
    mean, finite, errors = exchange(
        [put(x, PartitionSpec("diloco", *s)) for x, s in zip(replica_values, specs)],
        [put(x, s) for x, s in zip(global_values, specs)],
        [put(x, PartitionSpec("diloco", *s)) for x, s in zip(residuals, specs)],
    )
    assert np.all(np.asarray(finite))
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


@pytest.mark.parametrize("fmt,tolerance,more", [
    pytest.param("int4", 1e-2, {}, marks=pytest.mark.slow),
    pytest.param("bf16", 1e-3, {}, marks=pytest.mark.slow),
    pytest.param("int4", 1e-2, dict(exchange="two_phase"), marks=pytest.mark.slow),
    pytest.param("int8", 1e-2, dict(outer_overlap="eager"), marks=pytest.mark.slow),
], ids=["int4", "bf16", "int4-two-phase", "int8-eager"])
def test_quantized_sharded_islands_train_close_to_replicated(fmt, tolerance, more):
    """int4's scales are per block of a device's shard, so its rounding differs from the
    replicated run's (`test_quantized_sync_sends_each_devices_own_shard` checks it exactly);
    bf16 rounds value by value, but a last-bit difference in an outer gradient can still move
    its rounding by one bf16 step."""
    overrides = dict(quantize=fmt, error_feedback=True, **more)
    replicated = make_core(**overrides)
    state, losses = train(replicated, 12)
    want = finished_model(replicated, state)
    sharded = make_core(fsdp=2, tensor=2, **overrides)
    sharded_state, sharded_losses = train(sharded, 12)
    assert relative(sharded_losses, losses) <= tolerance
    if fmt == "bf16":  # int4's other rounding moves parameters by up to a quantization step (~1e-1 here)
        assert max(relative(g, w) for g, w in zip(finished_model(sharded, sharded_state), want)) <= tolerance
    assert np.all(np.isfinite(sharded_losses)) and sharded_losses[-1].mean() < sharded_losses[0].mean()


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


@pytest.mark.slow  # two trainings and two restores
def test_a_checkpoint_restores_onto_another_island_layout(tmp_path):
    overrides = dict(quantize="int8", error_feedback=True)
    reference = make_core(fsdp=2, tensor=2, **overrides)
    state, _ = train(reference, 12)
    want = finished_model(reference, state)
    first = make_core(fsdp=2, tensor=2, **overrides)
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
    again = make_core(fsdp=2, tensor=2, **overrides)
    state = again.restore(Checkpointer(tmp_path / "ckpt", every=1, keep=2), Transformer(CONFIG, key=jax.random.key(1)))
    state, _ = train(again, 6, state, start=6)
    for got, expected in zip(finished_model(again, state), want):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("kwargs,message", [
    (dict(fsdp=0), "fsdp must be an int >= 1"),
    (dict(tensor=2, param_specs=None), "tensor=2 needs param_specs="),
    (dict(fsdp=2, comm_device="on", overlap_steps=1, num_fragments=2), "comm_device on needs fsdp = tensor = 1"),
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


def device_memory_bytes(diloco: DiLoCo) -> int:
    """Bytes of the train state in device memory (not host memory) on its busiest device."""
    per_device: dict = {}
    for x, sharding in zip(jax.tree.leaves(diloco.abstract_state), jax.tree.leaves(diloco.shardings)):
        if sharding.memory_kind == "pinned_host":
            continue
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize
    return max(per_device.values())


@pytest.mark.slow  # four trainings
@pytest.mark.parametrize("layout", [dict(), dict(fsdp=2, tensor=2)], ids=["replicated", "fsdp2-tensor2"])
def test_outer_state_in_host_memory_trains_the_same(layout, tmp_path):
    overrides = dict(num_fragments=3, sync_period=6, overlap_steps=1, **layout)
    on_device = make_core(**overrides)
    state, losses = train(on_device, 12)
    want = finished_model(on_device, state)
    on_host = make_core(**overrides, outer_state_memory="host")
    host_state, host_losses = train(on_host, 12)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_state.global_params)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_state.outer_states)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(host_state.params)} == {"device"}
    np.testing.assert_array_equal(host_losses, losses)
    # theta_g and the outer momentum (two parameter-sized float32 copies) left device memory.
    params_bytes = sum(x.size * 4 for x in jax.tree.leaves(Transformer(CONFIG, key=jax.random.key(0)))) \
        // (layout.get("fsdp", 1) * layout.get("tensor", 1))
    assert device_memory_bytes(on_device) - device_memory_bytes(on_host) >= 1.9 * params_bytes
    # They survive a checkpoint in host memory.
    checkpointer = Checkpointer(tmp_path / "ckpt", every=1, keep=2)
    host_state = on_host.save(checkpointer, host_state, force=True)
    checkpointer.wait()
    restored = make_core(**overrides, outer_state_memory="host").restore(
        Checkpointer(tmp_path / "ckpt", every=1, keep=2), Transformer(CONFIG, key=jax.random.key(1)))
    for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(host_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        assert got.sharding.memory_kind == expected.sharding.memory_kind
    for got, expected in zip(finished_model(on_host, host_state), want):
        np.testing.assert_array_equal(got, expected)


def test_outer_state_memory_is_checked():
    with pytest.raises(ConfigError, match="outer_state_memory must be device or host"):
        make_core(outer_state_memory="disk")
    with pytest.raises(ConfigError, match="outer_state_memory host needs outer_overlap none"):
        make_core(outer_state_memory="host", outer_overlap="delayed")


@pytest.mark.slow  # compiles; the fast tier keeps test_fsdp_alone_trains_like_replicated
def test_an_outer_sync_gathers_nothing_inside_an_island():
    """The sync's only collectives are the reductions over `diloco` (and the island's finite flags)."""
    diloco = make_core(fsdp=2, tensor=2, num_fragments=3, sync_period=6, overlap_steps=1)
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0)))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    programs = {"launch": diloco.outer._fns["launch"][1].lower(*diloco.outer._fns["extract"][1](state)),
                "merge": diloco.outer._fns["merge"][1].lower(abstract),
                "sync_and_merge": diloco.outer._fns["sync_and_merge"][2].lower(abstract)}
    for name, lowered in programs.items():
        text = lowered.compile().as_text()
        assert "all-gather" not in text and "all-to-all" not in text, name
        assert name == "merge" or "all-reduce" in text, name


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


def test_elastic_islands_are_refused_for_sharded_islands(tmp_path):
    from eqx_diloco import IslandSnapshots

    diloco = make_core(fsdp=2)
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0)))
    with pytest.raises(ConfigError, match="elastic islands need fsdp = tensor = 1"):
        diloco.island_snapshot(state, island=0)
    with pytest.raises(ConfigError, match="elastic islands need fsdp = tensor = 1"):
        diloco.reform(IslandSnapshots(tmp_path), island=0, key=jax.random.key(0))


def test_a_batch_the_island_cannot_split_is_refused():
    diloco = make_core(fsdp=4)
    state = diloco.init(Transformer(CONFIG, key=jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"batch axis must be divisible by data_parallel x fsdp = 4") as error:
        diloco.step(state, batch(0)[:, :6])
    assert "\n" not in str(error.value)
