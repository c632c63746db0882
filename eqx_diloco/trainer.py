"""The host loop: dispatch steps, run outer syncs on schedule, log, evaluate, checkpoint.

Step t+1 is dispatched before step t's metrics are read (so the host never idles the
devices while it formats a log line); only evaluations and the end block.
"""

import dataclasses
import functools
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from models import Transformer
from models.moe import usage_entropy
from models.transformer import lm_loss

from . import schedule
from .checkpoint import Checkpointer
from .config import Config, ConfigError, validate
from .data import TokenBatches, load_tokens
from .diagnostics import router_drift
from .fragments import Fragmenter
from .groups import make_groups
from .mesh import make_meshes
from .metrics import MetricsLog, ProgressDisplay, write_config
from .optimizers import inner_optimizer, inner_schedule, outer_optimizer
from .outer import OuterSync, PendingSync, sync_nbytes
from .replica_values import ReplicaGather, replicated_value
from .state import TrainState, build_state, init_state, state_shardings
from .step import make_inner_step


class NonFiniteError(RuntimeError):
    """A replica produced a NaN/Inf loss or outer gradient under `--train.on-nonfinite stop`."""


def global_model(state: TrainState) -> Transformer:
    """The model to evaluate: theta_g for DiLoCo, replica 0 for ddp (all replicas are equal)."""
    if state.global_params is not None:
        return state.global_params
    return jax.tree.map(lambda x: x[0], state.params)


@eqx.filter_jit
def eval_loss(state: TrainState, tokens) -> jax.Array:
    """Mean next-token cross entropy of the global model on `tokens` (no auxiliary losses)."""
    return lm_loss(global_model(state), tokens)[1]["ce"]


