"""Compiler options for the programs that run rarely: building the model and the state (once per
run), the outer syncs and the global model's finite check (once per sync).

On a CPU, XLA's defaults spend seconds on each program: LLVM's optimisations and its per-fusion
emitters. At LLVM level 0 with XLA:CPU's older (non-MLIR) fusion emitters the same programs compile
several times faster and run several times slower (benchmarks/results/rare_programs.md, one core:
the default model's blocking sync compiles in 0.35 s instead of 1.45 s, then runs in 54 ms instead of
13 ms). Unoptimised code pays while what it adds over the whole run stays under what it saves at
the start: the sync costs 26-33 ns more per parameter per run, so 2^24 parameter-runs add at most
about 0.55 s, against 1.0-1.1 s of compilation saved. An evaluation runs about twice as long
unoptimised, and a run evaluates again and again: it keeps XLA's defaults, as does every program
that runs at every step. Accelerators compile these programs quickly: they keep the defaults.
"""

from typing import Any

import jax

UNOPTIMISED_BUDGET = 1 << 24  # parameters x runs up to which a rare program compiles unoptimised on CPU


def rare_program_options(num_params: int, *, runs: int = 1, backend: str | None = None) -> dict[str, Any] | None:
    """`compiler_options` for a program over `num_params` parameters that runs `runs` times (on
    `backend`, default JAX's): unoptimised code on a CPU within `UNOPTIMISED_BUDGET`, else None
    (XLA's defaults)."""
    if (backend or jax.default_backend()) != "cpu" or num_params * max(runs, 1) > UNOPTIMISED_BUDGET:
        return None
    return {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def options_key(options: dict[str, Any] | None) -> tuple:
    """`compiler_options` as sorted items: a hashable key for a cache of programs compiled with them."""
    return tuple(sorted((options or {}).items()))
