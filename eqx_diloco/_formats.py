"""The names of the wire formats, apart from their code: the argument checks (`_arguments`) need
them before JAX is imported, so the CLI can refuse a bad flag within a second of starting."""

FORMATS: tuple[str, ...] = ("none", "bf16", "fp8", "int8", "int4", "e3m0", "int2")
