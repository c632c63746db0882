"""The inner optimizer (per replica) and the outer optimizer (on outer gradients)."""

import jax
import optax

from .config import DiLoCoConfig, OptimConfig, TrainConfig


def inner_schedule(train: TrainConfig, peak: float | None = None) -> optax.Schedule:
    """Linear warm-up to `peak` (default `train.lr`), then cosine decay to `peak * train.min_lr_ratio`."""
    peak = train.lr if peak is None else peak
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=train.warmup_steps,
        decay_steps=max(train.steps, train.warmup_steps + 1),
        end_value=peak * train.min_lr_ratio,
    )


def muon_dimensions(params):
    """Which leaves Muon orthogonalizes: the layers' stacked weight matrices (3 or more axes: the
    last two are the matrix, the leading ones the layer (and expert) index). Embeddings, head,
    norm gains (stacked: 2 axes) and biases get None, so AdamW updates them."""
    def dims(x):
        if getattr(x, "ndim", 0) < 3:
            return None
        return optax.contrib.MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

    return jax.tree.map(dims, params)


def inner_optimizer(train: TrainConfig, weight_decay_mask, optim: OptimConfig | None = None) -> optax.GradientTransformation:
    """The per-replica optimizer with warm-up + cosine schedule and global-norm gradient clipping:
    AdamW, or (`optim.inner == "muon"`) Muon on the stacked matrices and AdamW on the rest."""
    optim = optim or OptimConfig()
    if optim.inner == "muon":
        inner = optax.contrib.muon(
            inner_schedule(train, optim.muon_lr), beta=optim.muon_momentum, weight_decay=train.weight_decay,
            weight_decay_mask=weight_decay_mask, adam_learning_rate=inner_schedule(train), adam_b1=train.b1,
            adam_b2=train.b2, adam_weight_decay=train.weight_decay, muon_weight_dimension_numbers=muon_dimensions,
        )
    else:
        inner = optax.adamw(
            inner_schedule(train), b1=train.b1, b2=train.b2, weight_decay=train.weight_decay, mask=weight_decay_mask
        )
    if train.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train.grad_clip), inner)
    return inner


def outer_optimizer(diloco: DiLoCoConfig) -> optax.GradientTransformation:
    """SGD applied to the outer gradient `global - mean(replicas)` as if it were a gradient."""
    momentum = diloco.outer_momentum or None  # optax.sgd keeps no momentum buffer for None
    return optax.sgd(diloco.outer_lr, momentum=momentum, nesterov=diloco.nesterov and momentum is not None)
