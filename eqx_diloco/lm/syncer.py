"""The syncer of a decoupled run (`--decoupled.role syncer`): theta_g and the outer optimizer behind a
gRPC port, the global model's evaluations, and Orbax checkpoints it resumes from.

It writes `RUN_DIR/metrics.jsonl` (the global model's evaluations: `step` is the merged tokens in
synchronous steps of all islands, `tokens`, `time`, `eval_loss`), `RUN_DIR/syncer/metrics.jsonl` (a
line per merge), `RUN_DIR/syncer/address.json` (the port it listens on), `RUN_DIR/syncer/config.json`
(the run's config without the shared secret, which `python -m eqx_diloco.export` reads) and, when stopped
(SIGTERM or SIGINT), `RUN_DIR/syncer/summary.json` (tokens merged and refused, merges).

A save of `RUN_DIR/syncer/checkpoints` that fails stops the syncer at once with one line and exit 1
(`CheckpointSaveError`): serving on, it would lose every merge since the last save. A syncer with no
checkpoint to resume writes one of the initial theta_g before it listens, so a folder it cannot write
is found before any island trains.
"""

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time

import equinox as eqx
import jax

from .._fragments import Fragmenter
from .._island import fragment_vectors, install_fragment
from .._rpc import SyncerService
from .._syncer import MAX_TOKENS, MergeRecord, Syncer
from .._syncer_checkpoint import SyncerCheckpoints
from ._core import eval_loss
from ._decoupled_config import DECOUPLED_JOB_ENV
from ._preflight import RunDirLock, check_run_dir_free
from .config import Config, ConfigError
from .data import TokenBatches, load_tokens
from .island import RUN_T0_ENV, initial_model, read_progress, shared_token
from .metrics import MetricsLog, write_config
from .optimizers import outer_optimizer


# A contribution may carry this many times the tokens an island of the syncer's flags makes between two
# syncs: islands may run other batch sizes or sequence lengths than the syncer's flags say.
TOKEN_HEADROOM = 8


def max_contribution_tokens(config: Config) -> int:
    """The most tokens one push may carry: `TOKEN_HEADROOM` times an island's tokens between two syncs
    of a fragment (`--diloco.sync-period` steps of `--train.batch-size` x `--train.seq-len`); without
    waiting (`--decoupled.no-wait`) an island may train on while a push is in flight, so up to the
    whole run's budget (`--train.steps` of every island's tokens)."""
    t, d = config.train, config.diloco
    steps = d.sync_period if config.decoupled.wait else t.steps * d.num_replicas
    return min(MAX_TOKENS, TOKEN_HEADROOM * t.batch_size * t.seq_len * max(1, steps))


def _check_no_progress(config: Config) -> None:
    """Raise `ConfigError` when islands of this run folder synced already although the syncer has no
    checkpoint: starting again from the initial theta_g would silently undo their merges."""
    for k in range(config.diloco.num_replicas):
        path = config.run_dir / f"island-{k}" / "progress.json"
        step = read_progress(path, k)
        if step > 0:
            raise ConfigError(f"{config.run_dir / 'syncer' / 'checkpoints'} holds no checkpoint, but island {k} synced "
                              f"up to step {step} ({path}): theta_g of this run is lost; use a new --run-dir, or delete "
                              "the island-*/progress.json files to train again from step 0")


def run_syncer(config: Config) -> int:
    """Serve until SIGTERM or SIGINT, then evaluate theta_g once more, checkpoint and return 0.

    One decoupled run per run folder: started by the launcher, the syncer checks that the folder's lock
    is its launch's (`DECOUPLED_JOB_ENV`); started by hand, it holds the lock itself while it runs."""
    job = os.environ.get(DECOUPLED_JOB_ENV)
    if job:
        check_run_dir_free(config.run_dir, job=job)
    with contextlib.nullcontext() if job else RunDirLock(config.run_dir, job="decoupled syncer"):
        return _serve(config)


