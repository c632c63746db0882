"""Compiler options for the programs that run once per run: building the model and the state.

On a CPU, XLA's LLVM back end at its default optimisation level spends seconds on each
program; a small model's initialisation compiles in less than half the time at level 0 and
then runs in milliseconds all the same (measured: 2 x 64 model, one core, 2.65 s -> 1.13 s to
compile, 1.3 -> 10 ms to run). That is a cold start's time, every process of it. A large
model's initialisation runs long enough for the optimised code to pay, and accelerators
compile these programs quickly, so they keep the defaults.
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
