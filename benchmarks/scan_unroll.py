"""The layer stack rolled (`--model.scan-unroll 1`) against unrolled (`0`): step time and compile time.

For each model shape and depth, one process on one CPU device builds the same model twice, once
with each setting (the parameters are identical: `scan_unroll` changes only how the stack is
applied), and a plain training step for each (`jax.jit` of value_and_grad + optax AdamW, params
and optimizer state donated; the same fixed token batch every step).

- Compile time: `lower` + `compile` of each step from abstract shapes, fresh (no persistent
  cache), `compile_reps` times interleaved; the fastest try is reported (other load on a shared
  machine only ever adds time).
- Step time: after `warmup_steps` untimed steps of each, `rounds` rounds; every round times
  `steps_per_round` steps of each setting, the order alternating between rounds. The speed-up is
  the median over rounds of (rolled seconds / unrolled seconds) within the round, with its range.

This is the evidence behind `scan_unroll="auto"` (all layers up to `AUTO_UNROLL_MAX_LAYERS`,
rolled above). Run `python -m benchmarks.scan_unroll --help`; about 3.5 minutes on 2 idle cores.
Output in `--out-dir` (default `runs/benchmarks/scan_unroll_default`; committed results only
with `--out-dir benchmarks/results`): `scan_unroll.json` and `scan_unroll.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    num_heads: int
    batch_size: int
    seq_len: int
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Settings:
    shapes: tuple[Shape, ...] = (
        # The side-by-side config of benchmarks/vs_torchft.py, and the trainer's default shape.
        Shape("width 64, batch 4 x 64", 64, 2, 4, 64, (2, 6, 12, 24)),
        Shape("width 128, batch 8 x 128 (trainer default)", 128, 4, 8, 128, (2, 6, 12, 24)),
    )
    warmup_steps: int = 2
    steps_per_round: int = 3
    rounds: int = 5
    compile_reps: int = 2


SMOKE = Settings(shapes=(Shape("smoke", 16, 2, 2, 16, (2,)),), warmup_steps=1, steps_per_round=1, rounds=2,
                 compile_reps=1)
VARIANTS = {"rolled": 1, "unrolled": 0}  # --model.scan-unroll of each


def _step_and_state(shape: Shape, num_layers: int, scan_unroll: int):
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from benchmarks._throughput.plain_loop import make_plain_step, plain_optimizer
    from eqx_diloco.lm.config import TrainConfig
    from models import Transformer, TransformerConfig

    config = TransformerConfig(num_layers=num_layers, dim=shape.dim, num_heads=shape.num_heads, dtype="float32",
                               scan_unroll=scan_unroll)
    model = eqx.filter_jit(Transformer)(config, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = plain_optimizer(TrainConfig(steps=10_000, warmup_steps=10), model)
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(jax.random.key(1), (shape.batch_size, shape.seq_len + 1), 0, config.vocab_size,
                                dtype=jnp.int32)
    return (lambda: make_plain_step(optimizer, static)), params, opt_state, tokens


def _compile_seconds(new_step, params, opt_state, tokens) -> float:
    """Lower + compile of a freshly built step (a new `jax.jit` object: JAX keeps compiled programs
    per jitted function in memory, so compiling the same one again would cost nothing)."""
    import jax

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt_state, tokens))
    step = new_step()
    t0 = time.perf_counter()
    step.lower(*abstract).compile()
    return time.perf_counter() - t0


def measure(s: Settings, shape: Shape, num_layers: int, log) -> dict[str, Any]:
    import jax

    built = {name: _step_and_state(shape, num_layers, unroll) for name, unroll in VARIANTS.items()}
    compile_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(s.compile_reps):
        for name, (new_step, params, opt_state, tokens) in built.items():
            compile_s[name].append(_compile_seconds(new_step, params, opt_state, tokens))
    state = {name: [params, opt_state] for name, (_, params, opt_state, _) in built.items()}
    steps = {name: new_step() for name, (new_step, _, _, _) in built.items()}

    def run(name: str, count: int) -> float:
        step, tokens = steps[name], built[name][3]
        t0 = time.perf_counter()
        for _ in range(count):
            state[name][0], state[name][1], loss = step(*state[name], tokens)
        jax.block_until_ready(loss)
        return time.perf_counter() - t0

    for name in VARIANTS:
        run(name, s.warmup_steps)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(s.rounds):
        for name in (list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))):
            seconds[name].append(run(name, s.steps_per_round) / s.steps_per_round)
    speedups = [a / b for a, b in zip(seconds["rolled"], seconds["unrolled"])]
    row = {
        "shape": shape.name, "layers": num_layers,
        **{f"compile_{name}_s": min(compile_s[name]) for name in VARIANTS},
        **{f"step_{name}_ms": 1e3 * statistics.median(seconds[name]) for name in VARIANTS},
        "speedup": statistics.median(speedups), "speedup_min": min(speedups), "speedup_max": max(speedups),
        "all": {"compile_s": compile_s, "step_s": seconds},
    }
    row["compile_ratio"] = row["compile_unrolled_s"] / row["compile_rolled_s"]
    row["speedup_range"] = f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}x"
    log(f"  {shape.name}, {num_layers} layers: step {row['step_rolled_ms']:.1f} -> {row['step_unrolled_ms']:.1f} ms "
        f"({row['speedup']:.2f}x), compile {row['compile_rolled_s']:.2f} -> {row['compile_unrolled_s']:.2f} s")
    return row


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    table = common.markdown_table(result["rows"], [
        ("shape", "shape", None), ("layers", "layers", None),
        ("step, rolled", "step_rolled_ms", lambda v: f"{v:.1f} ms"),
        ("step, unrolled", "step_unrolled_ms", lambda v: f"{v:.1f} ms"),
        ("unrolled speed-up", "speedup", lambda v: f"{v:.2f}x"),
        ("range over rounds", "speedup_range", None),
        ("compile, rolled", "compile_rolled_s", lambda v: f"{v:.2f} s"),
        ("compile, unrolled", "compile_unrolled_s", lambda v: f"{v:.2f} s"),
        ("compile unrolled / rolled", "compile_ratio", lambda v: f"{v:.2f}x"),
    ])
    return "\n".join([
        "# Layer stack rolled (scan unroll 1) vs unrolled (0)", "",
        (f"Revision {result['revision']}; {result['machine']['backend']}, 1 device, {result['machine']['cpu_count']} "
         f"cores. A plain jitted AdamW step, float32; step time = median over {s['rounds']} interleaved rounds of "
         f"{s['steps_per_round']} steps; compile = fastest of {s['compile_reps']} fresh lower + compile."), "",
        table, "",
    ])


def run(settings: Settings = Settings(), *, out_dir: pathlib.Path | None = None, log=None,
        write: bool = True) -> dict[str, Any]:
    log = log or (lambda msg: print(msg, flush=True))
    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir or common.default_out_dir("scan_unroll", "smoke" if settings == SMOKE else "default"))
    rows = []
    for shape in settings.shapes:
        for num_layers in shape.layers:
            rows.append(measure(settings, shape, num_layers, log))
    result = {"benchmark": "scan_unroll", "settings": dataclasses.asdict(settings), "machine": common.machine_info(),
              "revision": common.revision(), "rows": rows, "total_elapsed_s": time.perf_counter() - start}
    text = report(result)
    if write:
        common.write_text(out_dir / "scan_unroll.md", text)
        common.write_json(out_dir / "scan_unroll.json", result)
    return result | {"markdown": text}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="microscopic settings (tests only)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/scan_unroll_default; committed results under "
                             "benchmarks/results only when given explicitly)")
    args = parser.parse_args(argv)
    common.setup_jax(1)
    result = run(SMOKE if args.smoke else Settings(), out_dir=args.out_dir)
    print()
    print(result["markdown"])
    print(f"total {result['total_elapsed_s']:.0f}s")
    return result


if __name__ == "__main__":
    main()
