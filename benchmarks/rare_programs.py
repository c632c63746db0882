"""A sync program compiled with XLA's defaults against unoptimised (`rare_program_options`): compile
time and run time.

The trainer's blocking DiLoCo sync (`sync_and_merge`: outer gradient, one psum over the replicas,
Nesterov outer step, finite checks, merge) for the LM at two sizes, R = 2 on 2 simulated CPU
devices, and the process held to one core, as each process of a 2-process `launch` is. For each
size and variant (XLA's defaults; LLVM level 0 with XLA:CPU's older fusion emitters):

- compile: `compile_outer_ahead` of a fresh `DiLoCo` (new programs, no persistent cache), the
  fastest of `compile_reps` tries;
- run: the median of `runs` calls, each waited for, after one untimed call.

From these: the extra run time of unoptimised code per parameter per sync, and the syncs after
which it has cost what its faster compile saved. The evaluation of the global model (32 sequences
of 128 tokens, the CLI's defaults) is timed the same way, to show why it keeps XLA's defaults. This is the evidence behind
`eqx_diloco/_rare_programs.py` (`UNOPTIMISED_BUDGET`). Run `python -m benchmarks.rare_programs
--help`; about a minute. Output in `--out-dir` (default `runs/benchmarks/rare_programs_default`;
committed results only with `--out-dir benchmarks/results`): `rare_programs.json`, `rare_programs.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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
class Settings:
    shapes: tuple[tuple[int, int], ...] = ((2, 64), (6, 128))  # (layers, width): the vs_torchft model, the default
    compile_reps: int = 2
    runs: int = 30


SMOKE = Settings(shapes=((1, 32),), compile_reps=1, runs=3)
VARIANTS = ("defaults", "unoptimised")


def _core(num_layers: int, dim: int, options: dict | None):
    import jax
    import optax

    from eqx_diloco import DiLoCo
    from eqx_diloco.lm._core import lm_objective, new_model
    from models import TransformerConfig

    config = TransformerConfig(vocab_size=256, dim=dim, num_layers=num_layers, num_heads=2)
    core = DiLoCo(loss_fn=lm_objective(0.0), layers=lambda m: m.blocks, num_replicas=2, sync_period=10,
                  inner_optimizer=optax.adamw(3e-4), sync_compiler_options=options)
    return core, core.init(new_model(config, jax.random.key(0))), config.num_params()


def _evaluation_seconds(core, state, options: dict | None, runs: int) -> tuple[float, float]:
    """(compile, median run) of the global model's evaluation compiled with `options`."""
    import equinox as eqx
    import jax
    import numpy as np

    from models.transformer import lm_loss

    model = core.global_model(state)
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, 256, (32, 129)), jax.numpy.int32)
    program = eqx.filter_jit(lambda m, t: lm_loss(m, t)[1]["ce"], compiler_options=options)
    start = time.perf_counter()
    jax.block_until_ready(program(model, tokens))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(program(model, tokens))
        times.append(time.perf_counter() - start)
    return compile_s - min(times), statistics.median(times)


def measure(s: Settings, num_layers: int, dim: int, log) -> dict[str, Any]:
    import jax

    from eqx_diloco._rare_programs import rare_program_options

    row: dict[str, Any] = {"shape": f"{num_layers} x {dim}"}
    for name in VARIANTS:
        options = rare_program_options(1) if name == "unoptimised" else None
        compiles = []
        for _ in range(s.compile_reps):
            core, state, row["params"] = _core(num_layers, dim, options)
            start = time.perf_counter()
            core.compile_outer_ahead(state)
            compiles.append(time.perf_counter() - start)
        state, _ = core.outer.sync_and_merge(state, 0)
        jax.block_until_ready(state)
        runs = []
        for _ in range(s.runs):
            start = time.perf_counter()
            state, finite = core.outer.sync_and_merge(state, 0)
            jax.block_until_ready((state, finite))
            runs.append(time.perf_counter() - start)
        row[f"compile_{name}_s"], row[f"run_{name}_ms"] = min(compiles), 1e3 * statistics.median(runs)
        compile_s, run_s = _evaluation_seconds(core, state, options, min(s.runs, 10))
        row[f"eval_compile_{name}_s"], row[f"eval_run_{name}_ms"] = compile_s, 1e3 * run_s
    row["compile_saved_s"] = row["compile_defaults_s"] - row["compile_unoptimised_s"]
    extra_s = (row["run_unoptimised_ms"] - row["run_defaults_ms"]) / 1e3
    row["extra_ns_per_param"] = 1e9 * extra_s / row["params"]
    row["break_even_syncs"] = row["compile_saved_s"] / extra_s if extra_s > 0 else float("inf")
    log(f"  {row['shape']} ({row['params']:,} parameters): compile {row['compile_defaults_s']:.2f} -> "
        f"{row['compile_unoptimised_s']:.2f} s, run {row['run_defaults_ms']:.2f} -> {row['run_unoptimised_ms']:.2f} ms")
    return row


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    table = common.markdown_table(result["rows"], [
        ("model (layers x width)", "shape", None), ("parameters", "params", lambda v: f"{v:,}"),
        ("compile, defaults", "compile_defaults_s", lambda v: f"{v:.2f} s"),
        ("compile, unoptimised", "compile_unoptimised_s", lambda v: f"{v:.2f} s"),
        ("run, defaults", "run_defaults_ms", lambda v: f"{v:.2f} ms"),
        ("run, unoptimised", "run_unoptimised_ms", lambda v: f"{v:.2f} ms"),
        ("extra run time per parameter", "extra_ns_per_param", lambda v: f"{v:.0f} ns"),
        ("syncs to break even", "break_even_syncs", lambda v: f"{v:.0f}"),
    ])
    evaluation = common.markdown_table(result["rows"], [
        ("model (layers x width)", "shape", None),
        ("evaluation compile, defaults", "eval_compile_defaults_s", lambda v: f"{v:.2f} s"),
        ("evaluation compile, unoptimised", "eval_compile_unoptimised_s", lambda v: f"{v:.2f} s"),
        ("evaluation run, defaults", "eval_run_defaults_ms", lambda v: f"{v:.1f} ms"),
        ("evaluation run, unoptimised", "eval_run_unoptimised_ms", lambda v: f"{v:.1f} ms"),
    ])
    return "\n".join([
        "# A sync program: XLA's defaults vs unoptimised (LLVM level 0, older fusion emitters)", "",
        (f"Revision {result['revision']}; {result['machine']['backend']}, 2 simulated devices (R = 2) held to one "
         f"core of {result['machine']['cpu_count']}. The trainer's blocking sync (`sync_and_merge`); compile = fastest "
         f"of {s['compile_reps']} fresh compiles; run = median of {s['runs']} calls. Syncs to break even: the compile "
         f"time saved over the extra run time per sync."), "",
        table, "", ("The global model's evaluation (32 sequences of 128 tokens; compile = first call less the "
                    "fastest run):"), "", evaluation, "",
    ])


def run(settings: Settings = Settings(), *, out_dir: pathlib.Path | None = None, log=None,
        write: bool = True) -> dict[str, Any]:
    log = log or (lambda msg: print(msg, flush=True))
    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir or common.default_out_dir("rare_programs", "smoke" if settings == SMOKE else "default"))
    rows = [measure(settings, layers, dim, log) for layers, dim in settings.shapes]
    result = {"benchmark": "rare_programs", "settings": dataclasses.asdict(settings), "machine": common.machine_info(),
              "revision": common.revision(), "rows": rows, "total_elapsed_s": time.perf_counter() - start}
    if write:
        common.write_text(out_dir / "rare_programs.md", report(result))
        common.write_json(out_dir / "rare_programs.json", result)
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="microscopic settings (tests only)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="default runs/benchmarks/rare_programs_default; benchmarks/results for committed results")
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):  # one core, before JAX sizes its thread pools
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    common.setup_jax(2)
    result = run(SMOKE if args.smoke else Settings(), out_dir=args.out_dir)
    print(report(result))
    print(f"total {result['total_elapsed_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
