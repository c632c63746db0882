"""Shared by the sharded-island tests: a small Transformer, its batches, and DiLoCo objects over
replicated or sharded islands (R = 2; the inner optimizer is SGD with momentum, see
`tests/test_sharded_training.py`)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eqx_diloco import DiLoCo, fsdp_specs
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
        state, metrics = diloco.step(state, batch(t)[: diloco.num_replicas])
        losses.append(np.asarray(metrics["loss"]))
    return state, np.stack(losses)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def finished_model(diloco, state):
    return [np.asarray(x) for x in jax.tree.leaves(diloco.global_model(diloco.finish(state)))]
