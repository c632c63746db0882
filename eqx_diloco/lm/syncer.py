"""The syncer of a decoupled run (`--decoupled.role syncer`): theta_g and the outer optimizer behind a
gRPC port, the global model's evaluations, and Orbax checkpoints it resumes from.

It writes `RUN_DIR/metrics.jsonl` (the global model's evaluations: `step` is the merged tokens in
synchronous steps of all islands, `tokens`, `time`, `eval_loss`), `RUN_DIR/syncer/metrics.jsonl` (a
line per merge), `RUN_DIR/syncer/address.json` (the port it listens on), `RUN_DIR/syncer/config.json`
(the run's config without `--decoupled.token`, which `python -m eqx_diloco.export` reads) and, when
stopped (SIGTERM or SIGINT), `RUN_DIR/syncer/summary.json` (tokens merged and refused, merges).
"""

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
from .._syncer import MergeRecord, Syncer
from .._syncer_checkpoint import SyncerCheckpoints
from ._core import eval_loss
from .config import Config
from .data import TokenBatches, load_tokens
from .island import RUN_T0_ENV, initial_model, shared_token
from .metrics import MetricsLog, write_config
from .optimizers import outer_optimizer


def run_syncer(config: Config) -> int:
    """Serve until SIGTERM or SIGINT, then evaluate theta_g once more, checkpoint and return 0."""
    dc, d, t = config.decoupled, config.diloco, config.train
    t0 = float(os.environ.get(RUN_T0_ENV, time.time()))
    folder = config.run_dir / "syncer"
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, dataclasses.replace(config, decoupled=dataclasses.replace(dc, token=None)))  # for export
    params, static = eqx.partition(initial_model(config), eqx.is_inexact_array)
    fragmenter = Fragmenter.for_model(params, lambda m: m.blocks, d.num_fragments, d.fragment_pattern)
    merges, evals, lock = MetricsLog(folder, append=True), MetricsLog(config.run_dir, append=True), threading.Lock()
    checkpoints = SyncerCheckpoints(folder / "checkpoints")

    def on_merge(record: MergeRecord) -> None:
        with lock:
            merges.write({"time": time.time() - t0, "fragment": record.fragment, "version": record.version,
                          "islands": list(record.islands), "staleness": list(record.staleness),
                          "tokens": record.tokens, "by_grace": record.by_grace})
        checkpoints.mark()

    syncer = Syncer(fragment_vectors(params, fragmenter), outer_optimizer=outer_optimizer(d),
                    num_islands=d.num_replicas, min_quorum=dc.min_quorum, grace_s=dc.grace_s,
                    grace_factor=dc.grace_factor, grace_min_s=dc.grace_min_s, grace_max_s=dc.grace_max_s,
                    max_staleness=dc.max_staleness, on_merge=on_merge)
    restored = checkpoints.restore(syncer)
    syncer.compile_ahead()
    checkpoints.follow(syncer)
    service = SyncerService(syncer, address=dc.syncer, token=shared_token(config)).start()
    (folder / "address.json").write_text(json.dumps({"port": service.port, "pid": os.getpid(), "restored": restored}))
    print(f"syncer: listening on port {service.port} for {d.num_replicas} islands"
          + (f", resumed at versions {syncer.versions}" if restored is not None else ""), flush=True)

    stop = threading.Event()
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
    try:
        while not stop.wait(0.05):
            if next_eval is not None and syncer.tokens_merged >= next_eval:
                evaluate()
                next_eval = (syncer.tokens_merged // every + 1) * every
    finally:
        service.stop()
        evaluate()
        checkpoints.close()
        summary = {"tokens_merged": round(syncer.tokens_merged), "tokens_refused": round(syncer.tokens_refused),
                   "merges": len(syncer.merges), "merges_by_grace": sum(r.by_grace for r in syncer.merges),
                   "versions": syncer.versions}
        (folder / "summary.json").write_text(json.dumps(summary))
        merges.close()
        evals.close()
    return 0
