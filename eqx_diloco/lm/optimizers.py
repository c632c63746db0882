"""The inner optimizer (per replica) and the outer optimizer (on outer gradients)."""

import optax

from .config import DiLoCoConfig, TrainConfig


def inner_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warm-up to `train.lr`, then cosine decay to `train.lr * train.min_lr_ratio`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=train.lr,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=train.lr * train.min_lr_ratio,
    )


def inner_optimizer(train: TrainConfig, weight_decay_mask) -> optax.GradientTransformation:
    """AdamW with warm-up + cosine schedule and global-norm gradient clipping."""
    adamw = optax.adamw(
        inner_schedule(train), b1=train.b1, b2=train.b2, weight_decay=train.weight_decay, mask=weight_decay_mask
    )
    if train.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw)
    return adamw


def outer_optimizer(diloco: DiLoCoConfig) -> optax.GradientTransformation:
    """SGD applied to the outer gradient `global - mean(replicas)` as if it were a gradient."""
    momentum = diloco.outer_momentum or None  # optax.sgd keeps no momentum buffer for None
    return optax.sgd(diloco.outer_lr, momentum=momentum, nesterov=diloco.nesterov and momentum is not None)
