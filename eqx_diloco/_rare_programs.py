"""Compiler options for the programs that run rarely: building the model and the state (once per
run), the outer syncs (once per sync), the global model's finite check and its evaluation.

On a CPU, XLA's defaults spend seconds on each program: LLVM's optimisations and its per-fusion
emitters. For a small model these programs then run in milliseconds either way, so a cold start
waits for their compilation, not for them. At LLVM level 0 with XLA:CPU's older (non-MLIR) fusion
emitters they compile 3-5x faster (a cold 2-process run of the vs_torchft config, per process:
initialisation 1.3 -> 0.4 s, the blocking sync 1.7 -> 0.3 s, evaluation 0.65 -> 0.17 s; see
benchmarks/results/startup_breakdown.md). The step, which runs at every step, keeps XLA's defaults;
so do large models, whose rare programs run long enough for optimised code to pay, and
accelerators, which compile these programs quickly.
"""

from typing import Any

import jax

SMALL_MODEL_PARAMS = 1 << 24  # up to this many parameters, a rare program compiles unoptimised on CPU


def rare_program_options(num_params: int, backend: str | None = None) -> dict[str, Any] | None:
    """`compiler_options` for a program that runs rarely on a model of `num_params` parameters (on
    `backend`, default JAX's): unoptimised code on a CPU for a small model, else None (XLA's defaults)."""
    if (backend or jax.default_backend()) != "cpu" or num_params > SMALL_MODEL_PARAMS:
        return None
    return {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
