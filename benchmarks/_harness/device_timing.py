"""Timing on the default device: seconds per call of a step, peak device memory, and the
device's bfloat16 matmul rate (the MFU denominator that benchmarks/gpu.py measures in the
same run as the step it divides)."""

from __future__ import annotations

import statistics
import time
from typing import Any


def time_calls(step, block, *, warmup: int, steps: int, rounds: int) -> dict[str, Any]:
    """Median seconds per call of `step` over `rounds` timed rounds of `steps` calls each."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    block()
    first_s = time.perf_counter() - t0
    per_step = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        block()
        per_step.append((time.perf_counter() - t0) / steps)
    return {"step_s": statistics.median(per_step), "step_s_rounds": per_step, "warmup_s": first_s}


def peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure_matmul(n: int, reps: int = 10) -> dict[str, Any]:
    """The device's bfloat16 matmul rate: an n x n x n product, median of `reps`."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return {"n": n, "flops_per_s": 2 * n**3 / statistics.median(times)}
