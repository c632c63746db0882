"""Parts of `python -m benchmarks.simulate`, the compute-utilization simulator (see its docstring)."""
