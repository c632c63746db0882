"""The `DiLoCo` core the CLI's config describes, and what the trainer applies to it: the LM
objective, the evaluation loss, placing host batches on the mesh, and counting the syncs' bytes."""

import dataclasses
import functools

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding

from models import Transformer, TransformerConfig
from models.transformer import lm_loss

from .._diloco import DiLoCo
from .._rare_programs import options_key, rare_program_options
from .._sharding import fsdp_specs
from .._state import TrainState
from ._devices import make_meshes
from .config import Config, ConfigError, error_feedback_argument, flag_names
from .optimizers import inner_optimizer, outer_optimizer


def new_model(config: TransformerConfig, key) -> Transformer:
    """A freshly initialised model, built by one compiled program: built eagerly, each of its
    initialisers' operations is a program of its own, dozens to compile on a cold start. It runs
    once, so a small model's is compiled unoptimised on CPU (`rare_program_options`).
    With `config.init_from`, the weights of that Hugging Face folder instead (`key` unused)."""
    if config.init_from is not None:
        from .hf import load_hf_weights

        return load_hf_weights(config)
    return _model_builder(options_key(rare_program_options(config.num_params())))(config, key)


def sync_options(config: Config) -> dict | None:
    """`compiler_options` of the sync programs and the global finite check: each runs once a sync, so
    unoptimised on CPU where the run's syncs over the model's parameters stay within the budget."""
    syncs = config.train.steps // config.diloco.sync_period + 1  # the last one: the final sync
    return rare_program_options(config.model.num_params(), runs=syncs)


@functools.cache
def _model_builder(options: tuple):
    """The compiled builder for one set of compiler options (`options_key`)."""
    return eqx.filter_jit(lambda config, key: Transformer(config, key=key), compiler_options=dict(options) or None)


def global_model(state: TrainState) -> Transformer:
    """The model to evaluate: theta_g for DiLoCo, replica 0 for ddp (all replicas are equal)."""
    if state.global_params is not None:
        return state.global_params
    return jax.tree.map(lambda x: x[0], state.params)


@eqx.filter_jit
def eval_loss(model: Transformer, tokens) -> jax.Array:
    """Mean next-token cross entropy of `model` on `tokens` (no auxiliary losses). It keeps XLA's
    defaults, unlike the syncs: a run evaluates every `--train.eval-every` steps, and unoptimised the
    default model's evaluation took twice as long (benchmarks/results/rare_programs.md)."""
    return lm_loss(model, tokens)[1]["ce"]


def place(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process computed in full (each keeps its shards)."""
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def lm_objective(dropout: float):
    """The LM's `loss_fn(model, tokens, key)` for `DiLoCo`: next-token loss (+ MoE aux loss)."""

    def loss_fn(model: Transformer, tokens, key):
        return lm_loss(model, tokens, key=key if dropout > 0 else None)

    return loss_fn


def transformer_specs(fsdp: int, tensor: int):
    """The bundled Transformer's layout inside an island: its tensor-parallel rules, FSDP on the free
    dimensions (and over `fsdp x tensor` for arrays the tensor rules leave whole)."""

    def specs(model: Transformer):
        base = model.tensor_specs() if tensor > 1 else None
        return fsdp_specs(model, fsdp, layers=lambda m: m.blocks, base=base, tensor=tensor)

    return specs


def make_diloco(config: Config, abstract_model: Transformer) -> DiLoCo:
    """The core `DiLoCo` object the CLI config describes, set up for `abstract_model`'s shape."""
    d, t = config.diloco, config.train
    try:  # the core's errors name its arguments; say this CLI's flags
        mesh, comm_mesh = make_meshes(config)
        diloco = config.algorithm == "diloco"
        core = DiLoCo(
            loss_fn=lm_objective(config.model.dropout),
            layers=lambda m: m.blocks,
            num_replicas=d.num_replicas,
            sync_period=d.sync_period,
            inner_optimizer=inner_optimizer(t, abstract_model.weight_decay_mask(), config.optim),
            outer_optimizer=outer_optimizer(d),
            num_fragments=d.num_fragments if diloco else 1,
            fragment_pattern=d.fragment_pattern,
            overlap_steps=d.overlap_steps if diloco else 0,
            alpha=d.alpha if diloco else 0.0,
            quantize=d.quantize if diloco else "none",
            error_feedback=error_feedback_argument(d) if diloco else False,
            topk=d.topk if diloco else None,
            topk_chunk=d.topk_chunk,
            exchange=d.exchange if diloco else "auto",
            outer_overlap=d.outer_overlap if diloco else "none",
            routers=lambda m: m.router_mask(),
            router_sync_period=d.router_sync_period if diloco else 0,
            on_nonfinite=t.on_nonfinite,
            check_losses=False,  # the trainer checks the exchanged losses itself: every process stops at one step
            algorithm=config.algorithm,
            mesh=mesh,
            comm_mesh=comm_mesh,
            param_specs=transformer_specs(config.mesh.fsdp, config.mesh.tensor),
            outer_state_memory=d.outer_state_memory if diloco else "device",
            sync_compiler_options=sync_options(config),
        )
        core.abstract(abstract_model)
    except ConfigError as e:
        raise ConfigError(flag_names(str(e))) from None
    return core


@dataclasses.dataclass
class Traffic:
    """Bytes the syncs sent so far: `sent` as the core counts them, `wire` as they travel, and `peak`
    the most in one step."""

    sent: int = 0
    wire: int = 0
    peak: int = 0

    def add_step(self, core: DiLoCo, t: int) -> None:
        """Count the syncs of step `t`."""
        sent = core.sent_bytes_at(t)
        self.sent, self.wire, self.peak = self.sent + sent, self.wire + core.wire_bytes_at(t), max(self.peak, sent)
