"""Parts of `python -m benchmarks.throughput` (see its docstring)."""
