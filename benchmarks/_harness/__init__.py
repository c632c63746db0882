"""The harness every benchmark script shares; scripts reach it through `benchmarks._common`."""
