"""Cheap compile checks: abstract evaluation of state init and every step function."""

import jax
import pytest

from eqx_diloco.lm import Trainer


def _abstract_tokens(trainer):
    c = trainer.config
    return jax.ShapeDtypeStruct((c.diloco.num_replicas, c.train.batch_size, c.train.seq_len + 1), "int32")


CONFIGS = {
    "dense-diloco": dict(),
    "dense-ddp": dict(algorithm="ddp"),
    "tied-4-replicas": dict(model=dict(tie_embeddings=True), diloco=dict(num_replicas=4)),
    "moe-P1": dict(model=dict(kind="moe", num_experts=4, top_k=2)),
    "moe-P3": dict(model=dict(kind="moe", num_experts=4, top_k=1), diloco=dict(num_fragments=3, sync_period=6)),
    "moe-P3-router-sync": dict(
        model=dict(kind="moe", num_experts=4, top_k=2),
        diloco=dict(num_fragments=3, sync_period=6, router_sync_period=3, overlap_steps=1),
    ),
    "stream-P2-strided": dict(model=dict(num_layers=4), diloco=dict(num_fragments=2, sync_period=4)),
    "stream-P3-sequential": dict(
        model=dict(num_layers=4), diloco=dict(num_fragments=3, sync_period=6, fragment_pattern="sequential")
    ),
    "stream-P5-L+1": dict(model=dict(num_layers=4), diloco=dict(num_fragments=5, sync_period=10, overlap_steps=1)),
    "stream-int4-ef": dict(diloco=dict(num_fragments=3, sync_period=6, quantize="int4", error_feedback=True)),
    # The Llama layout (SwiGLU, one key/value head, q/k/v biases), streamed, with remat.
    "llama-gqa-P3": dict(model=dict(mlp="swiglu", num_kv_heads=1, qkv_bias=True, ffn_dim=40, num_layers=4,
                                    remat="dots"),
                         diloco=dict(num_fragments=3, sync_period=6)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eval_shape_of_init_and_steps(make_config, name):
    trainer = Trainer(make_config(**CONFIGS[name]), verbose=False)
    state = trainer.abstract_state
    R = trainer.config.diloco.num_replicas
    assert all(x.shape[0] == R for x in jax.tree.leaves(state.params))
    new_state, metrics = jax.eval_shape(trainer.inner_step, state, _abstract_tokens(trainer))
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert metrics["loss"].shape == (R,)
    if trainer.outer is not None:
        for p in range(trainer.num_fragments):
            synced, finite = jax.eval_shape(trainer.outer._fns["sync"][p], state)  # top level: jitted with compiler options
            merged = jax.eval_shape(trainer.outer._fns["merge"][p], state)
            assert jax.tree.structure(synced) == jax.tree.structure(merged) == jax.tree.structure(state)
            assert finite.shape == (R,)
            # The overlapped (tau > 0) programs: extract + exchange on the communication
            # devices (launch), and putting the result back (install).
            inputs = jax.eval_shape(trainer.outer._fns["extract"][p], state)
            outputs = jax.eval_shape(trainer.outer._fns["launch"][p], *inputs)
            installed = jax.eval_shape(trainer.outer._fns["install"][p], state, outputs[0], outputs[1], outputs[3])
            assert jax.tree.structure(installed) == jax.tree.structure(state)
            assert outputs[2].shape == (R,)
