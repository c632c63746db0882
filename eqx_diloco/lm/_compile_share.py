"""One compile per program in a multi-process CPU run: process 0 compiles, the others load its executable.

Every process of a run traces the same program, so each would compile it: on a machine whose
processes share the cores, that is the run's CPUs spent N times on one program before step 1.
JAX can compile a multi-process program once and hand the executable to the other processes
through the distributed runtime's key-value store (`jax_share_binary_between_hosts`), keyed by
the program's persistent-cache key. On GPU those keys agree across processes; on CPU the key
includes a fingerprint of the devices each process sees, so they never agree and the
other processes would wait for a key nobody writes.

`share_compiles` makes the key agree where the executable can really be shared: every process
publishes its host's name, what XLA:CPU compiles for there (the machine, the CPU model and its
feature flags, jaxlib's version) and its cache folder, and only when all of them match (the
processes of one machine, as the launcher starts them) does the key hash that identity and the
device kinds in place of the per-process fingerprint (the device assignment, the mesh's devices
and their processes, stays in the key through the compile options). A process that waits for an
executable also looks in the persistent cache once a second: the compiling process shares nothing
when it found the program on disk, which happens when another run wrote the entry between the
two processes' reads. On several hosts, each with a cache folder of its own, that entry could be
on one host's disk alone, so there every process compiles as before. And a waiting process compiles
the program itself when the compiling process has not started on it within 30 seconds (it marks
each program it starts): a program traced differently in two processes has two keys, and would
otherwise be waited for until JAX's timeout.

JAX offers no switch for the key, so this replaces two of its private functions (and calls three
more); with a JAX whose functions are not the ones expected it changes nothing and every process
compiles as before.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import platform
import socket
import time
from pathlib import Path

import jax

# The arguments of the JAX functions replaced here (jax._src.cache_key and jax._src.compiler).
_KEY_ARGUMENTS = ["hash_obj", "accelerators"]
_SHARE_ARGUMENTS = ["backend", "computation", "executable_devices", "compile_options", "host_callbacks",
                    "global_client", "module_name", "cache_key", "first_process_id"]
_READ_ARGUMENTS = ["module_name", "cache_key", "compile_options", "backend", "executable_devices"]
_COMPILE_ARGUMENTS = ["backend", "computation", "executable_devices", "compile_options", "host_callbacks",
                      "module_name", "cache_key"]
_IDENTITY_KEY = "eqx_diloco/compile_share/identity"
_STARTED_KEY = "eqx_diloco/compile_share/started"  # set by the compiling process as it starts on a program
_POLL_MS = 1000  # how long a waiting process blocks on the store before it looks on disk
# How long a waiting process gives the compiling process to start on a program before compiling it itself
# (the processes reach a program at different moments; a program no other process compiles would
# otherwise be waited for until JAX's timeout, 20 minutes).
_UNSTARTED_S = 30.0


def _get(client, key: str, timeout_ms: int) -> bytes | None:
    """The value of `key` in the key-value store, or None if it is not there within `timeout_ms` (other
    errors are raised)."""
    try:
        return client.blocking_key_value_get_bytes(key, timeout_ms)
    except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):
            raise
        return None


def host_identity() -> str:
    """This host's name and what XLA:CPU compiles for on it: machine, CPU model and feature flags, jaxlib's version."""
    import jaxlib

    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "Processor", "cpu model") and not model:
                model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        model = platform.processor()
    return f"{socket.gethostname()}|{platform.machine()}|{model}|{flags}|jaxlib {jaxlib.__version__}"


def _private_functions():
    """(cache_key module, compiler module) when this JAX's functions are the ones replaced here, else None."""
    try:
        from jax._src import cache_key, compiler
    except ImportError:
        return None
    expected = [(cache_key, "_hash_accelerator_config", _KEY_ARGUMENTS), (cache_key, "_hash_devices", None),
                (compiler, "_compile_and_share_module", _SHARE_ARGUMENTS), (compiler, "_cache_read", _READ_ARGUMENTS),
                (compiler, "_compile_and_write_cache", _COMPILE_ARGUMENTS)]
    for module, name, arguments in expected:
        fn = getattr(module, name, None)
        if fn is None or (arguments is not None and list(inspect.signature(fn).parameters) != arguments):
            return None
    if not hasattr(compiler._compile_and_share_module, "modules_cache") or not hasattr(
            jax.config, "jax_share_binary_between_hosts"):
        return None
    return cache_key, compiler


