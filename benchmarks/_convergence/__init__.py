"""Parts of `python -m benchmarks.convergence` (see its docstring)."""
