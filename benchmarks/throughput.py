"""Speed of the inner step, compile time of scan vs unrolled layers, and model FLOPs utilization.

(a) Tokens/s of the trainer's jitted DiLoCo inner step (`Trainer.inner_step`: shard_map
    over the mesh, per-replica AdamW, metrics) with R = 1 on one device, against a plain
    training loop written here: `jax.jit` of value_and_grad + optax AdamW (the same
    clipping, schedule, weight-decay mask and hyper-parameters as the trainer's inner
    optimizer), same model, same batch, same device, params and optimizer state donated.
    Also R = 2 on 2 devices (twice the tokens per step), against the same plain loop.
    Measured in one process, interleaved: every round times `steps_per_round` steps of
    each variant (rotating their order), all compiled and warmed up beforehand; the
    ratio is the median over rounds of (variant tokens/s) / (plain tokens/s) in that round.
    The same fixed token batch is fed to every step (no host data pipeline in the timing).

(b) Compile time (`jax.jit(step).lower(...)`, then `.compile()`, both timed) of the plain
    train step with the model's `lax.scan` over the stacked layers against the same step
    with the layers unrolled (a Python loop indexing layer i out of the stacked arrays),
    for 4, 12 and 24 layers, plus the trainer's own inner step (scan) for reference. Each
    is compiled `compile_reps` times (interleaved) from abstract shapes, fresh each time,
    and the fastest try is reported: on a shared machine other load only adds time.

(c) Model FLOPs utilization = model FLOPs per token x tokens/s / peak FLOP/s. FLOPs per
    token for training (forward + backward = 3 x forward):

        6 * N_matmul + 12 * L * T * d

    N_matmul = the weights used in matrix multiplies: per layer d*3d (qkv) + d*d (out) +
    2*d*(mlp_ratio*d) (MLP), plus d*V for the output head (the embedding lookup, norms
    and biases do no matmul FLOPs). The second term is attention's two T x T products
    (q k^T and weights @ v, 2*T*d FLOPs each per token and layer in the forward pass),
    counted for the full T x T matrix because the model computes it and masks it (PaLM's
    6N + 12 L H Q T with H Q = d). Peak = the best FLOP/s of a jitted float32 matmul of
    size n x n x n (2 n^3 FLOPs) on one device, measured in the same run (before and after
    the step timings; the higher one is used).

Run `python -m benchmarks.throughput --help`. About 3-5 minutes on 2 idle CPU cores.

Output in `--out-dir` (default `runs/benchmarks/throughput_default`, or `throughput_smoke`
with `--smoke`; the committed results under `benchmarks/results` are written only when
`--out-dir benchmarks/results` is given): `throughput.json` (or `--json PATH`) and
`throughput.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Settings:
    num_layers: int = 4
    dim: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    seq_len: int = 128
    batch_size: int = 8
    warmup_steps: int = 3  # untimed steps of each variant (>= 2: the second call may compile again)
    steps_per_round: int = 4
    rounds: int = 6
    with_r2: bool = True
    compile_layers: tuple[int, ...] = (4, 12, 24)
    compile_trainer_step: bool = True
    compile_reps: int = 2
    matmul_sizes: tuple[int, ...] = (1024, 2048)
    matmul_reps: int = 5


SMOKE = Settings(num_layers=2, dim=16, num_heads=2, mlp_ratio=2, seq_len=16, batch_size=2, warmup_steps=2,
                 steps_per_round=1, rounds=2, with_r2=False, compile_layers=(2,), compile_trainer_step=False,
                 compile_reps=1, matmul_sizes=(64,), matmul_reps=2)


def model_config(s: Settings, num_layers: int | None = None):
    from models import TransformerConfig

    return TransformerConfig(num_layers=num_layers or s.num_layers, dim=s.dim, num_heads=s.num_heads,
                             mlp_ratio=s.mlp_ratio)


def train_config(s: Settings):
    from eqx_diloco.lm.config import TrainConfig

    return TrainConfig(steps=10_000, batch_size=s.batch_size, seq_len=s.seq_len, warmup_steps=10, eval_every=0,
                       log_every=1000, eval_sequences=2)


def model_flops(cfg, seq_len: int) -> dict[str, float]:
    """Parameter counts and training FLOPs per token (see the module docstring)."""
    d, L, V = cfg.dim, cfg.num_layers, cfg.vocab_size
    per_layer = d * 3 * d + d * d + 2 * d * cfg.mlp_ratio * d
    n_matmul = L * per_layer + d * V
    n_total = L * (per_layer + 2 * d) + V * d + d + (0 if cfg.tie_embeddings else d * V)
    attention = 12 * L * seq_len * d
    return {"n_params": n_total, "n_matmul": n_matmul, "flops_per_token": 6 * n_matmul + attention,
            "attention_flops_per_token": attention}


# -- the plain loop and the unrolled model --------------------------------------------


def plain_optimizer(train, model):
    """AdamW like the trainer's inner optimizer, built here from optax directly."""
    import optax

    decay_steps = max(train.steps, train.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, train.lr, train.warmup_steps, decay_steps,
                                                  train.lr * train.min_lr_ratio)
    adamw = optax.adamw(schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
                        mask=model.weight_decay_mask())
    return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw) if train.grad_clip > 0 else adamw


