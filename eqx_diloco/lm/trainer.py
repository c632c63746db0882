"""The host loop: dispatch steps, run outer syncs on schedule, log, evaluate, checkpoint.

Step t+1 is dispatched before step t's metrics are read (so the host never idles the
devices while it formats a log line); only evaluations and the end block. Across processes,
the exchange of step t's per-replica values runs in the background and is read
`--dist.metrics-lag` steps later, so its round trips over a slow link do not delay every step.
"""

import collections
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import Transformer
from models.moe import usage_entropy
from models.transformer import lm_loss

from ._banner import finished_message, format_summary
from .._diloco import DiLoCo
from .._elastic import REFORM_EXIT_CODE, IslandSnapshots
from .._errors import NonFiniteError
from ._tensorboard import TensorBoardLog
from .._tree import row_finite
from .._checkpoint import Checkpointer, CheckpointSaveError
from .config import Config, ConfigError, flag_names, validate
from .data import TokenBatches, load_tokens
from .diagnostics import router_drift
from ._devices import fail_for_test, make_meshes
from .metrics import LogWriteError, MetricsLog, ProgressDisplay, set_aside_earlier_run, write_config
from .optimizers import inner_optimizer, inner_schedule, outer_optimizer
from .._replica_values import ReplicaGather, replicated_value
from .resume import incompatibility
from .._state import TrainState


def global_model(state: TrainState) -> Transformer:
    """The model to evaluate: theta_g for DiLoCo, replica 0 for ddp (all replicas are equal)."""
    if state.global_params is not None:
        return state.global_params
    return jax.tree.map(lambda x: x[0], state.params)


@eqx.filter_jit
def eval_loss(model: Transformer, tokens) -> jax.Array:
    """Mean next-token cross entropy of `model` on `tokens` (no auxiliary losses)."""
    return lm_loss(model, tokens)[1]["ce"]


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every float leaf of `tree` is finite (one boolean scalar, computed where the arrays live)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class TrainingStopped(Exception):
    """SIGTERM or SIGHUP stopped training at a step boundary (after a checkpoint of that step).

    `signum` is the signal, `step` the last step trained; the message is one line.
    """

    def __init__(self, message: str, *, signum: int, step: int):
        super().__init__(message)
        self.signum, self.step = signum, step


class Reforming(Exception):
    """The launcher asked (SIGUSR1) to re-form the run so an island can rejoin: every island
    stopped at the same sync boundary, after writing its snapshot of it."""

    def __init__(self, step: int):
        super().__init__(f"re-forming at step {step} so an island can rejoin")
        self.step = step


def island_layout(num_replicas: int) -> tuple[tuple[int, ...], int, list[dict]]:
    """(the island of each replica, the run's full island count, events to log), from the
    variables the elastic launcher sets; without them replica r is island r of R."""
    islands = os.environ.get("EQX_DILOCO_ISLANDS")
    ids = tuple(int(x) for x in islands.split(",")) if islands else tuple(range(num_replicas))
    if len(ids) != num_replicas:
        raise ConfigError(f"--diloco.num-replicas {num_replicas} does not match the {len(ids)} live islands "
                          f"the launcher started ({islands})")
    total = int(os.environ.get("EQX_DILOCO_NUM_ISLANDS", num_replicas))
    events = json.loads(os.environ.get("EQX_DILOCO_ELASTIC_EVENTS", "[]"))
    return ids, total, events


def place(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process computed in full (each keeps its shards)."""
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def lm_objective(dropout: float):
    """The LM's `loss_fn(model, tokens, key)` for `DiLoCo`: next-token loss (+ MoE aux loss)."""

    def loss_fn(model: Transformer, tokens, key):
        return lm_loss(model, tokens, key=key if dropout > 0 else None)

    return loss_fn


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
            inner_optimizer=inner_optimizer(t, abstract_model.weight_decay_mask()),
            outer_optimizer=outer_optimizer(d),
            num_fragments=d.num_fragments if diloco else 1,
            fragment_pattern=d.fragment_pattern,
            overlap_steps=d.overlap_steps if diloco else 0,
            alpha=d.alpha if diloco else 0.0,
            quantize=d.quantize if diloco else "none",
            error_feedback=d.error_feedback and diloco,
            exchange=d.exchange if diloco else "auto",
            outer_overlap=d.outer_overlap if diloco else "none",
            routers=lambda m: m.router_mask(),
            router_sync_period=d.router_sync_period if diloco else 0,
            on_nonfinite=t.on_nonfinite,
            algorithm=config.algorithm,
            mesh=mesh,
            comm_mesh=comm_mesh,
        )
        core.abstract(abstract_model)
    except ConfigError as e:
        raise ConfigError(flag_names(str(e))) from None
    return core