def _serve(config: Config) -> int:
    dc, d, t = config.decoupled, config.diloco, config.train
    t0 = float(os.environ.get(RUN_T0_ENV, time.time()))
    folder = config.run_dir / "syncer"
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, dataclasses.replace(config, decoupled=dataclasses.replace(dc, token=None)))  # for export
    params, static = eqx.partition(initial_model(config), eqx.is_inexact_array)
    fragmenter = Fragmenter.for_model(params, lambda m: m.blocks, d.num_fragments, d.fragment_pattern)
    token, lock, stop = shared_token(config), threading.Lock(), threading.Event()
    checkpoints = SyncerCheckpoints(folder / "checkpoints", on_error=lambda message: stop.set())

    def on_merge(record: MergeRecord) -> None:
        with lock:
            merges.write({"time": time.time() - t0, "fragment": record.fragment, "version": record.version,
                          "islands": list(record.islands), "staleness": list(record.staleness),
                          "tokens": record.tokens, "by_grace": record.by_grace})
        checkpoints.mark()

    syncer = Syncer(fragment_vectors(params, fragmenter), outer_optimizer=outer_optimizer(d),
                    num_islands=d.num_replicas, min_quorum=dc.min_quorum, grace_s=dc.grace_s,
                    grace_factor=dc.grace_factor, grace_min_s=dc.grace_min_s, grace_max_s=dc.grace_max_s,
                    max_staleness=dc.max_staleness, max_tokens=max_contribution_tokens(config), on_merge=on_merge)
    restored = checkpoints.restore(syncer)
    if restored is None:
        _check_no_progress(config)
        checkpoints.save_now(syncer)  # the initial theta_g: an unwritable folder is found now, not after merges
    service = SyncerService(syncer, address=dc.syncer, token=token)  # a port it cannot bind: one line, now
    syncer.compile_ahead()
    merges, evals = MetricsLog(folder, append=True), MetricsLog(config.run_dir, append=True)  # before any merge
    checkpoints.follow(syncer)
    service.start()
    (folder / "address.json").write_text(json.dumps({"port": service.port, "pid": os.getpid(), "restored": restored}))
    print(f"syncer: listening on port {service.port} for {d.num_replicas} islands"
          + (f", resumed at versions {syncer.versions}" if restored is not None else ""), flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    batches = TokenBatches(load_tokens(config.data, config.model.vocab_size, t.seed), num_replicas=1,
                           batch_size=t.batch_size, seq_len=t.seq_len, eval_fraction=config.data.eval_fraction,
                           seed=t.seed, split=config.data.split)
    eval_tokens = jax.numpy.asarray(batches.eval_batch(t.eval_sequences))
    step_tokens = t.batch_size * t.seq_len * d.num_replicas  # one synchronous step of every island

    def evaluate() -> None:
        merged = round(syncer.tokens_merged)
        state = syncer.state_tree()
        model = params
        for f, vector in enumerate(state["theta"]):
            model = install_fragment(model, fragmenter, f, vector)
        loss = float(eval_loss(eqx.combine(model, static), eval_tokens))
        record = {"step": merged // step_tokens, "tokens": merged, "time": time.time() - t0, "eval_loss": loss,
                  "versions": [int(v) for v in state["versions"]]}
        evals.write(record)
        print(f"syncer: {merged:,} tokens merged ({record['step']} steps of every island), eval loss {loss:.4f}, "
              f"{record['time']:.1f} s", flush=True)

    every = t.eval_every * step_tokens
    if restored is None:
        evaluate()
    next_eval = (syncer.tokens_merged // every + 1) * every if every else None
    def write_summary() -> None:
        summary = {"tokens_merged": round(syncer.tokens_merged), "tokens_refused": round(syncer.tokens_refused),
                   "merges": len(syncer.merges), "merges_by_grace": sum(r.by_grace for r in syncer.merges),
                   "versions": syncer.versions}
        (folder / "summary.json").write_text(json.dumps(summary))
        merges.close()
        evals.close()

    try:
        while not stop.wait(0.05):
            if next_eval is not None and syncer.tokens_merged >= next_eval:
                evaluate()
                next_eval = (syncer.tokens_merged // every + 1) * every
    finally:
        service.stop()
        evaluate()
        try:
            checkpoints.close()  # raises a failed save's CheckpointSaveError: the syncer exits 1
        finally:
            write_summary()
    return 0
