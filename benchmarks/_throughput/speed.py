"""(c) the peak matmul rate of this machine, and (a) tokens per second of the plain loop
and of the DiLoCo inner step."""

from __future__ import annotations

import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._throughput.plain_loop import make_plain_step, plain_optimizer
from benchmarks._throughput.settings import Settings, model_config, train_config


def measure_matmul_peak(sizes: Sequence[int], reps: int) -> dict[str, Any]:
    """Best FLOP/s of a jitted float32 n x n @ n x n on the default device."""
    import jax
    import jax.numpy as jnp

    per_size = {}
    matmul = jax.jit(jnp.matmul)
    for n in sizes:
        a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
        matmul(a, b).block_until_ready()  # compile + warm up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            matmul(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        per_size[n] = 2 * n**3 / min(times)
    return {"flops_per_s": max(per_size.values()), "per_size": per_size}


# -- (a) tokens/s -------------------------------------------------------------------------


class _Plain:
    """The plain loop, starting from `model` (the trainer's initial weights, so both do the same work)."""

    name = "plain optax loop (1 device)"

    def __init__(self, s: Settings, tokens_np, model):
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        device = jax.devices()[0]
        params, static = eqx.partition(model, eqx.is_array)
        self.params = jax.device_put(jax.tree.map(jnp.copy, params), device)
        optimizer = plain_optimizer(train_config(s), model)
        self.opt_state = jax.device_put(optimizer.init(self.params), device)
        self.step_fn = make_plain_step(optimizer, static)
        self.tokens = jax.device_put(jnp.asarray(tokens_np[0]), device)
        self.tokens_per_step = tokens_np.shape[1] * (tokens_np.shape[2] - 1)

    def step(self):
        self.params, self.opt_state, self.loss = self.step_fn(self.params, self.opt_state, self.tokens)

    def block(self):
        import jax

        jax.block_until_ready((self.params, self.opt_state))


class _Inner:
    def __init__(self, s: Settings, replicas: int, tokens_np, run_dir: pathlib.Path):
        import jax
        import numpy as np

        from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig
        from eqx_diloco.lm.trainer import Trainer

        config = Config(algorithm="diloco", run_dir=run_dir, model=model_config(s), train=train_config(s),
                        diloco=DiLoCoConfig(num_replicas=replicas, sync_period=1),
                        data=DataConfig(source="synthetic"), checkpoint=CheckpointConfig(every=0))
        self.name = f"DiLoCo inner step R={replicas} ({replicas} device{'s' if replicas > 1 else ''})"
        self.trainer = Trainer(config, verbose=False)
        self.state, _ = self.trainer.initial_state()
        batch = np.concatenate([tokens_np] * replicas, axis=0)
        self.tokens = jax.device_put(batch, self.trainer.batch_sharding)
        self.tokens_per_step = replicas * tokens_np.shape[1] * (tokens_np.shape[2] - 1)

    def step(self):
        self.state, self.metrics = self.trainer.inner_step(self.state, self.tokens)

    def block(self):
        import jax

        jax.block_until_ready(self.state)


def measure_throughput(s: Settings, runs_dir: pathlib.Path, log) -> dict[str, Any]:
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, 256, (1, s.batch_size, s.seq_len + 1)).astype(np.int32)
    inner = _Inner(s, 1, tokens_np, runs_dir / "r1")
    initial_model = jax.tree.map(lambda x: x[0], inner.state.params)  # replica 0's (= everyone's) initial weights
    variants = [_Plain(s, tokens_np, initial_model), inner]
    if s.with_r2 and len(jax.devices()) >= 2:
        variants.append(_Inner(s, 2, tokens_np, runs_dir / "r2"))
    for v in variants:  # compile and warm up (untimed)
        t0 = time.perf_counter()
        for _ in range(max(2, s.warmup_steps)):
            v.step()
        v.block()
        log(f"  warm-up {v.name}: {time.perf_counter() - t0:.1f}s (includes compile)")
    tps: dict[str, list[float]] = {v.name: [] for v in variants}
    ratios: dict[str, list[float]] = {v.name: [] for v in variants[1:]}
    for r in range(s.rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        this_round = {}
        for v in order:
            v.block()
            t0 = time.perf_counter()
            for _ in range(s.steps_per_round):
                v.step()
            v.block()
            this_round[v.name] = s.steps_per_round * v.tokens_per_step / (time.perf_counter() - t0)
        for name, value in this_round.items():
            tps[name].append(value)
        for v in variants[1:]:
            ratios[v.name].append(this_round[v.name] / this_round[variants[0].name])
    rows = []
    for v in variants:
        row = {"variant": v.name, "tokens_per_step": v.tokens_per_step, "tokens_per_s": statistics.median(tps[v.name]),
               "tokens_per_s_rounds": tps[v.name]}
        if v.name in ratios:
            row["ratio_vs_plain"] = statistics.median(ratios[v.name])
            row["ratio_rounds"] = ratios[v.name]
        rows.append(row)
    return {"rows": rows}
