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

Two runs that share the folder (two runs of one config started together, a test session's workers)
may still write and read one key at once: `write_entries_atomically` makes every entry appear whole.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import uuid
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
        write_entries_atomically()
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


def write_entries_atomically() -> bool:
    """Make JAX's persistent cache publish each entry whole, for every process that reads the folder.

    Without a size limit, JAX writes an entry in place: another process that reads the same key
    meanwhile gets a truncated entry, warns and compiles again. Here an entry is written to a
    temporary file beside it and renamed over its name (atomic on a local filesystem), so a reader
    finds no entry or the whole one. Left to JAX: a cache with a size limit (JAX's own file lock
    then orders reads and writes) and a cache that is not on a local filesystem. Returns False,
    changing nothing, when this JAX's cache is not the one expected.
    """
    try:
        from jax._src import lru_cache
    except ImportError:
        return False
    cache_class = getattr(lru_cache, "LRUCache", None)
    original = getattr(cache_class, "put", None)
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if original is None or suffix is None or list(inspect.signature(original).parameters) != ["self", "key", "value"]:
        return False
    if getattr(original, "atomic", False):
        return True

    def put(self, key: str, value: bytes) -> None:
        folder = str(self.path)
        if getattr(self, "eviction_enabled", True) or not key or "://" in folder:
            return original(self, key, value)
        target = os.path.join(folder, f"{key}{suffix}")
        if os.path.exists(target):
            return None  # as JAX does: the first entry of a key stays
        # A name of this writer's own (a dot first, so it never looks like an entry); created with
        # the mode JAX's own write gives (0o666 less the umask), so a shared folder stays readable.
        temporary = os.path.join(folder, f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
                f.write(value)
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
        return None

    put.atomic = True
    cache_class.put = put
    return True