def agree(client, process_id: int, num_processes: int, mine: str, timeout_ms: int) -> bool:
    """Publish `mine` for process `process_id` and whether every process published the same within
    `timeout_ms` (a process that has not published by then counts as different)."""
    client.key_value_set_bytes(f"{_IDENTITY_KEY}/{process_id}", mine.encode(), allow_overwrite=True)
    return all(_get(client, f"{_IDENTITY_KEY}/{p}", timeout_ms) == mine.encode() for p in range(num_processes))


def share_compiles(cache_folder: Path | None, *, timeout_ms: int = 120_000) -> bool:
    """In a multi-process CPU run, let the lowest process of each program compile it for all (see the
    module's docstring). Every process must call it (it exchanges one value with the others); returns
    whether sharing is on. Off when the cache is off (`cache_folder` None) or hosts or folders differ."""
    from .._replica_values import _kv_client

    client = _kv_client()
    functions = _private_functions()
    usable = cache_folder is not None and functions is not None
    mine = f"{host_identity()}|{Path(cache_folder).resolve()}" if usable else f"off {os.getpid()}"  # never agrees
    if client is None or not agree(client, jax.process_index(), jax.process_count(), mine, timeout_ms) or not usable:
        return False
    cache_key, compiler = functions
    identity = hashlib.sha256(mine.encode()).digest()
    fingerprint = getattr(cache_key._hash_accelerator_config, "jax_fingerprint", cache_key._hash_accelerator_config)

    def hash_accelerators(hash_obj, accelerators):
        if any(d.platform != "cpu" for d in accelerators.flat):
            return fingerprint(hash_obj, accelerators)
        hash_obj.update(identity)
        cache_key._hash_devices(hash_obj, accelerators)

    hash_accelerators.jax_fingerprint = fingerprint
    cache_key._hash_accelerator_config = hash_accelerators
    if not hasattr(compiler._compile_and_share_module, "jax_share"):  # once per process
        compiler._compile_and_share_module = _waiting_on_disk_too(compiler)
    jax.config.update("jax_share_binary_between_hosts", True)
    return True


def sharing_compiles() -> bool:
    """Whether `share_compiles` is in force in this process."""
    functions = _private_functions()
    return (functions is not None and bool(jax.config.jax_share_binary_between_hosts)
            and hasattr(functions[0]._hash_accelerator_config, "jax_fingerprint"))


def _waiting_on_disk_too(compiler):
    """JAX's `_compile_and_share_module`, whose waiting processes also look in the persistent cache."""
    share = compiler._compile_and_share_module

    def compile_or_wait(backend, computation, executable_devices, compile_options, host_callbacks, global_client,
                        module_name, cache_key, first_process_id):
        args = (backend, computation, executable_devices, compile_options, host_callbacks, global_client, module_name,
                cache_key, first_process_id)
        if cache_key in share.modules_cache:
            return share(*args)
        if jax.process_index() == first_process_id:
            global_client.key_value_set_bytes(f"{_STARTED_KEY}/{cache_key}", b"", allow_overwrite=True)
            return share(*args)
        start = time.monotonic()
        while time.monotonic() < start + jax.config.jax_share_binary_between_hosts_timeout_ms / 1000:
            if _get(global_client, cache_key, _POLL_MS) is not None:
                return share(*args)  # shared: JAX's own function reads it again at once and loads it
            executable, _ = compiler._cache_read(module_name, cache_key, compile_options, backend, executable_devices)
            if executable is not None:  # the compiling process found it on disk and shares nothing
                share.modules_cache[cache_key] = executable
                return executable
            if time.monotonic() > start + _UNSTARTED_S and _get(global_client, f"{_STARTED_KEY}/{cache_key}", 1) is None:
                break  # the compiling process never got to this key: a program it traced otherwise
        executable = compiler._compile_and_write_cache(backend, computation, executable_devices, compile_options,
                                                       host_callbacks, module_name, cache_key)
        share.modules_cache[cache_key] = executable
        return executable

    compile_or_wait.modules_cache = share.modules_cache  # JAX's function reaches its cache through its module name
    compile_or_wait.jax_share = share
    return compile_or_wait
