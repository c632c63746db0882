"""Issue #31's inner step for the bundled LM: compute dtype, fused attention, scan unroll, remat.

Equivalences at float32 (the new code paths against written-out references), the HLO of a
bfloat16 inner step, and what the DiLoCo core keeps for a model that holds bfloat16 parameters.
"""

import dataclasses
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import Transformer, TransformerConfig
from models.transformer import apply_rotary, lm_loss, rotary_tables

# JAX's own `dot_product_attention` mixes bf16 and float32 (its scores) with implicit promotion,
# which the tests' strict promotion (conftest) refuses; the CLI runs with JAX's standard promotion.
standard_promotion = pytest.mark.usefixtures("standard_dtype_promotion")


@pytest.fixture
def standard_dtype_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


SMALL = TransformerConfig(num_layers=4, dim=32, num_heads=4, mlp_ratio=2, dtype="float32")
# The Llama layout: SwiGLU, grouped-query attention (2 query heads per key/value head), q/k/v biases.
LAYOUTS = {"dense": {}, "moe": dict(kind="moe"), "llama": dict(mlp="swiglu", num_kv_heads=2, qkv_bias=True)}


def with_(config: TransformerConfig, **changes) -> TransformerConfig:
    return dataclasses.replace(config, **changes)


def written_out_attention(attn, x, cos, sin):
    """The attention as it was written before `jax.nn.dot_product_attention`: explicit scores,
    a boolean causal mask and a softmax (the reference)."""
    seq, dim = x.shape
    head_dim, group = dim // attn.num_heads, attn.num_heads // attn.num_kv_heads
    q, k, v = x @ attn.q, x @ attn.k, x @ attn.v
    q = q.reshape(seq, attn.num_heads, head_dim)
    # Grouped-query attention: key/value head j serves query heads j * group ... (j + 1) * group - 1.
    k, v = (jnp.repeat(t.reshape(seq, attn.num_kv_heads, head_dim), group, axis=1) for t in (k, v))
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    scores = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim // attn.num_heads)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal[None], scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(seq, dim) @ attn.out


def loss_and_grads(config, tokens, key=None):
    model = Transformer(config, key=jax.random.key(0))
    (loss, _), grads = jax.jit(jax.value_and_grad(lambda m: lm_loss(m, tokens, key=key), has_aux=True))(model)
    return loss, grads


def assert_trees_close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


TOKENS = jax.random.randint(jax.random.key(5), (2, 25), 0, 256)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
def test_fused_attention_equals_the_written_out_attention_at_float32(num_kv_heads):
    model = Transformer(with_(SMALL, num_kv_heads=num_kv_heads), key=jax.random.key(1))
    attn = jax.tree.map(lambda a: a[0], model.blocks).attn
    x = jax.random.normal(jax.random.key(2), (24, SMALL.dim))
    cos, sin = rotary_tables(24, SMALL.head_dim, SMALL.rope_base)
    np.testing.assert_allclose(attn(x, cos, sin, implementation="xla"), written_out_attention(attn, x, cos, sin),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_remat_none_block_dots_give_the_same_loss_and_gradients(kind):
    config = with_(SMALL, **LAYOUTS[kind], dropout=0.1)  # dropout: the recomputed forward must draw the same masks
    key = jax.random.key(9)
    ref_loss, ref_grads = loss_and_grads(with_(config, remat="none"), TOKENS, key)
    for remat in ("block", "dots"):
        loss, grads = loss_and_grads(with_(config, remat=remat), TOKENS, key)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert_trees_close(grads, ref_grads, 1e-6)


@pytest.mark.slow
def test_scan_unroll_1_0_2_3_auto_give_the_same_loss_and_gradients():
    ref_loss, ref_grads = loss_and_grads(with_(SMALL, scan_unroll=1), TOKENS)
    for unroll in (0, 2, 3, "auto"):  # 3 does not divide 4 layers
        loss, grads = loss_and_grads(with_(SMALL, scan_unroll=unroll), TOKENS)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert_trees_close(grads, ref_grads, 1e-6)


def test_auto_resolves_to_float32_and_xla_on_cpu_and_cudnn_is_refused_there():
    assert jax.default_backend() == "cpu"
    config = TransformerConfig()
    assert (config.dtype, config.attention, config.scan_unroll, config.remat) == ("auto", "auto", "auto", "none")
    assert config.compute_dtype() == jnp.float32 and config.attention_impl() == "xla"
    assert with_(config, dtype="bfloat16").compute_dtype() == jnp.bfloat16
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        with_(config, attention="cudnn").attention_impl()


@pytest.mark.slow  # the fast tier keeps the core's float32 outer state for bfloat16 parameters
@standard_promotion
@pytest.mark.parametrize("kind", ["dense", "llama"])
def test_bfloat16_keeps_float32_parameters_logits_and_loss_and_stays_close_to_float32(kind):
    config = with_(SMALL, **LAYOUTS[kind])
    model = Transformer(with_(config, dtype="bfloat16"), key=jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))} == {jnp.dtype(jnp.float32)}
    logits = model(TOKENS[0, :-1])
    assert logits.dtype == jnp.float32
    loss, grads = loss_and_grads(with_(config, dtype="bfloat16"), TOKENS)
    ref_loss, _ = loss_and_grads(config, TOKENS)
    assert loss.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)


def dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """(lhs element type, rhs element type) of every dot_general in StableHLO text."""
    types = []
    for line in hlo.splitlines():
        if "stablehlo.dot_general" in line:
            match = re.search(r":\s*\(tensor<([^>]*)>, tensor<([^>]*)>\)", line)
            assert match, line
            types.append(tuple(t.split("x")[-1] for t in match.groups()))
    return types


@standard_promotion
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_lowered_bfloat16_inner_step_has_bf16_dot_operands(kind):
    config = with_(SMALL, dtype="bfloat16", **LAYOUTS[kind])
    model = Transformer(config, key=jax.random.key(0))
    opt = optax.adamw(1e-3)
    params = eqx.filter(model, eqx.is_inexact_array)

    def inner_step(model, opt_state, tokens):  # one AdamW step, as the trainer's inner step takes
        (loss, _), grads = jax.value_and_grad(lm_loss, has_aux=True)(model, tokens)
        updates, opt_state = opt.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    hlo = jax.jit(inner_step).lower(model, opt.init(params), TOKENS).as_text()
    types = dot_operand_types(hlo)
    assert types
    # Every matmul of the model's weights runs on bf16 operands. Float32 on both sides only in the MoE
    # router's softmax and gates (tiny: seq x experts, forward and backward); one side float32 only in
    # JAX's own XLA attention backward (its float32 score gradient against bf16 q and k).
    f32 = [t for t in types if t == ("f32", "f32")]
    mixed = [t for t in types if set(t) == {"f32", "bf16"}]
    assert len(f32) <= (5 if kind == "moe" else 0), types
    assert len(mixed) <= 2, types
    assert len(types) - len(f32) - len(mixed) >= 3 * 4, types  # at least qkv, out, up, down and their gradients


def test_the_core_keeps_float32_outer_state_for_a_float32_model():
    from custom_model import StackedMLP, loss_fn

    from eqx_diloco import DiLoCo

    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=1, sync_period=2,
                    inner_optimizer=optax.adamw(1e-3), outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    floats = [x.dtype for x in jax.tree.leaves((state.global_params, state.outer_states)) if eqx.is_inexact_array(x)]
    assert floats and set(floats) == {jnp.dtype(jnp.float32)}


def test_the_core_keeps_float32_outer_state_for_a_model_with_bfloat16_parameters():
    from custom_model import StackedMLP, loss_fn, make_batch

    from eqx_diloco import DiLoCo

    model = StackedMLP(key=jax.random.key(0))
    model = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
    diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=1, sync_period=2,
                    inner_optimizer=optax.adamw(1e-3), outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    state = diloco.init(model)
    x, y = make_batch(0, 1)
    for _ in range(2):  # through one outer step
        state, _ = diloco.step(state, (x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)))
    floats = [x.dtype for x in jax.tree.leaves((state.global_params, state.outer_states)) if eqx.is_inexact_array(x)]
    assert floats and set(floats) == {jnp.dtype(jnp.float32)}, set(floats)
    # The replicas keep the model's dtype, and so does the model handed back.
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    global_model = diloco.global_model(state)
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(global_model, eqx.is_inexact_array))} == {jnp.dtype(jnp.bfloat16)}
    # theta_g moved by the outer step in float32: it is not a bfloat16 value everywhere.
    theta = jnp.concatenate([x.ravel() for x in jax.tree.leaves(state.global_params)])
    assert bool(jnp.any(theta != theta.astype(jnp.bfloat16).astype(jnp.float32)))


def test_cli_refuses_cudnn_where_it_cannot_run_with_one_line_naming_the_flag():
    from eqx_diloco.lm._devices import make_meshes
    from eqx_diloco.lm.config import Config, ConfigError, check_backend, validate

    def config(**model):
        return Config(model=TransformerConfig(**model))

    with pytest.raises(ConfigError, match=r"^--model\.attention cudnn needs a bfloat16 compute dtype") as e:
        validate(config(attention="cudnn", dtype="float32"))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"--model\.attention cudnn needs a head dim <= 128"):
        validate(config(attention="cudnn", dtype="bfloat16", dim=1024, num_heads=4))
    validate(config(attention="cudnn", dtype="bfloat16"))  # the backend's half waits for JAX
    # Grouped-query attention keeps the head dim: cuDNN takes fewer key/value heads as they are.
    validate(config(attention="cudnn", dtype="bfloat16", mlp="swiglu", num_kv_heads=1))
    with pytest.raises(ConfigError, match=r"^--model\.attention cudnn needs an NVIDIA GPU.*backend cpu"):
        check_backend(config(attention="cudnn", dtype="bfloat16"), "cpu", nvidia_gpu=False)
    check_backend(config(attention="cudnn", dtype="auto"), "gpu", nvidia_gpu=True)  # auto = bfloat16 there
    with pytest.raises(ConfigError, match=r"float32"):
        check_backend(config(attention="cudnn", dtype="auto"), "cpu", nvidia_gpu=True)
    with pytest.raises(ConfigError, match=r"^--model\.attention cudnn needs an NVIDIA GPU"):
        make_meshes(config(attention="cudnn"))  # where the trainer meets the backend, before any state
    for bad in (-1, True, "all"):
        with pytest.raises(ConfigError, match=r"^--model\.scan-unroll must be auto or an int >= 0"):
            validate(config(scan_unroll=bad))


def test_scan_unroll_auto_unrolls_stacks_up_to_16_layers_and_keeps_deeper_ones_rolled():
    from models._config import AUTO_UNROLL_MAX_LAYERS

    assert AUTO_UNROLL_MAX_LAYERS == 16
    for layers, expected in [(1, 1), (2, 2), (6, 6), (16, 16), (17, 1), (48, 1)]:
        assert TransformerConfig(num_layers=layers).layers_per_iteration() == expected
    assert TransformerConfig(num_layers=48, scan_unroll=0).layers_per_iteration() == 48
    assert TransformerConfig(num_layers=6, scan_unroll=1).layers_per_iteration() == 1
    assert TransformerConfig(num_layers=6, scan_unroll=4).layers_per_iteration() == 4
    assert TransformerConfig(num_layers=2, scan_unroll=4).layers_per_iteration() == 2  # at most the stack


def test_setup_lines_warn_when_the_learning_rate_is_above_one_over_width():
    from eqx_diloco.lm._banner import recommended_lr, setup_lines
    from eqx_diloco.lm.config import Config, TrainConfig

    shape_b = TransformerConfig(num_layers=24, dim=2048, num_heads=16, vocab_size=32768)
    warning = [line for line in setup_lines(Config(model=shape_b)) if "warning" in line]
    assert len(warning) == 1 and "--train.lr 0.003" in warning[0] and "try --train.lr 0.00024" in warning[0]
    assert recommended_lr(2048) == 0.00024 and recommended_lr(768) == 0.00065
    assert not [line for line in setup_lines(Config()) if "warning" in line]  # the defaults: width 128, lr 3e-3
    quiet = Config(model=shape_b, train=TrainConfig(lr=recommended_lr(2048)))
    assert not [line for line in setup_lines(quiet) if "warning" in line]


def test_resume_may_change_how_the_model_runs_but_not_its_shape():
    from eqx_diloco._json import to_jsonable
    from eqx_diloco.lm.config import Config
    from eqx_diloco.lm.resume import incompatibility

    saved = to_jsonable(Config())
    for field, value in [("dtype", "bfloat16"), ("attention", "xla"), ("scan_unroll", 0), ("remat", "block")]:
        assert incompatibility(saved, Config(model=TransformerConfig(**{field: value}))) is None
    assert "--model.dim 128 -> 64" in incompatibility(saved, Config(model=TransformerConfig(dim=64)))
    old = to_jsonable(Config())
    for field in ("dtype", "attention", "scan_unroll", "remat"):  # a checkpoint written before these fields
        del old["model"][field]
    assert incompatibility(old, Config(model=TransformerConfig(remat="block"))) is None


def test_committed_precision_artifact_has_bf16_within_2_percent_of_float32_on_every_seed():
    import json
    from pathlib import Path

    result = json.loads((Path(__file__).parents[1] / "benchmarks/results/precision.json").read_text())
    seeds = {r["seed"] for r in result["runs"]}
    assert len(seeds) == 3 and {r["dtype"] for r in result["runs"]} == {"float32", "bfloat16"}
    loss = {(r["dtype"], r["seed"]): r["eval_loss"] for r in result["runs"]}
    for seed in seeds:
        assert abs(loss["bfloat16", seed] / loss["float32", seed] - 1) <= 0.02, seed
    assert result["within_2_percent"] and result["revision"] and result["machine"]["backend"] == "cpu"


@standard_promotion
@pytest.mark.slow  # two short training runs in-process
def test_precision_benchmark_runs_and_writes_its_artifact(tmp_path):
    from benchmarks.precision import main

    result = main(["--steps", "2", "--seeds", "1", "--out", str(tmp_path / "p.json")])
    assert (tmp_path / "p.json").exists() and len(result["runs"]) == 2
