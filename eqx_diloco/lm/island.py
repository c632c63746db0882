"""One decoupled island (`--decoupled.role island`): a replica that trains on its own and syncs each
fragment through the syncer when its own H is done. The island shares no runtime with the others, so a
lost island stops nothing but itself. It is one process, or several (`--dist.num-processes`, with a
coordinator of the island's own): then its parameters are sharded over every process's devices and
process 0 talks to the syncer (`_island_group`).

The island writes `RUN_DIR/island-K/metrics.jsonl` (a line per step with `step`, `time`, `loss`, and
a line per sync) and `RUN_DIR/island-K/progress.json` (the step of its newest sync). Restarted, it
joins again (theta_g of every fragment), starts from that step with a fresh inner optimizer state at
the step's point of the learning-rate schedule, and appends to its log: steps it computed and lost
stay there, as work done. `time` is seconds since `$EQX_DILOCO_RUN_T0` (the launcher's start), else
since the island started, so the islands' logs share one clock.
"""

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import Transformer

from .._island import Island, adaptive_sync_period
from .._island_group import IslandGroup
from .._mesh import INNER
from .._rpc import TOKEN_ENV, SyncerClient, SyncerUnreachable, SyncRefused
from ._compile_cpus import keep_to_cpus
from ._core import lm_objective, new_model, transformer_specs
from ._core import place as place_batch
from ._env_hooks import island_speed
from ._preflight import RunDirLock
from ._decoupled_config import read_token_file
from .config import Config, ConfigError, error_feedback_argument
from .data import TokenBatches, load_tokens
from .metrics import MetricsLog
from .optimizers import inner_optimizer

RUN_T0_ENV = "EQX_DILOCO_RUN_T0"


class IslandError(RuntimeError):
    """The syncer refused this island or could not be reached (one line; the island exits 1)."""


def shared_token(config: Config) -> str:
    """The shared secret: the first line of `--decoupled.token-file`, else `$EQX_DILOCO_SYNCER_TOKEN`
    (never a flag's value: a command line is visible to every user of the machine)."""
    path = config.decoupled.token_file
    token = read_token_file(path) if path is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ConfigError(f"${TOKEN_ENV} is empty and --decoupled.token-file is not set: the syncer refuses calls "
                          "without the shared secret")
    return token


def initial_model(config: Config) -> Transformer:
    """The model every island and the syncer start from (the trainer's initialisation)."""
    model_key, _ = jax.random.split(jax.random.key(config.train.seed))
    return new_model(config.model, model_key)


def island_placement(config: Config, model: Transformer) -> tuple[Any, NamedSharding]:
    """Where an island's arrays live: its `--mesh.data x --mesh.fsdp x --mesh.tensor` devices (those of its
    own process, or of every process of a multi-process island) as one (data, fsdp, tensor) mesh, the
    parameters laid out by the trainer's rules for a sharded island (`transformer_specs`) and each batch
    split over data x fsdp. Returns (parameter shardings, a tree like the model's arrays; the batch's
    sharding)."""
    m = config.mesh
    count = m.data * m.fsdp * m.tensor
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) < count:
        where = "its process" if jax.process_count() == 1 else f"its {jax.process_count()} processes"
        raise ConfigError(f"an island of --mesh.data x --mesh.fsdp x --mesh.tensor = {count} devices needs them in "
                          f"{where}, which have {len(devices)} ({devices[0].platform})")
    mesh = Mesh(np.asarray(devices[:count]).reshape(m.data, m.fsdp, m.tensor), INNER)
    specs = transformer_specs(m.fsdp, m.tensor)(model)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                             is_leaf=lambda x: isinstance(x, PartitionSpec))
    return shardings, NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def _make_step(static, optimizer: optax.GradientTransformation, dropout: float):
    loss_fn = lm_objective(dropout)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, key):
        def loss(p):
            return loss_fn(eqx.combine(p, static), tokens, key)[0]

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def _replicated_scalar(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """Scalar `x`, the same on every process of the island, as one array replicated over `sharding`."""
    value = np.asarray(x)
    return jax.make_array_from_callback((), sharding, lambda _: value)


def read_progress(path: Path, island: int) -> int:
    """The step of island `island`'s newest sync, from its `progress.json` (0 when there is none).
    Raises `ConfigError` (one line) for a file that is not `{"step": N}`."""
    if not path.exists():
        return 0
    try:
        step = json.loads(path.read_text())["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step {str(step)[:40]} is not an integer >= 0")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not {{\"step\": N}} ({type(e).__name__}: {str(e)[:80]}): fix it, or delete it "
                          f"to restart island {island} from step 0") from None
    return step


def _write_progress(path: Path, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step}))
    tmp.replace(path)


