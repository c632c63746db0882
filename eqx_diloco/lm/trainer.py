"""The host loop: dispatch steps, run outer syncs on schedule; evaluation and checkpoints are
`Hook`s, reporting is the `Reporter`'s, signals are `StopSignals`'.

Step t+1 is dispatched before step t's values are read (the host never idles the devices while it
formats a log line); only evaluations, checkpoints and the end block."""

import dataclasses
import signal
import time
from typing import Any

import equinox as eqx
import jax
from jax.sharding import NamedSharding, PartitionSpec

from models import Transformer

from .._checkpoint import Checkpointer, CheckpointSaveError
from .._compile_ahead import connect_sync_processes
from .._elastic import REFORM_EXIT_CODE, IslandSnapshots
from .._errors import NonFiniteError
from .._mesh import BATCH_SPEC
from .._replica_values import ReplicaGather, replicated_value
from .._state import TrainState
from .._tree import row_finite
from ._banner import finished_message, format_summary
from ._compile_cpus import narrow_to_share, widen_for_compiles
from ._core import Traffic, eval_loss, global_model, lm_objective, make_diloco, new_model, place
from ._env_hooks import fail_for_test, island_speed
from ._finite import FiniteChecks, finite_check
from ._hooks import Hook
from ._phases import mark
from ._reporting import Reporter
from ._signals import StopSignals, TrainingStopped
from ._tensorboard import TensorBoardLog
from .config import Config, ConfigError, validate
from .data import TokenBatches, load_tokens
from .diagnostics import router_drift
from .elastic import Reforming, island_layout
from .metrics import MetricsLog, ProgressDisplay, prepare_run_dir
from .optimizers import inner_schedule
from .resume import incompatibility


