"""JAX's persistent compilation cache, on by default for the CLI.

A second run of the same config (same model, mesh, replicas, fragments, quantization)
loads its compiled programs from disk instead of compiling them again. A cache hit is the
same executable, so results are unchanged.

The folder is, first match wins: `$JAX_COMPILATION_CACHE_DIR` (JAX's own variable; also
used when JAX was already configured with a folder, as the tests do),
`$XDG_CACHE_HOME/eqx_diloco/jax`, `~/.cache/eqx_diloco/jax`. `--no-compile-cache` turns it off.

JAX writes cache entries from process 0 only (to spare shared filesystems concurrent writes of
one key). On GPU every process's programs have one key, so the others read process 0's entries;
on CPU a key includes the process's own devices. There a program of several processes gets one
key where their hosts compile alike, and its lowest process compiles it for all of them
(`_compile_share`); a program of one process's own devices keeps a key of its own, so every
process writes its own entries (their keys differ, so no two processes write one file).
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
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
    folder: Path | None = Path(configured) if configured else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"warning: compilation cache off: cannot create {folder}: {e.strerror}", file=sys.stderr)
        folder = None
    if folder is not None:
        jax.config.update("jax_compilation_cache_dir", str(folder))
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            # Cache every program, not only those over JAX's default 1 s of compile time (unless the user
            # chose a minimum): start-up compiles many small programs (placement, the initialisation,
            # evaluation, the outer syncs) whose sum counts.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        from ._compile_share import share_compiles

        if folder is not None:
            let_every_process_write()  # for the programs of one process's own devices
        share_compiles(folder)  # every process takes part, with a cache or without
    return folder


# The arguments of the JAX function that writes one entry (jax._src.compiler._cache_write).
_WRITE_ARGUMENTS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]


def every_process_writes() -> bool:
    """Whether `let_every_process_write` is in force in this process."""
    try:
        from jax._src import compiler
    except ImportError:
        return False
    return getattr(getattr(compiler, "_cache_write", None), "every_process", False)


def let_every_process_write() -> bool:
    """Let this process write its own compiled programs to the persistent cache, not only process 0.

    Only for CPU runs (see the module's docstring). JAX offers no switch for it, so this replaces
    its private writer with one that keeps every other rule (no programs with host callbacks,
    JAX's minimum compile time). Returns False, changing nothing, when this JAX's writer is not
    the one expected (then the other processes compile as before).
    """
    try:
        from jax._src import compilation_cache, compiler
    except ImportError:
        return False
    if every_process_writes():
        return True
    original = getattr(compiler, "_cache_write", None)
    if (original is None or not hasattr(compilation_cache, "put_executable_and_time")
            or list(inspect.signature(original).parameters) != _WRITE_ARGUMENTS):
        return False

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if host_callbacks or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # as JAX does: a cache that cannot be written costs a compile, not the run
            warnings.warn(f"Error writing persistent compilation cache entry for '{module_name}': "
                          f"{type(e).__name__}: {e}", stacklevel=2)
        return None

    write.every_process = True
    write.jax_writer = original
    compiler._cache_write = write
    return True