def _batches(config: Config, tokens: np.ndarray, island: int) -> TokenBatches:
    t = config.train
    return TokenBatches(tokens, num_replicas=1, batch_size=t.batch_size, seq_len=t.seq_len,
                        eval_fraction=config.data.eval_fraction, seed=t.seed, split=config.data.split,
                        islands=(island,), num_islands=config.diloco.num_replicas)


def _fresh_opt_state(optimizer: optax.GradientTransformation, params, start: int, mesh: Mesh):
    """The inner optimizer's state at step `start` of the schedule, every leaf its own buffer (the step
    donates them). The step counts are placed as the step returns them (replicated over the island's
    devices): left on one device, the second step's signature differed from the first's and it
    compiled the step again."""
    opt_state = optax.tree_utils.tree_set(optimizer.init(params), count=jax.numpy.asarray(start, jax.numpy.int32))
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.numpy.copy(x) if x.ndim else _replicated_scalar(x, replicated), opt_state)


def await_assignment(config: Config) -> Config:
    """A standby island's wait (`--decoupled.standby`): one JSON line on standard input,
    `{"island": K, "cpus": [...]}`, names the island it becomes and the CPUs it keeps to from then on
    (null: those it has). Returns `config` as that island's."""
    line = sys.stdin.readline()
    if not line:
        raise IslandError("standby island: its standard input closed before it was given an island to become")
    try:
        message = json.loads(line)
        k, cpus = message["island"], message.get("cpus")
    except (ValueError, KeyError, TypeError) as e:
        raise IslandError(f"standby island: expected a line {{\"island\": K, \"cpus\": [...]}} on standard input, "
                          f"got {line.strip()[:80]!r} ({e})") from None
    if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k < config.diloco.num_replicas):
        raise IslandError(f"standby island: island {str(k)[:40]} is not in [0, {config.diloco.num_replicas}) "
                          "(an integer; --diloco.num-replicas)")
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cpus is not None and not (isinstance(cpus, list) and cpus and all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c < (os.cpu_count() or 1) for c in cpus)):
        raise IslandError(f"standby island: \"cpus\" must be null or a non-empty list of this machine's CPU numbers "
                          f"(0 to {(os.cpu_count() or 1) - 1}; this process has {mine}), got {str(cpus)[:80]}")
    if cpus:
        try:
            keep_to_cpus(cpus)
        except OSError as e:
            raise IslandError(f"standby island: cannot keep to \"cpus\" {cpus[:16]} ({e.strerror}); this process "
                              f"may use {mine}") from None
    return dataclasses.replace(config, decoupled=dataclasses.replace(config.decoupled, island=k, standby=False))