@dataclasses.dataclass
class Trainer:
    """The CLI's language-model trainer: builds a `DiLoCo` core from a validated `Config` and runs it.

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
        d, t = config.diloco, config.train
        self.diloco = config.algorithm == "diloco"
        self.num_fragments = d.num_fragments if self.diloco else 1
        tokens = load_tokens(config.data, config.model.vocab_size, t.seed)
        self.elastic = config.elastic.enabled
        self.islands, num_islands, self.elastic_events = island_layout(d.num_replicas)
        if self.elastic and jax.process_count() != d.num_replicas:
            raise ConfigError(f"--elastic.enabled needs one replica per process: run {d.num_replicas} processes "
                              f"for --diloco.num-replicas {d.num_replicas} (got {jax.process_count()})")
        self.batches = TokenBatches(tokens, num_replicas=d.num_replicas, batch_size=t.batch_size, seq_len=t.seq_len,
                                    eval_fraction=config.data.eval_fraction, seed=t.seed, split=config.data.split,
                                    islands=self.islands, num_islands=num_islands)
        self.abstract_model = eqx.filter_eval_shape(Transformer, config.model, key=jax.random.key(0))
        self.core = core = make_diloco(config, self.abstract_model)
        self.mesh, self.comm_mesh = core.mesh, core.comm_mesh
        self.groups, self.router_group, self.group_bytes = core.groups, core.router_group, core.group_bytes
        self.fragmenter = self.groups[0].fragmenter if self.diloco else None
        self.abstract_state, self.shardings = core.abstract_state, core.shardings
        self.inner_step, self.outer = core.inner_step, core.outer
        self.inner_opt, self.outer_opt = core.inner_optimizer, core.outer_optimizer
        self.ddp_step_bytes = core.ddp_step_bytes
        self.moe, self.router_drift = config.model.kind == "moe", None  # routers' drift before a sync (MoE DiLoCo)
        if self.moe and self.diloco:
            flags = tuple(jax.tree.leaves(self.abstract_model.router_mask()))
            self.router_drift = jax.jit(lambda state: router_drift(state.params, flags))
        self.lr_schedule = inner_schedule(t)
        self.batch_sharding = NamedSharding(self.mesh, BATCH_SPEC)
        # Eager anchors are per replica: one flag per row, read with the metrics (one flag over them would
        # be a collective across processes, on a slow link waiting behind the exchange just launched).
        self._row_finite = jax.jit(row_finite, out_shardings=NamedSharding(self.mesh, PartitionSpec("diloco")))
        self.theta_finite = finite_check(core.sync_compiler_options)  # theta_g's check, once a sync
        self.global_finite = self._row_finite if core.outer_overlap == "eager" else self.theta_finite
        self.checks = FiniteChecks(t.on_nonfinite)
        self.eval_tokens = place(self.batches.eval_batch(t.eval_sequences), NamedSharding(self.mesh, PartitionSpec()))
        self.eval_tasks = self._encode_tasks()  # --eval.tasks: scored with every evaluation
        self.gather = ReplicaGather(timeout_s=max(60, 4 * config.dist.heartbeat_timeout_s))
        # Steps the other processes' per-step values may trail the loop (their exchange costs round
        # trips to the coordinator over the syncs' link); a single process has nothing to wait for.
        self.metrics_lag = config.dist.metrics_lag if jax.process_count() > 1 else 0
        ck = config.checkpoint
        self.checkpointer = Checkpointer(ck.dir or config.run_dir / "checkpoints", every=ck.every, keep=ck.keep)
        self.island = self.islands[jax.process_index()] if self.elastic else None
        self.snapshots = (IslandSnapshots(config.run_dir / "elastic" / f"island-{self.island}",
                                          keep=config.elastic.keep_snapshots) if self.elastic else None)
        self._reporter: Reporter | None = None  # one per `run`, with its `signals`

    def _encode_tasks(self) -> list:
        """`--eval.tasks`, read as the run reads text, in padded batches placed on the mesh once (each
        evaluation then runs the same few compiled programs)."""
        config = self.config
        if not config.eval.tasks:
            return []
        from .tasks import encode_task, read_tasks
        from .text_encoding import encoder_for_data

        encoder = encoder_for_data(config.data.source, config.data.path, needed_by="--eval.tasks")
        replicated = NamedSharding(self.mesh, PartitionSpec())
        encoded = []
        for task in read_tasks(config.eval.tasks, flag="--eval.tasks"):
            task = encode_task(task, encoder, context=config.train.seq_len, vocab_size=config.model.vocab_size,
                               max_questions=config.eval.max_examples, flag="--eval.tasks")
            batches = [dataclasses.replace(b, inputs=place(b.inputs, replicated), targets=place(b.targets, replicated),
                                           mask=place(b.mask, replicated)) for b in task.batches]
            encoded.append(dataclasses.replace(task, batches=batches))
        return encoded

    @property
    def log_error(self):
        """The first failed metrics.jsonl or TensorBoard write (a full or read-only disk), if any."""
        return self._reporter.log_error if self._reporter is not None else None

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
            self.checks.check_sync(t, self.gather({"f": finite})["f"])
        if finished:
            self.checks.check_global(t, self.theta_finite(state.global_params))
        return state

    def final_sync(self, state: TrainState, t: int) -> tuple[TrainState, list[int]]:
        """After the last step `t`: `DiLoCo.finish`, so the evaluated and exported global model
        includes every inner step (`--train.final-sync`). Returns (state, the groups it synced)."""
        if not self.diloco or not self.config.train.final_sync:
            return state, []
        state = self.install_pending(state)  # flags of the syncs in flight, checked across processes
        stale = self.core.stale_groups(t)
        state = self.core.finish(state)
        self.checks.check_global(t, self.theta_finite(state.global_params))
        return state, stale

    # -- the run -----------------------------------------------------------------------

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
        return self.core.init(new_model(self.config.model, model_key), key=replica_key), 0

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
        mark("state built or restored")
        self._show = show = self.verbose and self.is_main
        if start >= t_cfg.steps:
            if show:
                print(finished_message(config, start), flush=True)
            return {"finished": True, "step": start}
        config.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            prepare_run_dir(config, fresh=start == 0 and not self.elastic_events,
                            checkpoint_dir=self.checkpointer.directory, show=show)
        log = MetricsLog(config.run_dir, resume_step=start, enabled=self.is_main)
        display = ProgressDisplay(t_cfg.steps, start, enabled=show)
        tb = None
        self.signals = StopSignals(elastic=self.elastic)  # none seen yet, whatever an earlier run saw
        try:
            tb = TensorBoardLog(config.run_dir, resume_step=start, enabled=self.is_main)
            self._reporter = Reporter(
                config, (log, tb), display, self.gather, lag=self.metrics_lag, signals=self.signals,
                checks=self.checks, mesh=self.mesh, lr_schedule=self.lr_schedule,
                tokens_per_step=config.diloco.num_replicas * t_cfg.batch_size * t_cfg.seq_len,
                start_time=self._start_time, start_step=start, interval_s=config.dist.metrics_interval_s,
                progress_dir=self.snapshots.directory if self.elastic else None, elastic_events=self.elastic_events)
            with self.signals.installed():
                summary = self._loop(state, start)
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

    def hooks(self) -> list[Hook]:
        """What the loop does on a schedule, in this order: evaluate theta_g, then checkpoint."""
        return [Hook("evaluate", self.config.train.eval_every, self._evaluate),
                Hook("checkpoint", self.checkpointer.every, self._save, on_stop=True)]

    def _loop(self, state: TrainState, start: int) -> dict[str, Any]:
        T, report, hooks = self.config.train.steps, self._reporter, self.hooks()
        self._announce(start)
        traffic = Traffic()
        for s in range(1, start + 1):
            traffic.add_step(self.core, s)
        self._final_synced, self._eval_loss = [], None  # the groups the final sync took; theta_g's last eval loss
        compile_start = time.perf_counter()
        state = self._compile(state, start)
        mark("sync programs compiled, step 0 evaluated")
        report.restart_clock()
        pending = None  # step t's device-side values, published after step t+1 is dispatched
        for step in range(start, T):
            t, final = step + 1, step + 1 == T
            self.checkpointer.poll()  # a failed asynchronous save stops the run here, not at the next save
            tokens = place(self.batches.batch(step), self.batch_sharding)
            state, metrics = self.core.step(state, tokens, before_sync=self.router_drift)
            fail_for_test(t)  # tests only: $EQX_DILOCO_TEST_FAIL_AT_STEP (see _env_hooks.py)
            island_speed(self.islands, all_processes=True).hold(metrics["loss"])  # benchmarks only
            if step == start:  # the step programs (and those of the syncs due now) compiled in that call
                report.note = f"compiled the step programs in {time.perf_counter() - compile_start:.1f} s"
                mark("first step compiled and dispatched")
                narrow_to_share()  # start-up's compiles done: back to the launcher's share of the CPUs
                connect_sync_processes([self.mesh, self.comm_mesh] if self.diloco else [], self.core.sync_compiler_options)
            if metrics["synced_fragment"] is not None:
                mark("first sync dispatched")
            boundary = self.elastic and self.core.settled and (
                metrics["synced_fragment"] is not None or metrics["applied_fragment"] is not None)
            values = self._step_values(state, t, metrics, traffic)
            if pending is not None:
                report.publish(pending)
                report.flush(keep=report.current_lag, most=2)
            pending = values
            if boundary:
                self._sync_boundary(state, t, pending, final)
                pending = None
            stop = bool(self.signals.agreed) and not final
            due = [h for h in hooks if h.due(t, final=final, stop=stop)]
            if due:
                # Step t's values are read before the in-flight syncs settle, so its time is when it
                # was computed (waiting for a sync is the hook's cost, not the step's).
                if pending is not None:
                    report.publish(pending)
                    pending = None
                state = self.install_pending(state)
                report.flush()  # step t's finiteness first: a diverged state must never be checkpointed
                if self.signals.agreed and not final and not stop:  # agreed on in that very exchange
                    stop = True
                    due = [h for h in hooks if h.due(t, final=final, stop=stop)]
            if final:
                mark("last step dispatched")
                state = self._finish(state, t, traffic)
            for hook in due:
                state = hook.fn(state, t)
            if final:
                mark("final sync, evaluation, checkpoint queued")
            if stop:
                self._stop(state, t)
        if pending is not None:
            report.publish(pending)
        report.flush()
        self.state = state
        return self._summary(traffic)

    # -- the loop's parts, in the order it runs them ------------------------------------------

    def _announce(self, start: int) -> None:
        """Say where the run starts, if not from scratch."""
        display = self._reporter.display
        if start and self._show:
            if self.elastic_events:
                display.log(f"re-formed at step {start} with islands {list(self.islands)}")
            else:
                display.log(f"resumed from checkpoint at step {start}")
        if self.superseded and self._show:
            display.log(f"resumed at step {start}: newer checkpoints {sorted(self.superseded)} moved aside")

    def _compile(self, state: TrainState, start: int) -> TrainState:
        """Compilation is a phase of its own: say so (how long it took is said once the first step ran).
        Evaluates the starting point of a fresh run, so the curve shows the fall."""
        if self._show:
            self._reporter.display.log("compiling the step programs..." + (" (cached programs load fast)" if start else ""))
            self._reporter.display.update(start, "compiling...")
        if self.diloco:  # the syncs and the global model's finite check, first run a round in: compiled now
            self.global_finite.lower(state.global_params).compile()
            self.core.compile_outer_ahead(state)
        if start == 0 and self.config.train.eval_every:
            state = self._evaluate(state, 0)
        return state

    def _step_values(self, state: TrainState, t: int, metrics: dict[str, Any], traffic: Traffic) -> dict[str, Any]:
        """Step t's values to publish (still on the devices), with the bytes sent through step t."""
        finite, drift = metrics.pop("sync_finite", None), metrics.pop("before_sync", None)
        synced, applied = metrics.pop("synced_fragment"), metrics.pop("applied_fragment")
        # After an outer step, whether theta_g is still finite (read with the step's metrics, one step late).
        global_finite = self.global_finite(state.global_params) if self.diloco and finite is not None else None
        traffic.add_step(self.core, t)
        return {"step": t, "metrics": metrics, "finite": finite, "synced": synced, "applied": applied,
                "sent": traffic.sent, "wire": traffic.wire, "peak": traffic.peak, "router_drift": drift,
                "global_finite": global_finite}

    def _sync_boundary(self, state: TrainState, t: int, pending: dict[str, Any], final: bool) -> None:
        """An elastic island at a settled sync boundary: step t's line first (its gather is where a
        lost island shows), so an island never holds a snapshot of a step whose metrics line is
        missing; then the snapshot (it blocks until step t is computed, once per sync; the write
        itself is asynchronous). Raises `Reforming` if the islands agreed to re-form."""
        self._reporter.publish(pending)
        self._reporter.flush()
        self.snapshots.write(self.core.island_snapshot(state, island=self.island))
        if self.signals.reform_due and not final:
            self.snapshots.wait()
            self.checkpointer.wait()
            self.state = state
            raise Reforming(t)

    def _finish(self, state: TrainState, t: int, traffic: Traffic) -> TrainState:
        """After the last step: the final sync (`--train.final-sync`), its bytes counted and logged."""
        widen_for_compiles()  # no steps left to share the CPUs with: the final programs compile on all of them
        state, self._final_synced = self.final_sync(state, t)
        for g in self._final_synced:
            traffic.sent += self.group_bytes[g]
            traffic.wire += self.core.group_wire_bytes[g]
        if self._final_synced:  # its bytes belong in the counters a reader of metrics.jsonl sums
            self._reporter.write({"step": t, "event": "final_sync", "groups": self._final_synced,
                                  "sent_bytes": traffic.sent, "wire_bytes": traffic.wire})
        if self._final_synced and self._show:
            self._reporter.display.log(f"final sync of parameter group(s) {self._final_synced}: their inner steps "
                                       f"since the last scheduled sync now reach the global model")
        if self.diloco and self.core.overlapped is not None and self.config.train.final_sync and self._show:
            self._reporter.display.log("the last round's exchange of every parameter group landed in the global model")
        return state

    def _evaluate(self, state: TrainState, t: int) -> TrainState:
        """The evaluation hook: theta_g's loss on the held-out tokens, logged and checked, and its accuracy
        on `--eval.tasks`."""
        model = self.core.global_params(state)
        value = float(replicated_value(eval_loss(model, self.eval_tokens)))
        record, shown = {"step": t, "eval_loss": value}, f"step {t:>6}  eval_loss {value:.4f}"
        if self.eval_tasks:
            from .evaluate import task_scores

            replicated = NamedSharding(self.mesh, PartitionSpec())
            for task in self.eval_tasks:
                scores = task_scores(model, task, place=lambda a: a, out_sharding=replicated)
                record.update({f"eval/{task.task.name}/{k}": v for k, v in scores.items()})
                shown += f"  {task.task.name} acc {scores['acc']:.3f} acc_norm {scores['acc_norm']:.3f}"
        self._reporter.write(record)
        if self._show:
            self._reporter.display.log(shown)
        self.checks.check_eval(t, value)
        self._eval_loss = value
        self._reporter.restart_clock()  # do not charge the evaluation to training throughput
        return state

    def _save(self, state: TrainState, t: int) -> TrainState:
        """The checkpoint hook (asynchronous; `poll` and `wait` surface a failed save)."""
        return self.core.save(self.checkpointer, state, metadata=self.config, force=True)

    def _stop(self, state: TrainState, t: int) -> None:
        """Stop at step t on the agreed signal, once its checkpoint is on disk."""
        self.state = state
        self.checkpointer.wait()
        name = signal.Signals(self.signals.agreed).name
        where = (f"checkpoint saved in {self.checkpointer.directory}; run the same command to resume"
                 if self.checkpointer.every > 0 else "checkpointing is off (--checkpoint.every 0): nothing saved")
        raise TrainingStopped(f"stopped by {name} at step {t}; {where}", signum=self.signals.agreed, step=t)

    def _summary(self, traffic: Traffic) -> dict[str, Any]:
        T, tokens_per_step = self.config.train.steps, self._reporter.tokens_per_step
        return {"finished": True, "step": T, "eval_loss": self._eval_loss, "sent_bytes": traffic.sent,
                "wire_bytes": traffic.wire, "peak_sync_bytes": traffic.peak, "tokens": T * tokens_per_step,
                "ddp_bytes": T * self.ddp_step_bytes, "wall_time_s": time.perf_counter() - self._start_time,
                "run_dir": str(self.config.run_dir), "checkpoint_dir": str(self.checkpointer.directory),
                "final_sync_groups": self._final_synced, "bits_per_parameter": self.core.bits_per_parameter}


def train(config: Config, *, verbose: bool = True) -> dict[str, Any]:
    """Validate `config`, then train. Raises `ConfigError` for bad input."""
    return Trainer(config, verbose=verbose).run()


__all__ = ["REFORM_EXIT_CODE", "CheckpointSaveError", "ConfigError", "NonFiniteError", "Reforming", "Trainer", "TrainingStopped", "global_model", "lm_objective", "make_diloco", "train"]
