"""The trainer's reporting: step t's values are published (read on this process, their exchange
with the other processes started), then emitted in order (checked, written to metrics.jsonl and
TensorBoard, shown on the terminal).

Across processes the exchange of step t's values runs in the background, `--dist.metrics-lag`
steps' values at a time, and is read that many steps later, so its round trips to the
coordinator neither delay every step nor cost a round per step. Where steps are short, more
steps travel at a time: no more than one exchange per `--dist.metrics-interval-s`, since an
exchange costs milliseconds of host time whatever it carries."""

import collections
import dataclasses
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.moe import usage_entropy

from .._errors import NonFiniteError
from .._replica_values import ReplicaGather, replicated_value
from ._finite import FiniteChecks
from ._phases import mark
from ._signals import StopSignals
from .config import Config
from .elastic import write_progress
from .metrics import LogWriteError, ProgressDisplay


LR_BLOCK = 1024  # learning rates computed per device call
MAX_LAG = 1024  # steps per exchange at most, however short the steps


@dataclasses.dataclass
class Reporter:
    """Publishes and emits the values of every step of one run.

    - `config`: the run's configuration (`--train.log-every`, `--train.steps`, replica count).
    - `logs`: where records go (metrics.jsonl, TensorBoard); each has `write(record)`.
    - `display`: the terminal's progress display.
    - `gather`: the exchange of per-replica values across processes.
    - `lag`: steps the exchange may trail the loop at least (0 for a single process: no exchange to wait for).
    - `interval_s`: the shortest time between two exchanges. Each exchange carries every process's
      seconds per step, and the next ones carry enough steps to span this long (at least `lag`);
      every process reads the same values, so all agree on the new lag at the same step. 0 = `lag` always.
    - `signals`: the run's signals, published with every step and agreed on when it is emitted.
    - `checks`: the non-finite checks.
    - `mesh`: the replicas' mesh (for the signal rows).
    - `lr_schedule`: the inner learning rate per step, for the records.
    - `tokens_per_step`: tokens all replicas train per step, for the throughput.
    - `start_time`: when the run started (`time.perf_counter()`).
    - `start_step`: the step it starts from.
    - `progress_dir`: an elastic island's folder, where every emitted step is recorded; None otherwise.
    - `elastic_events`: the losses and rejoins that led to this run, logged with its first step.
    """

    config: Config
    logs: tuple
    display: ProgressDisplay
    gather: ReplicaGather
    lag: int
    signals: StopSignals
    checks: FiniteChecks
    mesh: Mesh
    lr_schedule: Callable[[int], Any]
    tokens_per_step: int
    start_time: float
    start_step: int
    progress_dir: Path | None = None
    elastic_events: list[dict] = dataclasses.field(default_factory=list)
    interval_s: float = 0.0
    # A line shown before the next emitted step (how long compiling took).
    note: str | None = None
    # The first failed write (a full or read-only disk), if any: see `write`.
    log_error: LogWriteError | None = None
    _inflight: collections.deque = dataclasses.field(default_factory=collections.deque)  # sent, not emitted
    _unsent: list = dataclasses.field(default_factory=list)  # published, exchange not started
    _timer: tuple[float, int] = (0.0, 0)  # when the last logged step was read, and which step
    # Seconds since `start_time` when the newest emitted exchange's last step was read, the most any
    # process measured: the same on every process, so a schedule by time (checkpoints) picks one step.
    clock_s: float = 0.0
    current_lag: int = 0  # steps per exchange now: `lag`, or more where steps are short (see `interval_s`)
    _last_sent_at: float | None = None  # when the last step of the previous exchange was read here

    def __post_init__(self):
        self.current_lag = self.lag
        self._timer = (time.perf_counter(), self.start_step)
        # The schedule's values, LR_BLOCK steps per compiled call: a device call per logged step would
        # queue behind the steps in flight and make the host wait for them (compiled here, not mid-run).
        self._lr_block = jax.jit(jax.vmap(self.lr_schedule))
        self._lr_values = (-1, np.empty(0, np.float32))
        self._lr(self.start_step)

    def _lr(self, step: int) -> float:
        """The inner learning rate at (0-based) `step`."""
        block, values = self._lr_values
        if block != step // LR_BLOCK:
            block = step // LR_BLOCK
            with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and integer counts
                values = np.asarray(self._lr_block(np.arange(block * LR_BLOCK, (block + 1) * LR_BLOCK)))
            self._lr_values = (block, values)
        return float(values[step % LR_BLOCK])

    def write(self, record: dict[str, Any]) -> None:
        """One record into metrics.jsonl (non-finite numbers as null) and the TensorBoard events.

        A failed write asks every process to stop at the next step boundary with a checkpoint, as
        SIGTERM does (the CLI then reports `log_error` and exits 1)."""
        for log in self.logs:
            try:
                log.write(record)
            except LogWriteError as e:
                self.log_error = self.log_error or e
                self.signals.seen = self.signals.seen or signal.SIGTERM

    def restart_clock(self) -> None:
        """Do not charge what just happened (compiling, an evaluation) to training throughput."""
        self._timer = (time.perf_counter(), self._timer[1])

    def publish(self, pending: dict[str, Any]) -> None:
        """Read step t's values on this process (waits for step t); their exchange with the other
        processes starts with the next `lag` steps' (or at the next full `flush`)."""
        arrays = dict(pending["metrics"])
        if pending["finite"] is not None:
            arrays["sync_finite"] = pending["finite"]
        # Every process's SIGTERM/SIGHUP, so all stop at one step.
        arrays["stop_signal"] = self.signals.rows(self.config.diloco.num_replicas, self.mesh)
        global_finite = pending["global_finite"]
        if global_finite is not None and global_finite.ndim == 1:  # one flag per replica row
            arrays["global_finite"] = global_finite
        jax.block_until_ready(arrays)  # step t is done here: its time is now, not when its exchange ends
        arrays = self.gather.read(arrays)
        if pending["step"] == self.start_step + 1:
            mark("first step done")
        self._unsent.append((dict(pending, read_at=time.perf_counter()), arrays))
        if len(self._unsent) >= max(1, self.current_lag):
            self._send()

    def _send(self) -> None:
        """Start one exchange for every published step not yet sent (with this process's seconds per
        step over them, where the lag adapts)."""
        read = [pending["read_at"] for pending, _ in self._unsent]
        per_process = {"clock_s": read[-1] - self.start_time}
        if self.lag > 0 and self.interval_s > 0:
            first = self._last_sent_at if self._last_sent_at is not None else read[0]
            steps = len(read) if self._last_sent_at is not None else len(read) - 1
            # No span to measure (one step, first exchange): infinitely long steps keep the lag at `lag`.
            per_process["seconds_per_step"] = (read[-1] - first) / steps if steps else math.inf
        self._last_sent_at = read[-1]
        futures = self.gather.submit_many([arrays for _, arrays in self._unsent], per_process=per_process)
        self._inflight.extend(dict(pending, gathered=f) for (pending, _), f in zip(self._unsent, futures))
        self._unsent = []

    def _adapt_lag(self, seconds_per_step: np.ndarray) -> None:
        """Steps per exchange from every process's seconds per step (the slowest decides: the fewest
        steps), the same on every process since all read the same gathered values."""
        slowest = float(np.max(seconds_per_step))
        wanted = math.ceil(self.interval_s / slowest - 1e-9) if 0 < slowest < math.inf else self.lag
        self.current_lag = max(self.lag, min(MAX_LAG, wanted))

    def flush(self, keep: int = 0, most: int | None = None) -> None:
        """Emit the published steps, oldest first, until at most `keep` sent ones remain in flight
        (`keep` = 0: every published step, its exchange started now if it was not yet), and at
        most `most` of them in this call (None: no limit).

        Published steps are sent `lag` at a time, so a step's values are read between `lag` and
        `2 lag - 1` steps after it. The training loop emits at most two per step: an exchange
        brings `lag` steps at once (tens where steps are short), and writing them all in one step
        made that step several times longer than the others. Every process emits the same steps
        at the same point of the loop (the counts decide, not which exchanges happen to have
        finished), so decisions taken from the gathered values (an agreed stop, a re-form) fall on
        the same step everywhere."""
        if keep == 0 and self._unsent:
            self._send()
        emitted = 0
        while len(self._inflight) > keep and (most is None or emitted < most):
            self._emit(self._inflight.popleft())
            emitted += 1

    def _emit(self, pending: dict[str, Any]) -> None:
        """Check and log step t's gathered values (waiting for their exchange)."""
        t = pending["step"]
        m = dict(pending["gathered"].result())
        if "seconds_per_step" in m:  # the last step of an exchange
            self._adapt_lag(m.pop("seconds_per_step"))
        if "clock_s" in m:  # likewise
            self.clock_s = float(np.max(m.pop("clock_s")))
        global_finite = pending["global_finite"]
        if "global_finite" in m:
            global_finite = bool(np.all(m.pop("global_finite")))
        self.signals.agree(m.pop("stop_signal"))
        if self.progress_dir is not None:
            write_progress(self.progress_dir, t)
        if self.elastic_events:  # the losses and rejoins that led to this run, once it trains again
            now_unix = time.time()
            for e in self.elastic_events:
                self.write({"step": t, **{k: v for k, v in e.items() if k != "detected_unix"},
                            "stalled_s": now_unix - e["detected_unix"]})
            self.elastic_events = []
        skipped = self.checks.check(t, "loss", m["finite"])
        skipped_sync = self.checks.check(t, "outer gradient", m["sync_finite"]) if "sync_finite" in m else []
        fatal = None
        if skipped and len(skipped) == len(m["finite"]):
            fatal = self.checks.all_skipped(t, "loss")
        elif skipped_sync and len(skipped_sync) == len(m["sync_finite"]):
            fatal = self.checks.all_skipped(t, "outer gradient")
        if fatal is None:
            try:
                self.checks.check_global(t, global_finite)
            except NonFiniteError as e:
                fatal = e
        event = pending["synced"] is not None or pending["applied"] is not None or pending["router_drift"] is not None
        if self.note is not None:
            self.display.log(self.note)
            self.note = None
        train = self.config.train
        if t % train.log_every and t != train.steps and not event and fatal is None:
            return
        last_time, last_step = self._timer
        now = pending["read_at"]  # when step t was done here, however late its exchange finished
        tokens_per_s = (t - last_step) * self.tokens_per_step / max(now - last_time, 1e-9)
        replica_losses = [float(x) for x in m["loss"]]
        record = {
            "step": t,
            "time": now - self.start_time,
            "loss": float(np.mean(replica_losses)),
            "replica_losses": replica_losses,
            "lr": self._lr(t - 1),
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
            record.update(moe_metrics(m["expert_usage"]))
        if pending["router_drift"] is not None:
            record["router_drift"] = float(replicated_value(pending["router_drift"]))
        self.write(record)
        if fatal is not None:
            raise fatal
        status = f"loss {record['loss']:.4f}  {tokens_per_s:,.0f} tok/s"
        self.display.update(t, status)
        if not self.display.interactive and t % train.log_every == 0:
            self.display.log(f"step {t:>6}  {status}  sent {pending['sent'] / 1e6:.1f} MB")
        self._timer = (now, t)


def moe_metrics(expert_usage: jax.Array) -> dict[str, Any]:
    """Per layer, the normalized entropy of expert usage (1 = perfectly balanced), from the
    replicas' (R, layers, experts) usage."""
    usage = np.asarray(expert_usage)
    return {"expert_balance": [float(x) for x in np.asarray(usage_entropy(jnp.asarray(usage.mean(0))))]}
