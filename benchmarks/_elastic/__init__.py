"""Parts of `python -m benchmarks.elastic` (see its docstring)."""