def unrolled_logits(model, tokens):
    """The model's forward pass with a Python loop over layers instead of `lax.scan`."""
    import equinox as eqx
    import jax

    from models.transformer import rotary_tables

    cfg = model.config
    cos, sin = rotary_tables(tokens.shape[0], cfg.head_dim, cfg.rope_base)
    x = model.embed[tokens]
    params, static = eqx.partition(model.blocks, eqx.is_array)
    for i in range(cfg.num_layers):
        block = eqx.combine(jax.tree.map(lambda a: a[i], params), static)
        x, _ = block(x, cos, sin)
    x = model.final_norm(x)
    return x @ (model.embed.T if model.head is None else model.head)


def unrolled_loss(model, tokens):
    """Mean next-token cross entropy with the unrolled forward pass (dense models)."""
    import jax
    import jax.numpy as jnp

    logits = jax.vmap(lambda t: unrolled_logits(model, t))(tokens[:, :-1])
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1))


def scan_loss(model, tokens):
    from models.transformer import lm_loss

    return lm_loss(model, tokens)[0]


def make_plain_step(optimizer, static, loss_fn=scan_loss):
    """`step(params, opt_state, tokens) -> (params, opt_state, loss)`: jit, params and state donated."""
    import equinox as eqx
    import jax
    import optax

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), tokens))(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes float and int32
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# -- (c) peak ---------------------------------------------------------------------------


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


# -- (b) compile time -----------------------------------------------------------------


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


# -- report ---------------------------------------------------------------------------


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    f = result["flops"]
    peak = result["peak"]["flops_per_s"]
    m = result["machine"]
    tp_rows = [dict(r, gflops=r["tokens_per_s"] * f["flops_per_token"] / 1e9,
                    mfu=r["tokens_per_s"] * f["flops_per_token"] / peak) for r in result["throughput"]["rows"]]
    compile_rows = []
    for r in result["compile"]:
        compile_rows.append({
            "layers": r["layers"],
            "scan": r["scan"]["total_s"], "scan_lower": r["scan"]["lower_s"],
            "unrolled": r["unrolled"]["total_s"], "unrolled_lower": r["unrolled"]["lower_s"],
            "ratio": r["unrolled_over_scan"],
            "trainer": r.get("trainer_scan", {}).get("total_s"),
        })
    sec = lambda v: f"{v:.2f}s"  # noqa: E731
    lines = [
        "# Throughput, compile time and MFU",
        "",
        f"Model: {s['num_layers']} layers, dim {s['dim']}, {s['num_heads']} heads, mlp x{s['mlp_ratio']}, "
        f"vocab 256; seq {s['seq_len']}, batch {s['batch_size']} per replica. "
        f"{f['n_params']:,} params ({f['n_matmul']:,} in matmuls); "
        f"training FLOPs/token = 6 N_matmul + 12 L T d = {f['flops_per_token'] / 1e6:.2f} M. "
        f"Machine: {m['backend']}, {m['cpu_count']} cores, jax {m['jax']}. "
        f"Peak (jitted float32 matmul, 1 device): {peak / 1e9:.1f} GFLOP/s.",
        "",
        f"## (a) Tokens/s (median of {s['rounds']} interleaved rounds x {s['steps_per_round']} steps; "
        "ratio = median per-round ratio to the plain loop)",
        "",
        common.markdown_table(tp_rows, [
            ("variant", "variant", None),
            ("tokens/step", "tokens_per_step", None),
            ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
            ("vs plain loop", "ratio_vs_plain", lambda v: f"{v:.3f}x"),
            ("model GFLOP/s", "gflops", lambda v: f"{v:.1f}"),
            ("MFU", "mfu", lambda v: f"{100 * v:.1f}%"),
        ]),
        "",
        f"## (b) Compile time of the train step (lower + compile; fastest of {s['compile_reps']} interleaved tries)",
        "",
        common.markdown_table(compile_rows, [
            ("layers", "layers", None),
            ("scan", "scan", sec),
            ("(of which lower)", "scan_lower", sec),
            ("unrolled", "unrolled", sec),
            ("(of which lower)", "unrolled_lower", sec),
            ("unrolled / scan", "ratio", lambda v: f"{v:.2f}x"),
            ("trainer inner step (scan)", "trainer", sec),
        ]),
        "",
        "Timing noise: wall-clock numbers on a shared machine; ratios are measured within one run.",
        "",
    ]
    return "\n".join(lines)


def run(settings: Settings = Settings(), *, out_dir: pathlib.Path | None = None, json_path=None, log=None,
        write: bool = True) -> dict[str, Any]:
    """All three measurements; writes JSON and markdown. Expects >= 2 CPU devices set up for R = 2."""
    log = log or (lambda msg: print(msg, flush=True))
    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir or common.default_out_dir("throughput", "smoke" if settings == SMOKE else "default"))
    with common.TemporaryRunDirs() as runs_dir:
        log("peak matmul ...")
        peak_before = measure_matmul_peak(settings.matmul_sizes, settings.matmul_reps)
        log(f"  {peak_before['flops_per_s'] / 1e9:.1f} GFLOP/s")
        log("tokens/s ...")
        throughput = measure_throughput(settings, runs_dir, log)
        for r in throughput["rows"]:
            log(f"  {r['variant']:<36} {r['tokens_per_s']:>10,.0f} tok/s"
                + (f"  {r['ratio_vs_plain']:.3f}x plain" if "ratio_vs_plain" in r else ""))
        peak_after = measure_matmul_peak(settings.matmul_sizes, settings.matmul_reps)
        log(f"  peak again: {peak_after['flops_per_s'] / 1e9:.1f} GFLOP/s")
        log("compile times ...")
        compile_rows = measure_compile(settings, runs_dir, log)
    peak = max((peak_before, peak_after), key=lambda p: p["flops_per_s"])
    flops = model_flops(model_config(settings), settings.seq_len)
    for r in throughput["rows"]:
        r["model_flops_per_s"] = r["tokens_per_s"] * flops["flops_per_token"]
        r["mfu"] = r["model_flops_per_s"] / peak["flops_per_s"]
    result = {
        "benchmark": "throughput",
        "settings": dataclasses.asdict(settings),
        "machine": common.machine_info(),
        "flops": flops,
        "flops_formula": "6 * N_matmul + 12 * L * T * d per token (training; full T x T attention)",
        "peak": {**peak, "before": peak_before["flops_per_s"], "after": peak_after["flops_per_s"]},
        "throughput": throughput,
        "compile": compile_rows,
        "total_elapsed_s": time.perf_counter() - start,
    }
    text = report(result)
    if write:
        common.write_text(out_dir / "throughput.md", text)
        common.write_json(json_path or out_dir / "throughput.json", result)
    return result | {"markdown": text}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="microscopic settings (tests only)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps-per-round", type=int, default=None)
    parser.add_argument("--compile-layers", type=int, nargs="*", default=None)
    parser.add_argument("--no-r2", action="store_true", help="skip the R = 2 inner step")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/throughput_default, --smoke: throughput_smoke; "
                             "committed results under benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default: <out-dir>/throughput.json)")
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else Settings()
    args.out_dir = args.out_dir or common.default_out_dir("throughput", "smoke" if args.smoke else "default")
    overrides = {k: v for k, v in (("rounds", args.rounds), ("steps_per_round", args.steps_per_round)) if v}
    if args.compile_layers is not None:
        overrides["compile_layers"] = tuple(args.compile_layers)
    if args.no_r2:
        overrides["with_r2"] = False
    settings = dataclasses.replace(settings, **overrides)
    common.setup_jax(2)
    result = run(settings, out_dir=args.out_dir, json_path=args.json)
    print()
    print(result["markdown"])
    print(f"total {result['total_elapsed_s']:.0f}s; wrote {args.json or args.out_dir / 'throughput.json'}, "
          f"{args.out_dir / 'throughput.md'}")
    return result


if __name__ == "__main__":
    main()
