"""JAX's persistent compilation cache, on by default for the CLI.

A second run of the same config (same model, mesh, replicas, fragments, quantization)
loads its compiled programs from disk instead of compiling them again. A cache hit is the
same executable, so results are unchanged.

The folder is, first match wins: `$JAX_COMPILATION_CACHE_DIR` (JAX's own variable; also
used when JAX was already configured with a folder, as the tests do),
`$XDG_CACHE_HOME/eqx_diloco/jax`, `~/.cache/eqx_diloco/jax`. `--no-compile-cache` turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax


def default_cache_dir() -> Path:
    """The per-user cache folder: `$XDG_CACHE_HOME/eqx_diloco/jax`, else `~/.cache/eqx_diloco/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eqx_diloco" / "jax"


def enable_compilation_cache(config) -> Path | None:
    """Point JAX's persistent compilation cache at the cache folder (before the first compile).

    Returns the folder in use, or None when `config.compile_cache` is False or the folder
    cannot be created (then a one-line warning is printed and the run goes on uncached).
    """
    if not getattr(config, "compile_cache", True):
        return None
    configured = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    folder = Path(configured) if configured else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"warning: compilation cache off: cannot create {folder}: {e.strerror}", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if not configured:
        # Cache every program, not only those over JAX's default 1 s of compile time: start-up
        # compiles many small programs (placement, evaluation, the outer syncs) whose sum counts.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder
