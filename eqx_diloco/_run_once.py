"""Compiler options for the programs that run once per run: building the model and the state.

On a CPU, XLA's LLVM back end at its default optimisation level spends seconds on each
program; a small model's initialisation compiles in about half the time at level 0 and then
runs in milliseconds all the same (the "state built or restored" phase of a cold 2-process
run in benchmarks/results/startup_breakdown.md: 3.1 s before, 1.6 s since). That is a cold
start's time, in every process. A large model's initialisation runs long enough for the
optimised code to pay, and accelerators compile these programs quickly: they keep XLA's defaults.
"""

from typing import Any

import jax

SMALL_MODEL_PARAMS = 1 << 24  # up to this many parameters, a run-once program compiles unoptimised on CPU


def run_once_options(num_params: int, backend: str | None = None) -> dict[str, Any] | None:
    """`compiler_options` for a program that runs once and builds a model of `num_params` parameters
    (on `backend`, default JAX's): unoptimised code on a CPU for a small model, else None (XLA's defaults)."""
    if (backend or jax.default_backend()) != "cpu" or num_params > SMALL_MODEL_PARAMS:
        return None
    return {"xla_backend_optimization_level": 0}