@dataclasses.dataclass
class Trainer:
    """The CLI's language-model trainer: builds a `DiLoCo` core from a validated `Config` and runs it.

    **Arguments:**

    - `config`: the run's configuration.
    - `verbose`: print progress (process 0 only in multi-process runs).
    """

    config: Config
    verbose: bool = True
    # The first failed metrics.jsonl or TensorBoard write (a full or read-only disk), if any: see `_write`.
    log_error = None

    def __post_init__(self):
        config = self.config
        validate(config)
        self.is_main = jax.process_index() == 0
        d, t = config.diloco, config.train
        self.diloco = config.algorithm == "diloco"
        self.num_fragments = d.num_fragments if self.diloco else 1
        tokens = load_tokens(config.data, config.model.vocab_size, t.seed)
        self.elastic = config.elastic.enabled
        self.islands, num_islands, self.elastic_events = island_layout(d.num_replicas)
        if self.elastic and jax.process_count() != d.num_replicas:
            raise ConfigError(f"--elastic.enabled needs one replica per process: run {d.num_replicas} processes "
                              f"for --diloco.num-replicas {d.num_replicas} (got {jax.process_count()})")
        self.batches = TokenBatches(
            tokens,
            num_replicas=d.num_replicas,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
            eval_fraction=config.data.eval_fraction,
            seed=t.seed,
            split=config.data.split,
            islands=self.islands,
            num_islands=num_islands,
        )
        self.abstract_model = eqx.filter_eval_shape(Transformer, config.model, key=jax.random.key(0))
        self.core = make_diloco(config, self.abstract_model)
        core = self.core
        self.mesh, self.comm_mesh = core.mesh, core.comm_mesh
        self.groups, self.router_group, self.group_bytes = core.groups, core.router_group, core.group_bytes
        self.fragmenter = self.groups[0].fragmenter if self.diloco else None
        self.abstract_state, self.shardings = core.abstract_state, core.shardings
        self.inner_step, self.outer = core.inner_step, core.outer
        self.inner_opt, self.outer_opt = core.inner_optimizer, core.outer_optimizer
        self.ddp_step_bytes = core.ddp_step_bytes
        self.moe = config.model.kind == "moe"
        if self.moe and self.diloco:
            flags = tuple(jax.tree.leaves(self.abstract_model.router_mask()))
            self.router_drift = jax.jit(lambda state: router_drift(state.params, flags))
        self.lr_schedule = inner_schedule(t)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("diloco", "data"))
        # Eager anchors are per replica: one flag per row, read with the metrics. all_finite over
        # them would be a collective across processes, which on a slow link waits behind the
        # exchange just launched.
        self._row_finite = jax.jit(row_finite, out_shardings=NamedSharding(self.mesh, PartitionSpec("diloco")))
        self.eval_tokens = place(self.batches.eval_batch(t.eval_sequences), NamedSharding(self.mesh, PartitionSpec()))
        self.gather = ReplicaGather(timeout_s=max(60, 4 * config.dist.heartbeat_timeout_s))
        # Steps the other processes' per-step values may trail the loop (their exchange costs round
        # trips to the coordinator over the syncs' link); a single process has nothing to wait for.
        self.metrics_lag = config.dist.metrics_lag if jax.process_count() > 1 else 0
        ck = config.checkpoint
        self.checkpointer = Checkpointer(ck.dir or config.run_dir / "checkpoints", every=ck.every, keep=ck.keep)
        self.island = self.islands[jax.process_index()] if self.elastic else None
        self.snapshots = (IslandSnapshots(config.run_dir / "elastic" / f"island-{self.island}",
                                          keep=config.elastic.keep_snapshots) if self.elastic else None)

    # -- thin views of the core, for tests and benchmarks --------------------------------------

    def events(self, t: int) -> tuple[int | None, int | None]:
        return self.core.events(t)

    def sent_bytes_at(self, t: int) -> int:
        return self.core.sent_bytes_at(t)

    def router_due(self, t: int) -> bool:
        return self.core.router_due(t)

    def outer_steps(self, state: TrainState, t: int):
        return self.core.outer_steps(state, t)

    def install_pending(self, state: TrainState) -> TrainState:
        """Settle every in-flight sync (see `DiLoCo.settle`), checking its finite flags."""
        if not self.diloco:
            return state
        state, finished = self.core.settle(state)
        t = int(replicated_value(state.step))
        for finite in finished:
            self._check_sync(t, self.gather({"f": finite})["f"])
        if finished:
            self._check_global(t, all_finite(state.global_params))
        return state

    def final_sync(self, state: TrainState, t: int) -> tuple[TrainState, list[int]]:
        """After the last step `t`: `DiLoCo.finish`, so the evaluated and exported global model
        includes every inner step (`--train.final-sync`). Returns (state, the groups it synced)."""
        if not self.diloco or not self.config.train.final_sync:
            return state, []
        state = self.install_pending(state)  # flags of the syncs in flight, checked across processes
        stale = self.core.stale_groups(t)
        state = self.core.finish(state)
        self._check_global(t, all_finite(state.global_params))
        return state, stale

    # -- the loop -----------------------------------------------------------------------

    def resume_check(self, saved_config: dict, step: int) -> str | None:
        """Why a checkpoint written with `saved_config` at `step` cannot resume this run, or None."""
        return incompatibility(saved_config, self.config, step)

    def initial_state(self) -> tuple[TrainState, int]:
        """The newest compatible checkpoint's state, or a fresh one from `--train.seed`."""
        restore_step = self.config.checkpoint.restore_step
        if self.elastic and restore_step is None:
            # The live islands' newest sync boundary (any replica count); an island without its
            # own snapshot of it (one that rejoins) starts from theta_g.
            seed_key = jax.random.split(jax.random.key(self.config.train.seed))[1]
            key = jax.random.fold_in(jax.random.fold_in(seed_key, self.island), len(self.elastic_events))
            state = self.core.reform(self.snapshots, island=self.island, key=key)
            if state is not None:
                step = int(replicated_value(state.step))
                # Checkpoints past it were written by the islands before one was lost.
                self.superseded = self.checkpointer.supersede(step)
                return state, step
        state = self.core.restore(self.checkpointer, self.abstract_model, check=self.resume_check, step=restore_step)
        if state is not None:
            step = int(replicated_value(state.step))
            if restore_step is not None:
                self.superseded = self.checkpointer.supersede(step)
            return state, step
        model_key, replica_key = jax.random.split(jax.random.key(self.config.train.seed))
        return self.core.init(Transformer(self.config.model, key=model_key), key=replica_key), 0

    def _check_finite(self, t: int, what: str, values: np.ndarray) -> list[int]:
        bad = [r for r, ok in enumerate(values) if not ok]
        if bad and self.config.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {what} in replica {bad[0]} at step {t} (--train.on-nonfinite stop; "
                f"use skip to drop that replica's contribution)"
            )
        return bad

    def _all_skipped(self, t: int, what: str) -> NonFiniteError:
        return NonFiniteError(
            f"non-finite {what} in every replica at step {t}: --train.on-nonfinite skip has nothing left to "
            f"train on (lower --train.lr or --diloco.outer-lr, or resume an earlier checkpoint with "
            f"--checkpoint.restore-step)"
        )

    def _check_sync(self, t: int, values: np.ndarray) -> list[int]:
        """Finite flags of a finished sync: `stop` raises on any, `skip` when all replicas are out."""
        bad = self._check_finite(t, "outer gradient", values)
        if bad and len(bad) == len(values):
            raise self._all_skipped(t, "outer gradient")
        return bad

    def _check_global(self, t: int, flag: jax.Array | bool | None) -> None:
        """Stop (under either policy) if the global model is non-finite after an outer step."""
        if flag is not None and not (flag if isinstance(flag, bool) else bool(replicated_value(flag))):
            raise NonFiniteError(
                f"the global model is non-finite after the outer step at step {t} (--train.on-nonfinite "
                f"{self.config.train.on_nonfinite}); lower --diloco.outer-lr or --train.lr, or resume an earlier "
                f"checkpoint with --checkpoint.restore-step"
            )

    @contextlib.contextmanager
    def _stop_signals(self):
        """Record SIGTERM / SIGHUP for the loop, which stops at the next step boundary (all
        processes agree on it through the per-step metrics exchange). A second signal ends the
        process at once (the default action). Installed after `jax.distributed.initialize`, so it
        replaces JAX's preemption notifier, which would otherwise swallow SIGTERM."""
        self._signal_seen = 0  # this process's signal, 0 if none
        self._stop_signal = 0  # the signal every process agreed to stop on, 0 if none
        self._reform_due = False  # every island agreed to re-form at the next sync boundary
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self._signal_seen = signum
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_DFL)

        def reform_handler(signum, frame):  # the elastic launcher: an island wants to rejoin
            self._signal_seen = self._signal_seen or signum

        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        if self.elastic:
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, reform_handler)
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)

    def _stop_rows(self) -> Any:
        """(R,) rows of this process's signal number, for the per-step gather (every process
        publishes its own replicas' rows; the maximum is what all agree on)."""
        R = self.config.diloco.num_replicas
        if jax.process_count() == 1:
            return np.full((R,), self._signal_seen, np.int32)
        cache = self.__dict__.setdefault("_stop_arrays", {})
        if self._signal_seen not in cache:
            rows = np.full((R,), self._signal_seen, np.int32)
            cache[self._signal_seen] = jax.make_array_from_callback(
                (R,), NamedSharding(self.mesh, PartitionSpec("diloco")), lambda index: rows[index])
        return cache[self._signal_seen]

    def run(self) -> dict[str, Any]:
        """Train to `--train.steps`. Returns a summary (final eval loss, bytes, steps/s).

        Raises `NonFiniteError` on divergence (see `--train.on-nonfinite`), `TrainingStopped` after
        SIGTERM/SIGHUP (a checkpoint of the stop step is saved first), and `CheckpointSaveError`
        when an asynchronous save fails.
        """
        config, t_cfg = self.config, self.config.train
        self._start_time = time.perf_counter()
        self.superseded: list[int] = []
        state, start = self.initial_state()
        show = self.verbose and self.is_main
        if start >= t_cfg.steps:
            if show:
                print(finished_message(config, start), flush=True)
            return {"finished": True, "step": start}
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            # A fresh start in a folder holding another run (its checkpoints elsewhere or deleted)
            # keeps that run's metrics and config beside the new ones.
            kept = set_aside_earlier_run(config.run_dir) if start == 0 and not self.elastic_events else []
            if kept and show:
                print(f"{config.run_dir} held an earlier run but no checkpoint to resume in "
                      f"{self.checkpointer.directory}: starting from step 0; its files were kept as "
                      f"{', '.join(p.name for p in kept)}", flush=True)
            write_config(config.run_dir, config)
        log = MetricsLog(config.run_dir, resume_step=start, enabled=self.is_main)
        display = ProgressDisplay(t_cfg.steps, start, enabled=show)
        tb = None
        try:
            tb = TensorBoardLog(config.run_dir, resume_step=start, enabled=self.is_main)
            self._logs = (log, tb)
            with self._stop_signals():
                summary = self._loop(state, start, display, show)
        finally:
            try:
                self.checkpointer.wait()
            finally:
                display.close()
                log.close()
                if tb is not None:
                    tb.close()
        if show:
            print(format_summary(summary, config), flush=True)
        return summary

    def _loop(self, state: TrainState, start: int, display: ProgressDisplay, show: bool) -> dict[str, Any]:
        config, t_cfg = self.config, self.config.train
        T = t_cfg.steps
        if start and show:
            if self.elastic_events:
                display.log(f"re-formed at step {start} with islands {list(self.islands)}")
            else:
                display.log(f"resumed from checkpoint at step {start}")
        if self.superseded and show:
            display.log(f"resumed at step {start}: newer checkpoints {sorted(self.superseded)} moved aside")

        sent = sum(self.sent_bytes_at(s) for s in range(1, start + 1))
        peak = max([self.sent_bytes_at(s) for s in range(1, start + 1)], default=0)
        wire = sum(self.core.wire_bytes_at(s) for s in range(1, start + 1))
        tokens_per_step = config.diloco.num_replicas * t_cfg.batch_size * t_cfg.seq_len
        pending = None  # step t's device-side metrics, read after step t+1 is dispatched
        inflight: collections.deque = collections.deque()  # read, their cross-process exchange running
        eval_loss_value = None
        # Compilation is a phase of its own: say so, and how long it took once the first step ran.
        compile_start = time.perf_counter()
        if show:
            display.log("compiling the step programs..." + (" (cached programs load fast)" if start else ""))
            display.update(start, "compiling...")
        if self.diloco:  # the global model's finite check, first read a round or two in: compiled now
            check = self._row_finite if self.core.outer_overlap == "eager" else all_finite
            check.lower(state.global_params).compile()
        if start == 0 and t_cfg.eval_every:  # the starting point, so the curve shows the fall
            eval_loss_value = self._evaluate(state, 0, display if show else None)
        self._compile_note = None
        timer = (time.perf_counter(), start)  # when the last logged step was read, and which step
        final_synced: list[int] = []
        for step in range(start, T):
            t = step + 1
            self.checkpointer.poll()  # a failed asynchronous save stops the run here, not at the next save
            tokens = place(self.batches.batch(step), self.batch_sharding)
            # How far routers drifted before a sync (MoE only).
            drift_fn = self.router_drift if self.moe and self.diloco else None
            state, metrics = self.core.step(state, tokens, before_sync=drift_fn)
            fail_for_test(t)  # tests only: $EQX_DILOCO_TEST_FAIL_AT_STEP (see _devices.py)
            boundary = self.elastic and (metrics["synced_fragment"] is not None or metrics["applied_fragment"]
                                         is not None) and self.core.settled
            if step == start:  # the step programs (and those of the syncs due now) compiled in that call
                self._compile_note = f"compiled the step programs in {time.perf_counter() - compile_start:.1f} s"
            finite, drift = metrics.pop("sync_finite", None), metrics.pop("before_sync", None)
            synced, applied = metrics.pop("synced_fragment"), metrics.pop("applied_fragment")
            # After an outer step, whether theta_g is still finite (read with the step's metrics, one step late).
            global_finite = None
            if self.diloco and finite is not None:
                per_row = self.core.outer_overlap == "eager"
                global_finite = (self._row_finite if per_row else all_finite)(state.global_params)
            sent += self.sent_bytes_at(t)
            peak = max(peak, self.sent_bytes_at(t))
            wire += self.core.wire_bytes_at(t)
            if pending is not None:
                inflight.append(self._publish(pending))
                timer = self._emit_through(inflight, self.metrics_lag, display, tokens_per_step, timer)
            pending = dict(step=t, metrics=metrics, finite=finite, synced=synced, applied=applied, sent=sent,
                           wire=wire, peak=peak, router_drift=drift, global_finite=global_finite)
            final = t == T
            if boundary:
                # Step t's line first (its gather is where a lost island shows): an island never holds
                # a snapshot of a step whose metrics line is missing. Then the snapshot (it blocks until
                # step t is computed, once per sync; the write itself is asynchronous).
                inflight.append(self._publish(pending))
                pending = None
                timer = self._emit_through(inflight, 0, display, tokens_per_step, timer)
                self.snapshots.write(self.core.island_snapshot(state, island=self.island))
                if self._reform_due and not final:
                    self.snapshots.wait()
                    self.checkpointer.wait()
                    self.state = state
                    raise Reforming(t)
            stop = bool(self._stop_signal) and not final
            eval_due = final or bool(t_cfg.eval_every and t % t_cfg.eval_every == 0)
            save_due = self.checkpointer.due(t) or final or stop
            if eval_due or save_due:
                # Step t's values are read before the in-flight syncs settle, so its time is when it
                # was computed (waiting for a sync is the evaluation's or checkpoint's cost, not the step's).
                if pending is not None:
                    inflight.append(self._publish(pending))
                    pending = None
                state = self.install_pending(state)
                # Check step t's finiteness first: a diverged state must never be checkpointed.
                timer = self._emit_through(inflight, 0, display, tokens_per_step, timer)
                if self._stop_signal and not final and not stop:  # agreed on in that very exchange
                    stop = save_due = True
            if final:
                state, final_synced = self.final_sync(state, t)
                for g in final_synced:
                    sent += self.group_bytes[g]
                    wire += self.core.group_wire_bytes[g]
                if final_synced:  # its bytes belong in the counters a reader of metrics.jsonl sums
                    self._write({"step": t, "event": "final_sync", "groups": final_synced, "sent_bytes": sent,
                                 "wire_bytes": wire})
                if final_synced and show:
                    display.log(f"final sync of parameter group(s) {final_synced}: their inner steps since "
                                f"the last scheduled sync now reach the global model")
                if self.diloco and self.core.overlapped is not None and t_cfg.final_sync and show:
                    display.log("the last round's exchange of every parameter group landed in the global model")
            if eval_due:
                eval_loss_value = self._evaluate(state, t, display if show else None)
                timer = (time.perf_counter(), timer[1])  # do not charge the evaluation to training throughput
            if save_due:
                state = self.core.save(self.checkpointer, state, metadata=config, force=True)
            if stop:
                self.state = state
                self.checkpointer.wait()
                name = signal.Signals(self._stop_signal).name
                where = (f"checkpoint saved in {self.checkpointer.directory}; run the same command to resume"
                         if self.checkpointer.every > 0 else "checkpointing is off (--checkpoint.every 0): nothing saved")
                raise TrainingStopped(f"stopped by {name} at step {t}; {where}", signum=self._stop_signal, step=t)
        if pending is not None:
            inflight.append(self._publish(pending))
        self._emit_through(inflight, 0, display, tokens_per_step, timer)
        self.state = state
        return {
            "finished": True,
            "step": T,
            "eval_loss": eval_loss_value,
            "sent_bytes": sent,
            "wire_bytes": wire,
            "peak_sync_bytes": peak,
            "tokens": T * tokens_per_step,
            "ddp_bytes": T * self.ddp_step_bytes,
            "wall_time_s": time.perf_counter() - self._start_time,
            "run_dir": str(config.run_dir),
            "checkpoint_dir": str(self.checkpointer.directory),
            "final_sync_groups": final_synced,
        }

    def _write(self, record: dict[str, Any]) -> None:
        """One record into metrics.jsonl (non-finite numbers as null) and the TensorBoard events.

        A failed write asks every process to stop at the next step boundary with a checkpoint, as
        SIGTERM does (the CLI then reports `log_error` and exits 1)."""
        for log in self._logs:
            try:
                log.write(record)
            except LogWriteError as e:
                self.log_error = self.log_error or e
                self._signal_seen = self._signal_seen or signal.SIGTERM

    def _evaluate(self, state: TrainState, t: int, display: ProgressDisplay | None) -> float:
        value = float(replicated_value(eval_loss(self.core.global_params(state), self.eval_tokens)))
        self._write({"step": t, "eval_loss": value})
        if display is not None:
            display.log(f"step {t:>6}  eval_loss {value:.4f}")
        if not np.isfinite(value):
            raise NonFiniteError(
                f"the global model's eval loss is non-finite at step {t} (--train.on-nonfinite "
                f"{self.config.train.on_nonfinite}); lower --train.lr or --diloco.outer-lr, or resume an earlier "
                f"checkpoint with --checkpoint.restore-step"
            )
        return value

    def _publish(self, pending: dict[str, Any]) -> dict[str, Any]:
        """Read step t's values on this process (waits for step t) and start their exchange with
        the other processes, which `_emit` waits for."""
        arrays = dict(pending["metrics"])
        if pending["finite"] is not None:
            arrays["sync_finite"] = pending["finite"]
        arrays["stop_signal"] = self._stop_rows()  # every process's SIGTERM/SIGHUP, so all stop at one step
        global_finite = pending["global_finite"]
        if global_finite is not None and global_finite.ndim == 1:  # one flag per replica row
            arrays["global_finite"] = global_finite
        return dict(pending, gathered=self.gather.submit(arrays), read_at=time.perf_counter())

    def _emit_through(self, inflight: collections.deque, keep: int, display, tokens_per_step, timer):
        """Emit the published steps, oldest first, until at most `keep` remain in flight.

        Every process emits the same steps at the same point of the loop (the count decides, not
        which exchanges happen to have finished), so decisions taken from the gathered values (an
        agreed stop, a re-form) fall on the same step everywhere."""
        while len(inflight) > keep:
            timer = self._emit(inflight.popleft(), display, tokens_per_step, *timer)
        return timer

    def _emit(self, pending, display, tokens_per_step, last_time, last_step):
        """Check and log step t's gathered values (waiting for their exchange). Returns the new timer."""
        t = pending["step"]
        m = pending["gathered"].result()
        global_finite = pending["global_finite"]
        if "global_finite" in m:
            global_finite = bool(np.all(m.pop("global_finite")))
        agreed = int(np.max(m.pop("stop_signal")))
        if agreed == signal.SIGUSR1:
            self._reform_due = True
        else:
            self._stop_signal = self._stop_signal or agreed
        if self.elastic:
            self._progress(t)
        if self.elastic_events:  # the losses and rejoins that led to this run, once it trains again
            now_unix = time.time()
            for e in self.elastic_events:
                self._write({"step": t, **{k: v for k, v in e.items() if k != "detected_unix"},
                             "stalled_s": now_unix - e["detected_unix"]})
            self.elastic_events = []
        skipped = self._check_finite(t, "loss", m["finite"])
        skipped_sync = self._check_finite(t, "outer gradient", m["sync_finite"]) if "sync_finite" in m else []
        fatal = None
        if skipped and len(skipped) == len(m["finite"]):
            fatal = self._all_skipped(t, "loss")
        elif skipped_sync and len(skipped_sync) == len(m["sync_finite"]):
            fatal = self._all_skipped(t, "outer gradient")
        if fatal is None:
            try:
                self._check_global(t, global_finite)
            except NonFiniteError as e:
                fatal = e
        event = pending["synced"] is not None or pending["applied"] is not None or pending["router_drift"] is not None
        if self._compile_note is not None:
            display.log(self._compile_note)
            self._compile_note = None
        if t % self.config.train.log_every and t != self.config.train.steps and not event and fatal is None:
            return last_time, last_step
        now = pending["read_at"]  # when step t was done here, however late its exchange finished
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
            "wire_bytes": pending["wire"],
            "peak_sync_bytes": pending["peak"],
            "synced_fragment": pending["synced"],
            "applied_fragment": pending["applied"],
            "live_replicas": self.config.diloco.num_replicas,
        }
        if skipped:
            record["skipped_replicas"] = skipped
        if skipped_sync:
            record["skipped_sync_replicas"] = skipped_sync
        if "expert_usage" in m:
            record.update(self._moe_metrics(m))
        if pending["router_drift"] is not None:
            record["router_drift"] = float(replicated_value(pending["router_drift"]))
        self._write(record)
        if fatal is not None:
            raise fatal
        status = f"loss {record['loss']:.4f}  {tokens_per_s:,.0f} tok/s"
        display.update(t, status)
        if not display.interactive and t % self.config.train.log_every == 0:
            display.log(f"step {t:>6}  {status}  sent {pending['sent'] / 1e6:.1f} MB")
        return now, t

    def _progress(self, t: int) -> None:
        """The last step this island finished, for the launcher's lost-work accounting."""
        path = self.snapshots.directory / "progress.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name("progress.json.tmp")
        tmp.write_text(json.dumps({"step": t, "pid": os.getpid()}))
        os.replace(tmp, path)

    def _moe_metrics(self, m) -> dict[str, Any]:
        """Per layer, the normalized entropy of expert usage (1 = perfectly balanced)."""
        usage = np.asarray(m["expert_usage"])  # (R, layers, experts)
        return {"expert_balance": [float(x) for x in np.asarray(usage_entropy(jnp.asarray(usage.mean(0))))]}


def train(config: Config, *, verbose: bool = True) -> dict[str, Any]:
    """Validate `config`, then train. Raises `ConfigError` for bad input."""
    return Trainer(config, verbose=verbose).run()


__all__ = ["REFORM_EXIT_CODE", "CheckpointSaveError", "ConfigError", "NonFiniteError", "Reforming", "Trainer", "TrainingStopped", "global_model", "lm_objective", "make_diloco", "train"]