def place(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process computed in full (each keeps its shards)."""
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


@dataclasses.dataclass
class Trainer:
    """Builds everything a run needs from a validated `Config` and runs it.

    **Arguments:**

    - `config`: the run's configuration.
    - `verbose`: print progress (process 0 only in multi-process runs).
    """

    config: Config
    verbose: bool = True

    def __post_init__(self):
        config = self.config
        validate(config)
        self.is_main = jax.process_index() == 0
        self.mesh, self.comm_mesh = make_meshes(config)
        d, t = config.diloco, config.train
        self.diloco = config.algorithm == "diloco"
        self.num_fragments = d.num_fragments if self.diloco else 1
        tokens = load_tokens(config.data, config.model.vocab_size, t.seed)
        self.batches = TokenBatches(
            tokens,
            num_replicas=d.num_replicas,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            eval_fraction=config.data.eval_fraction,
            seed=t.seed,
        )
        abstract_model = eqx.filter_eval_shape(Transformer, config.model, key=jax.random.key(0))
        self.groups = make_groups(config, abstract_model) if self.diloco else ()
        self.fragmenter = self.groups[0].fragmenter if self.diloco else Fragmenter(config.model.num_layers, 1)
        # With its own sync period, the router group comes after the P fragments.
        self.router_group = self.num_fragments if self.diloco and d.router_sync_period else None
        self.moe = config.model.kind == "moe"
        if self.moe and self.diloco:
            flags = tuple(jax.tree.leaves(abstract_model.router_mask()))
            self.router_drift = jax.jit(lambda params: router_drift(params, flags))
        self.inner_opt = inner_optimizer(t, abstract_model.weight_decay_mask())
        self.outer_opt = outer_optimizer(d)
        self.lr_schedule = inner_schedule(t)
        abstract_state = eqx.filter_eval_shape(
            lambda: build_state(config, self.groups, self.inner_opt, self.outer_opt)
        )
        self.shardings = state_shardings(abstract_state, self.mesh)
        self.abstract_state = abstract_state
        skip = t.on_nonfinite == "skip"
        self.inner_step = make_inner_step(self.mesh, self.inner_opt, ddp=not self.diloco, skip_nonfinite=skip)
        self.outer = None
        param_bytes = sync_nbytes([x.shape for x in jax.tree.leaves(abstract_model)], "none")
        if self.diloco:
            self.outer = OuterSync(
                self.mesh, self.groups, self.outer_opt, d.quantize, d.alpha, skip, d.error_feedback, self.shardings,
                comm_mesh=self.comm_mesh,
            )
            self.group_bytes = [self.outer.nbytes(abstract_state, g) for g in range(len(self.groups))]
        else:
            self.group_bytes = []
        self.ddp_step_bytes = param_bytes  # one full float32 gradient per step
        self.batch_sharding = NamedSharding(self.mesh, P("diloco", "data"))
        self.eval_tokens = place(self.batches.eval_batch(t.eval_sequences), NamedSharding(self.mesh, P()))
        self.pending: dict[int, PendingSync] = {}  # launched syncs by group, not yet installed
        self.gather = ReplicaGather(timeout_s=max(60, 4 * config.dist.heartbeat_timeout_s))
        ck = config.checkpoint
        self.checkpointer = Checkpointer(ck.dir or config.run_dir / "checkpoints", every=ck.every, keep=ck.keep)

    # -- schedule ---------------------------------------------------------------------

    def events(self, t: int) -> tuple[int | None, int | None]:
        """(fragment whose sync starts after step t, fragment merged after step t)."""
        if not self.diloco:
            return None, None
        d = self.config.diloco
        return (
            schedule.synced_fragment(t, d.sync_period, self.num_fragments),
            schedule.applied_fragment(t, d.sync_period, self.num_fragments, d.overlap_steps),
        )

    def sent_bytes_at(self, t: int) -> int:
        """Bytes one replica sends for synchronisation at step t."""
        if not self.diloco:
            return self.ddp_step_bytes
        synced, _ = self.events(t)
        sent = 0 if synced is None else self.group_bytes[synced]
        if self.router_due(t):
            sent += self.group_bytes[self.router_group]
        return sent

    def router_due(self, t: int) -> bool:
        """Whether the router group takes its own outer step after step t."""
        return self.router_group is not None and schedule.router_synced(t, self.config.diloco.router_sync_period)

    def outer_steps(self, state: TrainState, t: int) -> tuple[TrainState, jax.Array | None, int | None, int | None]:
        """Run the syncs and merges due after step t. Returns (state, finite flags, synced, applied).

        With tau = 0 a sync and its merge are one program. With tau > 0 the sync is launched
        (on the communication devices, if any) and the host moves on; tau steps later its
        result is installed and merged. `finite` belongs to the sync that finished here.
        """
        synced, applied = self.events(t)
        finished = []  # (R,) finite flags of the syncs whose results arrived at this step
        if self.router_due(t):  # routers are small: a blocking sync, merged at once
            state, finite = self.outer.sync_and_merge(state, self.router_group)
            finished.append(finite)
        if synced is not None and synced == applied:  # tau = 0: apply at once
            state, finite = self.outer.sync_and_merge(state, synced)
            finished.append(finite)
        else:
            if applied is not None:
                if applied in self.pending:  # else installed early (evaluation, checkpoint) or restored
                    state, finite = self.outer.install(state, self.pending.pop(applied))
                    finished.append(finite)
                state = self.outer.merge(state, applied)
            if synced is not None:
                self.pending[synced] = self.outer.launch(state, synced)
        finite = functools.reduce(jnp.logical_and, finished) if finished else None
        return state, finite, synced, applied

    def install_pending(self, state: TrainState) -> TrainState:
        """Wait for every launched sync and put its result into the state (merges stay scheduled).

        The global params then read as if the syncs had been blocking, which is what an
        evaluation or a checkpoint must see.
        """
        for group in sorted(self.pending):
            state, finite = self.outer.install(state, self.pending.pop(group))
            self._check_finite(int(replicated_value(state.step)), "outer gradient", self.gather({"f": finite})["f"])
        return state

    # -- the loop -----------------------------------------------------------------------

    def initial_state(self) -> tuple[TrainState, int]:
        restored = self.checkpointer.restore_latest(self.abstract_state, self.shardings, self.config)
        if restored is not None:
            return restored
        return init_state(self.config, self.mesh, self.groups, self.inner_opt, self.outer_opt), 0

    def _check_finite(self, t: int, what: str, values: np.ndarray) -> list[int]:
        bad = [r for r, ok in enumerate(values) if not ok]
        if bad and self.config.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {what} in replica {bad[0]} at step {t} (--train.on-nonfinite stop; "
                f"use skip to drop that replica's contribution)"
            )
        return bad

    def run(self) -> dict[str, Any]:
        """Train to `--train.steps`. Returns a summary (final eval loss, bytes, steps/s)."""
        config, t_cfg = self.config, self.config.train
        self._start_time = time.perf_counter()
        state, start = self.initial_state()
        show = self.verbose and self.is_main
        if start >= t_cfg.steps:
            if show:
                print(f"run in {config.run_dir} already finished at step {start}; nothing to do")
            return {"finished": True, "step": start}
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            write_config(config.run_dir, config)
        log = MetricsLog(config.run_dir, resume_step=start, enabled=self.is_main)
        display = ProgressDisplay(t_cfg.steps, start, enabled=show)
        if start and show:
            display.log(f"resumed from checkpoint at step {start}")

        sent = sum(self.sent_bytes_at(s) for s in range(1, start + 1))
        peak = max([self.sent_bytes_at(s) for s in range(1, start + 1)], default=0)
        tokens_per_step = config.diloco.num_replicas * t_cfg.batch_size * t_cfg.seq_len
        pending = None  # step t's device-side metrics, read after step t+1 is dispatched
        eval_loss_value = None
        if start == 0 and t_cfg.eval_every:  # the starting point, so the curve shows the fall
            eval_loss_value = self._evaluate(state, 0, log, display if show else None)
        last_time, last_step = time.perf_counter(), start
        try:
            for step in range(start, t_cfg.steps):
                t = step + 1
                tokens = place(self.batches.batch(step), self.batch_sharding)
                state, metrics = self.inner_step(state, tokens)
                finite, synced, applied, drift = None, None, None, None
                if self.diloco:
                    if self.moe and (self.events(t)[0] is not None or self.router_due(t)):
                        drift = self.router_drift(state.params)  # how far routers drifted before this sync
                    state, finite, synced, applied = self.outer_steps(state, t)
                sent += self.sent_bytes_at(t)
                peak = max(peak, self.sent_bytes_at(t))
                if pending is not None:
                    last_time, last_step = self._emit(pending, log, display, tokens_per_step, last_time, last_step)
                pending = dict(step=t, metrics=metrics, finite=finite, synced=synced, applied=applied, sent=sent,
                               peak=peak, router_drift=drift)
                eval_due = t == t_cfg.steps or (t_cfg.eval_every and t % t_cfg.eval_every == 0)
                if eval_due or self.checkpointer.due(t) or t == t_cfg.steps:
                    state = self.install_pending(state)
                if eval_due:
                    last_time, last_step = self._emit(pending, log, display, tokens_per_step, last_time, last_step)
                    pending = None
                    eval_loss_value = self._evaluate(state, t, log, display if show else None)
                    last_time = time.perf_counter()  # do not charge the evaluation to training throughput
                if self.checkpointer.due(t) or t == t_cfg.steps:
                    self.checkpointer.save(t, state, config)
            if pending is not None:
                self._emit(pending, log, display, tokens_per_step, last_time, last_step)
            self.state = state
        finally:
            self.checkpointer.wait()
            display.close()
            log.close()
        return {
            "finished": True,
            "step": t_cfg.steps,
            "eval_loss": eval_loss_value,
            "sent_bytes": sent,
            "peak_sync_bytes": peak,
        }

    def _evaluate(self, state: TrainState, t: int, log: MetricsLog, display: ProgressDisplay | None) -> float:
        value = float(replicated_value(eval_loss(state, self.eval_tokens)))
        log.write({"step": t, "eval_loss": value})
        if display is not None:
            display.log(f"step {t:>6}  eval_loss {value:.4f}")
        return value

    def _emit(self, pending, log, display, tokens_per_step, last_time, last_step):
        """Read step t's metrics (already computed), check them, log them. Returns the new timer."""
        t = pending["step"]
        arrays = dict(pending["metrics"])
        if pending["finite"] is not None:
            arrays["sync_finite"] = pending["finite"]
        m = self.gather(arrays)
        skipped = self._check_finite(t, "loss", m["finite"])
        skipped_sync = self._check_finite(t, "outer gradient", m["sync_finite"]) if "sync_finite" in m else []
        event = pending["synced"] is not None or pending["applied"] is not None or pending["router_drift"] is not None
        if t % self.config.train.log_every and t != self.config.train.steps and not event:
            return last_time, last_step
        now = time.perf_counter()
        tokens_per_s = (t - last_step) * tokens_per_step / max(now - last_time, 1e-9)
        replica_losses = [float(x) for x in m["loss"]]
        record = {
            "step": t,
            "time": now - self._start_time,
            "loss": float(np.mean(replica_losses)),
            "replica_losses": replica_losses,
            "lr": float(self.lr_schedule(t - 1)),
            "grad_norm": float(np.mean(m["grad_norm"])),
            "tokens_per_s": tokens_per_s,
            "sent_bytes": pending["sent"],
            "peak_sync_bytes": pending["peak"],
            "synced_fragment": pending["synced"],
            "applied_fragment": pending["applied"],
        }
        if skipped:
            record["skipped_replicas"] = skipped
        if skipped_sync:
            record["skipped_sync_replicas"] = skipped_sync
        if "expert_usage" in m:
            record.update(self._moe_metrics(m))
        if pending["router_drift"] is not None:
            record["router_drift"] = float(replicated_value(pending["router_drift"]))
        log.write(record)
        status = f"loss {record['loss']:.4f}  {tokens_per_s:,.0f} tok/s"
        display.update(t, status)
        if not display.interactive and t % self.config.train.log_every == 0:
            display.log(f"step {t:>6}  {status}  sent {pending['sent'] / 1e6:.1f} MB")
        return now, t

    def _moe_metrics(self, m) -> dict[str, Any]:
        """Per layer, the normalized entropy of expert usage (1 = perfectly balanced)."""
        usage = np.asarray(m["expert_usage"])  # (R, layers, experts)
        return {"expert_balance": [float(x) for x in np.asarray(usage_entropy(jnp.asarray(usage.mean(0))))]}


def train(config: Config, *, verbose: bool = True) -> dict[str, Any]:
    """Validate `config`, then train. Raises `ConfigError` for bad input."""
    return Trainer(config, verbose=verbose).run()


__all__ = ["ConfigError", "NonFiniteError", "Trainer", "global_model", "train"]