def run_island(config: Config) -> int:
    """Train island `--decoupled.island` to `--train.steps`; 0 when it finished. In an island of several
    processes every process calls it; process 0 (the leader) talks to the syncer and writes the files.

    A standby island (`--decoupled.standby`) first builds and compiles everything that does not depend
    on which island it is (the model, its step, the encoders; one step run on a throwaway copy), then
    waits for `await_assignment`: taking a lost island's place costs it a join, not a start."""
    dc, d, t = config.decoupled, config.diloco, config.train
    num_fragments, period = d.num_fragments, d.sync_period
    t0 = float(os.environ.get(RUN_T0_ENV, time.time()))
    leader = jax.process_index() == 0
    tokens = load_tokens(config.data, config.model.vocab_size, t.seed)
    model = initial_model(config)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    shardings, batch_sharding = island_placement(config, model)
    optimizer = inner_optimizer(t, model.weight_decay_mask(), config.optim)
    step_fn = _make_step(static, optimizer, config.model.dropout)
    client = SyncerClient(dc.syncer, token=shared_token(config), retry_s=dc.retry_s) if leader else None

    def new_island(k: int) -> Island | None:
        return None if client is None else Island(
            params, layers=lambda m: m.blocks, num_fragments=num_fragments, fragment_pattern=d.fragment_pattern,
            client=client, island=k, quantize=d.quantize, error_feedback=error_feedback_argument(d))

    if dc.standby:
        # Everything a start compiles, now: the step (run once on copies laid out as a join places the
        # parameters, so its program is this process's, not only the cache's) and the encoders.
        copies = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
                              jax.tree.map(np.asarray, params), shardings)
        batch = place_batch(_batches(config, tokens, 0).batch(0)[0], batch_sharding)
        float(step_fn(copies, _fresh_opt_state(optimizer, copies, 0, batch_sharding.mesh), batch,
                      jax.random.key(t.seed))[2])
        if client is not None:
            new_island(0).compile()
        config = await_assignment(config)
    dc, k = config.decoupled, config.decoupled.island
    folder = config.run_dir / f"island-{k}"
    progress = folder / "progress.json"
    held = contextlib.ExitStack()  # released in the `finally` below (and by the kernel at any exit)
    if leader:  # one island K per run folder: a second one would interleave its files and pushes
        try:
            held.enter_context(RunDirLock(folder, job=f"island {k}"))
        except ConfigError as e:
            raise ConfigError(f"island {k} of {config.run_dir} is already running: {e}") from None
        (folder / "pid").write_text(str(os.getpid()))  # whoever supervises or tests the island can signal it
    batches = _batches(config, tokens, k)
    island = new_island(k)
    group = IslandGroup(island, shardings, num_fragments=num_fragments, num_processes=jax.process_count())
    speed = island_speed((k,))  # benchmark only
    tokens_per_step = t.batch_size * t.seq_len
    log = MetricsLog(folder, append=True) if leader else None

    def write(record: dict) -> None:
        if log is not None:
            log.write(record)

    try:
        # Where the island's newest sync left it (the leader's file: every process goes on from there).
        start = group.agree(read_progress(progress, k) if leader else 0)
        params = group.join(params)
        write({"step": start, "time": time.time() - t0, "joined": True, "versions": group.versions,
               "devices": batch_sharding.mesh.size, "processes": jax.process_count()})
        opt_state = _fresh_opt_state(optimizer, params, start, batch_sharding.mesh)  # the schedule goes on from `start`
        # Streaming DiLoCo's schedule (`eqx_diloco.schedule`): fragment f first syncs after (f + 1) H / P steps.
        since = [period - ((f + 1) * period) // num_fragments for f in range(num_fragments)]
        steps_done = [0] * num_fragments
        # Without waiting, an island still waits for its first merge of each fragment at the run's start:
        # that merge comes back to every island at once, so islands that started apart (a compile, a
        # slower host) train in phase from there on. A restarted island does not wait (the others are
        # mid-run); its rounds count from its first merge's return, as below.
        in_phase = [dc.wait or start > 0] * num_fragments
        # Without waiting, islands that run at different speeds do not reach their own last step together:
        # the run ends on theta_g's tokens instead, --train.steps of every island's, at the first merge
        # that completes them, which every island of that merge learns at once. A faster island makes
        # more than --train.steps steps, a slower fewer, and no island trains on alone at the end.
        budget = d.num_replicas * t.steps * tokens_per_step
        seconds_per_step = None
        key = jax.random.fold_in(jax.random.key(t.seed), k)

        def budget_reached(step: int) -> bool:
            if dc.wait or group.tokens_merged < budget:
                return False
            write({"step": step, "time": time.time() - t0, "tokens_merged": group.tokens_merged,
                   "budget_reached": True})
            return True

        for step in itertools.count(start):
            # (restarted after the end; also with fewer --train.steps than the run made, which then stays finished)
            if dc.wait and step >= t.steps or step == start and budget_reached(step):
                break
            began = time.perf_counter()
            batch = place_batch(batches.batch(step)[0], batch_sharding)
            params, opt_state, loss = step_fn(params, opt_state, batch, jax.random.fold_in(key, step))
            loss = float(loss)
            if not math.isfinite(loss):  # its parameters diverged: pushed, they would only be refused
                write({"step": step + 1, "time": time.time() - t0, "loss": loss, "tokens": tokens_per_step})
                raise IslandError(f"island {k}: non-finite loss ({loss}) at step {step + 1}: it diverged (a lower "
                                  "--train.lr?); a restart joins again from theta_g")
            speed.hold(loss)
            took = time.perf_counter() - began
            seconds_per_step = took if seconds_per_step is None else 0.9 * seconds_per_step + 0.1 * took
            write({"step": step + 1, "time": time.time() - t0, "loss": loss, "tokens": tokens_per_step})
            since = [s + 1 for s in since]
            steps_done = [s + 1 for s in steps_done]
            h = period
            if dc.adaptive_h:  # from the leader's speed: every process of the island syncs at the same steps
                h = group.agree(adaptive_sync_period(period, 1.0 / seconds_per_step, group.fastest_steps_per_s))
            last = dc.wait and step + 1 == t.steps
            lost = group.lost_rounds
            if not dc.wait:
                before = list(group.versions)
                params = group.collect(params)  # merges that came back since the last step
                # A fragment's next round counts from the step its merge came back in, as a waiting
                # island's does: the islands of a merge get it at the same moment, so they push together
                # again. Counted from its own push, an island that ran a little faster would push ever
                # earlier than the others, and its merges would come back ever later.
                for f in range(num_fragments):
                    if group.versions[f] != before[f]:
                        since[f] = 1
                        write({"step": step + 1, "time": time.time() - t0, "merged": f, "version": group.versions[f]})
                if budget_reached(step + 1):
                    break
            for f in range(num_fragments):
                if since[f] >= h or (last and t.final_sync and steps_done[f] > 0):
                    if not dc.wait and group.in_flight(f):  # its previous merge has not come back:
                        continue  # pushed once it has (collected at the top of a later step), with the steps since
                    waited = time.perf_counter()
                    base_version = group.versions[f]
                    if dc.wait or not in_phase[f]:
                        params = group.sync(params, f, tokens=steps_done[f] * tokens_per_step,
                                            steps_per_s=1.0 / seconds_per_step)
                    else:
                        group.push(params, f, tokens=steps_done[f] * tokens_per_step,
                                   steps_per_s=1.0 / seconds_per_step)
                    in_phase[f] = True
                    write({"step": step + 1, "time": time.time() - t0, "sync": f, "base_version": base_version,
                           "version": group.versions[f], "h": h, "wait_s": round(time.perf_counter() - waited, 4),
                           "tokens_sent": steps_done[f] * tokens_per_step})
                    since[f], steps_done[f] = 0, 0
                    if leader:
                        _write_progress(progress, step + 1)
            if group.lost_rounds > lost:
                write({"step": step + 1, "time": time.time() - t0, "lost_round": True, "joined": True,
                       "versions": group.versions})
        params = group.collect(params, wait=True)
        group.leave()
    except SyncerUnreachable as e:
        raise IslandError(f"island {k}: {e} (--decoupled.syncer {dc.syncer}, --decoupled.retry-s {dc.retry_s:g})") from None
    except SyncRefused as e:
        raise IslandError(f"island {k}: the syncer refused it: {e}") from None
    finally:
        held.close()
        group.close()  # its sender thread would keep the process from ending
        if log is not None:
            log.close()
        if client is not None:
            client.close()
    return 0
