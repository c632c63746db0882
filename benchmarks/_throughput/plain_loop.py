"""The baseline the inner step is measured against: a plain optax training step, with the
layers scanned (as the model runs them) or unrolled one by one."""

from __future__ import annotations


def plain_optimizer(train, model):
    """AdamW like the trainer's inner optimizer, built here from optax directly."""
    import optax

    decay_steps = max(train.steps, train.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, train.lr, train.warmup_steps, decay_steps,
                                                  train.lr * train.min_lr_ratio)
    adamw = optax.adamw(schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
                        mask=model.weight_decay_mask())
    return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw) if train.grad_clip > 0 else adamw


def unrolled_logits(model, tokens):
    """The model's forward pass with a Python loop over layers instead of `lax.scan`."""
    import equinox as eqx
    import jax

    from models.transformer import rotary_tables

    cfg = model.config
    cos, sin = rotary_tables(tokens.shape[0], cfg.head_dim, cfg.rope_base)
    x = model.embed[tokens]
    params, static = eqx.partition(model.blocks, eqx.is_array)
    for i in range(cfg.num_layers):
        block = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)
        x, _ = block(x, cos, sin)
    x = model.final_norm(x)
    return x @ (model.embed.T if model.head is None else model.head)


def unrolled_loss(model, tokens):
    """Mean next-token cross entropy with the unrolled forward pass (dense models)."""
    import jax
    import jax.numpy as jnp

    logits = jax.vmap(lambda t: unrolled_logits(model, t))(tokens[:, :-1])
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1))


def scan_loss(model, tokens):
    from models.transformer import lm_loss

    return lm_loss(model, tokens)[0]


def make_plain_step(optimizer, static, loss_fn=scan_loss):
    """`step(params, opt_state, tokens) -> (params, opt_state, loss)`: jit, params and state donated."""
    import equinox as eqx
    import jax
    import optax

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), tokens))(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes float and int32
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
