"""Fragments partition every parameter exactly once; schedules follow the closed form."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco import schedule
from eqx_diloco._fragments import Fragmenter, layer_groups
from models import Transformer, TransformerConfig
from util import slow_except

CASES = [(L, P, pattern) for L in (1, 2, 3, 4, 6, 12) for P in range(1, L + 2) if P == 1 or L % (P - 1) == 0
         for pattern in ("strided", "sequential")]


def _model(num_layers, **layout):
    config = TransformerConfig(num_layers=num_layers, dim=8, num_heads=2, mlp_ratio=1, vocab_size=11, **layout)
    return Transformer(config, key=jax.random.key(num_layers))


# The Llama layout's extra leaves (SwiGLU's gate, narrower k and v, q/k/v biases) are layer leaves like the rest.
@pytest.mark.parametrize("P,pattern", [(3, "strided"), (5, "sequential"), (3, "balanced")])
def test_fragments_partition_the_llama_layout_exactly_once(P, pattern):
    model = _model(4, mlp="swiglu", num_kv_heads=1, qkv_bias=True, tie_embeddings=True)
    frag = Fragmenter.for_model(model, lambda m: m.blocks, P, pattern)
    counts = jax.tree.map(jnp.zeros_like, model)
    for p in range(P):
        counts = frag.put(counts, p, [v + 1 for v in frag.get(counts, p)])
    assert all(np.all(c == 1) for c in jax.tree.leaves(counts))
    assert sum(frag.nbytes(model, p) for p in range(P)) == sum(x.nbytes for x in jax.tree.leaves(model))
    if pattern != "balanced":
        layer_one = frag.get(model, 1)
        assert any(v.shape == (len(frag.layers(1)), 8, 8) for v in layer_one)  # the SwiGLU gate and up
        assert any(v.shape == (len(frag.layers(1)), 4) for v in layer_one)  # the k and v biases (one head of 4)


# Every case of a few depths (get/put run op by op: about a second per case).
@pytest.mark.parametrize("L,P,pattern", slow_except([case for case in CASES if case[0] in (1, 4, 12)],
                                                    fast=[(1, 1, "strided"), (4, 3, "sequential"), (12, 5, "strided")]))
def test_fragments_partition_every_parameter_exactly_once(L, P, pattern):
    model = _model(L)
    frag = Fragmenter.for_model(model, lambda m: m.blocks, P, pattern)
    counts = jax.tree.map(jnp.zeros_like, model)
    rebuilt = jax.tree.map(jnp.zeros_like, model)
    for p in range(P):
        values = frag.get(model, p)
        rebuilt = frag.put(rebuilt, p, values)
        counts = frag.put(counts, p, [v + 1 for v in frag.get(counts, p)])
    assert all(np.all(c == 1) for c in jax.tree.leaves(counts))
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)
    assert sum(frag.nbytes(model, p) for p in range(P)) == sum(x.nbytes for x in jax.tree.leaves(model))


@pytest.mark.parametrize("L,P,pattern", CASES)
def test_layer_sets_are_the_documented_ones(L, P, pattern):
    groups = layer_groups(L, P, pattern)
    assert len(groups) == P - 1
    for f in range(1, P):
        if pattern == "strided":
            expected = list(range(f - 1, L, P - 1))
        else:
            size = L // (P - 1)
            expected = list(range((f - 1) * size, f * size))
        assert Fragmenter(L, P, pattern).layers(f).tolist() == expected
    if P > 1:
        assert Fragmenter(L, P, pattern).layers(0) is None


def test_fragments_work_on_abstract_values_tracers_and_replica_axis():
    L, P, R = 6, 4, 3
    model = _model(L)
    frag = Fragmenter.for_model(model, lambda m: m.blocks, P, "strided")
    stacked = jax.tree.map(lambda x: jnp.stack([x + r for r in range(R)]), model)
    abstract = eqx.filter_eval_shape(lambda: stacked)
    for p in range(P):
        concrete = frag.get(stacked, p, layer_axis=1)
        shapes = [v.shape for v in frag.get(abstract, p, layer_axis=1)]
        assert shapes == [v.shape for v in concrete]
        traced = jax.jit(lambda t, p=p: frag.get(t, p, layer_axis=1))(stacked)
        for a, b in zip(traced, concrete):
            np.testing.assert_array_equal(a, b)
        # Replica r's slice equals the fragment of replica r alone.
        single = frag.get(jax.tree.map(lambda x: x[1], stacked), p)
        for a, b in zip(concrete, single):
            np.testing.assert_array_equal(a[1], b)
    layer_leaf = frag.get(stacked, 2, layer_axis=1)[0]
    assert layer_leaf.shape[:2] == (R, 2)  # layers 1 and 4
    np.testing.assert_array_equal(layer_leaf[0, 1], stacked.blocks.attn_norm.weight[0, 4])
    # put through a tracer keeps everything else
    zeroed = jax.jit(lambda t: frag.put(t, 1, [jnp.zeros_like(v) for v in frag.get(t, 1, layer_axis=1)],
                                        layer_axis=1))(stacked)
    assert float(jnp.abs(zeroed.blocks.attn.q[:, 0]).max()) == 0.0
    assert float(jnp.abs(zeroed.blocks.attn.q[:, 1]).max()) > 0.0
    np.testing.assert_array_equal(zeroed.embed, stacked.embed)


def test_fragment_zero_is_everything_outside_the_stack():
    model = _model(4)
    values = Fragmenter.for_model(model, lambda m: m.blocks, 3).get(model, 0)
    outside = [model.embed, model.final_norm.weight, model.head]
    assert len(values) == len(outside)
    for a, b in zip(values, outside):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("H,P,tau", [(1, 1, 0), (5, 1, 0), (8, 4, 1), (12, 3, 3), (100, 4, 10), (6, 6, 0)])
def test_schedule_matches_closed_form(H, P, tau):
    T = 5 * H
    for p in range(P):
        steps = [t for t in range(1, T + 1) if schedule.synced_fragment(t, H, P) == p]
        assert steps == [(p + 1) * H // P + k * H for k in range(T) if (p + 1) * H // P + k * H <= T]
        assert steps == schedule.sync_steps(p, H, P, T)
        applied = [t for t in range(1, T + 1) if schedule.applied_fragment(t, H, P, tau) == p]
        assert applied == [t + tau for t in steps if t + tau <= T]
    # exactly one fragment leaves every H / P steps
    events = [t for t in range(1, T + 1) if schedule.synced_fragment(t, H, P) is not None]
    assert events == list(range(H // P, T + 1, H // P))


def test_router_schedule():
    assert [t for t in range(13) if schedule.router_synced(t, 4)] == [4, 8, 12]
    assert not any(schedule.router_synced(t, 0) for t in range(13))


def test_fragmenter_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        Fragmenter(5, 3)
    with pytest.raises(ValueError, match="fragment must be in"):
        Fragmenter.for_model(_model(4), lambda m: m.blocks, 3).get(_model(4), 3)


@pytest.mark.parametrize("L,P", [(4, 3), (6, 4), (4, 5), (2, 2)])
def test_balanced_fragments_partition_every_parameter_exactly_once(L, P):
    model = _model(L)
    frag = Fragmenter.for_model(model, lambda m: m.blocks, P, "balanced")
    counts = jax.tree.map(jnp.zeros_like, model)
    for p in range(P):
        counts = frag.put(counts, p, [v + 1 for v in frag.get(counts, p)])
    assert all(np.all(c == 1) for c in jax.tree.leaves(counts))
    assert sum(frag.nbytes(model, p) for p in range(P)) == sum(x.nbytes for x in jax.tree.leaves(model))


def test_balanced_fragments_cut_the_peak_on_a_real_vocabulary():
    """32k vocabulary, untied: embeddings and head no longer share fragment 0 (same total bytes)."""
    config = TransformerConfig(num_layers=6, dim=128, num_heads=4, vocab_size=32_000)
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    sizes = {}
    for pattern in ("strided", "balanced"):
        frag = Fragmenter.for_model(abstract, lambda m: m.blocks, 4, pattern)
        sizes[pattern] = [frag.nbytes(abstract, p) for p in range(4)]
    assert sum(sizes["strided"]) == sum(sizes["balanced"])
    assert max(sizes["strided"]) >= 1.5 * max(sizes["balanced"])
    balanced = Fragmenter.for_model(abstract, lambda m: m.blocks, 4, "balanced")
    holders = [p for p in range(4) if any(v.shape == abstract.embed.shape for v in balanced.get(abstract, p))]
    head_holders = [p for p in range(4) if any(v.shape == abstract.head.shape for v in balanced.get(abstract, p))]
    assert len(holders) == 1 and len(head_holders) == 1 and holders != head_holders
