"""A model that is not from `models/`: a residual MLP regressor with a stacked layer axis."""

import equinox as eqx
import jax
import jax.numpy as jnp

IN_DIM, WIDTH, DEPTH = 4, 16, 4


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return x + jax.nn.gelu(self.linear(x))


class StackedMLP(eqx.Module):
    """A residual MLP regressor whose blocks live in one stacked module (leading layer axis)."""

    embed: eqx.nn.Linear
    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(IN_DIM, WIDTH, key=k_embed)
        make = lambda k: Block(eqx.nn.Linear(WIDTH, WIDTH, key=k))  # noqa: E731
        self.blocks = eqx.filter_vmap(make)(jax.random.split(k_blocks, DEPTH))
        self.head = eqx.nn.Linear(WIDTH, "scalar", key=k_head)

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, block_params):
            return eqx.combine(block_params, static)(h), None

        h, _ = jax.lax.scan(layer, self.embed(x), params)
        return self.head(h)


def loss_fn(model, batch, key):
    x, y = batch
    pred = jax.vmap(model)(x)
    return jnp.mean((pred - y) ** 2), {"mse": jnp.mean((pred - y) ** 2)}


def make_batch(step: int, num_replicas: int, batch_size: int = 16):
    """Replica r's batch at `step`: y = sin(x . w) on fresh Gaussian inputs."""
    key = jax.random.fold_in(jax.random.key(1234), step)
    x = jax.random.normal(key, (num_replicas, batch_size, IN_DIM))
    w = jnp.linspace(-1.0, 1.0, IN_DIM)
    return x, jnp.sin(x @ w)
