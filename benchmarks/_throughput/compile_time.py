"""(b) compile time of one training step against depth: scanned vs unrolled layers, and
the trainer's own step."""

from __future__ import annotations

import pathlib
import time
from typing import Any

from benchmarks._throughput.plain_loop import make_plain_step, plain_optimizer, scan_loss, unrolled_loss
from benchmarks._throughput.settings import Settings, model_config, train_config


def compile_plain_step(s: Settings, num_layers: int, loss_fn) -> dict[str, float]:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from models import Transformer

    model = eqx.filter_eval_shape(Transformer, model_config(s, num_layers), key=jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    optimizer = plain_optimizer(train_config(s), model)
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((s.batch_size, s.seq_len + 1), jnp.int32)
    step = make_plain_step(optimizer, static, loss_fn)
    t0 = time.perf_counter()
    lowered = step.lower(params, opt_state, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def compile_trainer_step(s: Settings, num_layers: int, run_dir: pathlib.Path) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig
    from eqx_diloco.lm.trainer import Trainer

    config = Config(algorithm="diloco", run_dir=run_dir, model=model_config(s, num_layers), train=train_config(s),
                    diloco=DiLoCoConfig(num_replicas=1, sync_period=1), data=DataConfig(source="synthetic"),
                    checkpoint=CheckpointConfig(every=0))
    trainer = Trainer(config, verbose=False)
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         trainer.abstract_state, trainer.shardings)
    tokens = jax.ShapeDtypeStruct((1, s.batch_size, s.seq_len + 1), jnp.int32, sharding=trainer.batch_sharding)
    t0 = time.perf_counter()
    lowered = trainer.inner_step.lower(state, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def measure_compile(s: Settings, runs_dir: pathlib.Path, log) -> list[dict[str, Any]]:
    """Lower + compile times per layer count and variant: the fastest of `compile_reps`
    interleaved repetitions (compile time on a shared machine only ever gets slower)."""
    variants = {
        "scan": lambda L: compile_plain_step(s, L, scan_loss),
        "unrolled": lambda L: compile_plain_step(s, L, unrolled_loss),
    }
    if s.compile_trainer_step:
        variants["trainer_scan"] = lambda L: compile_trainer_step(s, L, runs_dir / f"c{L}")
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(s.compile_reps):
        for L in s.compile_layers:
            for key, fn in variants.items():
                samples.setdefault((L, key), []).append(fn(L))
    rows = []
    for L in s.compile_layers:
        row: dict[str, Any] = {"layers": L}
        for key in variants:
            runs = samples[(L, key)]
            row[key] = {**min(runs, key=lambda r: r["total_s"]), "all_total_s": [r["total_s"] for r in runs]}
        row["unrolled_over_scan"] = row["unrolled"]["total_s"] / row["scan"]["total_s"]
        rows.append(row)
        log(f"  compile L={L}: scan {row['scan']['total_s']:.1f}s, unrolled {row['unrolled']['total_s']:.1f}s"
            + (f", trainer inner step {row['trainer_scan']['total_s']:.1f}s" if "trainer_scan" in row else ""))
    return rows
