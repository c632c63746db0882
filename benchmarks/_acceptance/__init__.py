"""Parts of `python -m benchmarks.acceptance` (see its docstring)."""
