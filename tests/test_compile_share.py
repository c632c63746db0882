"""One compile per multi-process program on CPU (`_compile_share`) and the CPUs start-up compiles on
(`_compile_cpus`). The runs themselves: tests/test_multiprocess.py (their results equal one process's)
and test_a_two_process_run_compiles_each_shared_program_once below."""

import os
import socket
import threading
import types

import jax
import numpy as np
import pytest

from eqx_diloco.lm import _compile_cpus, _compile_share


class FakeStore:
    """The distributed runtime's key-value client, in memory; a missing key times out as JAX's does."""

    def __init__(self, values=None, arrive_after=None):
        self.values = dict(values or {})
        self.arrive_after = arrive_after or {}  # key -> (polls before it appears, value)
        self.polls = 0

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        if key in self.values and not allow_overwrite:
            raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: key {key}")
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        self.polls += 1
        if key in self.arrive_after and self.polls > self.arrive_after[key][0]:
            self.values[key] = self.arrive_after[key][1]
        if key not in self.values:
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.values[key]


def test_processes_agree_only_when_every_one_published_the_same():
    store = FakeStore({f"{_compile_share._IDENTITY_KEY}/1": b"x86_64|cpu|avx2|/cache"})
    assert _compile_share.agree(store, 0, 2, "x86_64|cpu|avx2|/cache", timeout_ms=10)
    assert store.values[f"{_compile_share._IDENTITY_KEY}/0"] == b"x86_64|cpu|avx2|/cache"
    other = FakeStore({f"{_compile_share._IDENTITY_KEY}/1": b"x86_64|cpu|avx512f|/cache"})
    assert not _compile_share.agree(other, 0, 2, "x86_64|cpu|avx2|/cache", timeout_ms=10)
    assert not _compile_share.agree(FakeStore(), 0, 2, "x86_64|cpu|avx2|/cache", timeout_ms=10)  # 1 never came


def test_the_host_identity_names_the_host_and_jaxlib():
    import jaxlib

    identity = _compile_share.host_identity()
    assert identity == _compile_share.host_identity()
    assert identity.startswith(f"{socket.gethostname()}|") and identity.endswith(f"jaxlib {jaxlib.__version__}")


def _fake_compiler(on_disk_after=None):
    """A stand-in for jax._src.compiler: JAX's share function (recording its calls) and a disk cache
    whose entry appears after `on_disk_after` reads (never if None)."""
    calls, reads = [], []

    def share(backend, computation, executable_devices, compile_options, host_callbacks, global_client,
              module_name, cache_key, first_process_id):
        calls.append(cache_key)
        return f"compiled-or-shared {cache_key}"

    share.modules_cache = {}

    def cache_read(module_name, cache_key, compile_options, backend, executable_devices):
        reads.append(cache_key)
        found = on_disk_after is not None and len(reads) > on_disk_after
        return (f"from disk {cache_key}", 1) if found else (None, None)

    def compile_here(backend, computation, executable_devices, compile_options, host_callbacks, module_name,
                     cache_key):
        calls.append(f"here {cache_key}")
        return f"compiled here {cache_key}"

    compiler = types.SimpleNamespace(_compile_and_share_module=share, _cache_read=cache_read,
                                     _compile_and_write_cache=compile_here)
    return compiler, calls, reads


def _call(fn, store, key="jit_step-abc", first_process_id=0):
    return fn("backend", "computation", "devices", "options", [], store, "jit_step", key, first_process_id)


def test_a_waiting_process_loads_the_entry_the_compiling_process_found_on_disk(monkeypatch):
    """The compiling process shares nothing when its read of the persistent cache hit (another run wrote the
    entry between the two processes' reads): the waiting one finds it there instead of waiting 20 minutes."""
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    compiler, calls, reads = _fake_compiler(on_disk_after=2)
    wait = _compile_share._waiting_on_disk_too(compiler)
    store = FakeStore()
    assert _call(wait, store) == "from disk jit_step-abc"
    assert calls == [] and store.polls == 3 and len(reads) == 3
    assert compiler._compile_and_share_module.modules_cache == {"jit_step-abc": "from disk jit_step-abc"}


def test_a_waiting_process_takes_the_shared_executable_and_the_compiling_one_compiles(monkeypatch):
    compiler, calls, reads = _fake_compiler()
    wait = _compile_share._waiting_on_disk_too(compiler)
    assert wait.modules_cache is compiler._compile_and_share_module.modules_cache  # JAX's function finds its cache
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    store = FakeStore(arrive_after={"jit_step-abc": (1, b"executable")})
    assert _call(wait, store) == "compiled-or-shared jit_step-abc"  # JAX's own function loads what was shared
    assert calls == ["jit_step-abc"] and store.polls == 2 and len(reads) == 1
    monkeypatch.setattr(jax, "process_index", lambda: 0)  # the compiling process: says so, then JAX's function
    store = FakeStore()
    assert _call(wait, store, key="jit_eval-def") == "compiled-or-shared jit_eval-def"
    assert calls == ["jit_step-abc", "jit_eval-def"] and len(reads) == 1
    assert f"{_compile_share._STARTED_KEY}/jit_eval-def" in store.values


def test_a_waiting_process_compiles_a_program_the_compiling_process_never_starts(monkeypatch):
    """A program traced differently in two processes has two keys: the other process's never comes."""
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(_compile_share, "_UNSTARTED_S", 0.0)
    compiler, calls, reads = _fake_compiler()
    wait = _compile_share._waiting_on_disk_too(compiler)
    assert _call(wait, FakeStore()) == "compiled here jit_step-abc"
    assert calls == ["here jit_step-abc"] and len(reads) == 1
    assert wait.modules_cache["jit_step-abc"] == "compiled here jit_step-abc"
    # Started but slow: the waiting process keeps waiting for it.
    started = {f"{_compile_share._STARTED_KEY}/jit_eval-def": b""}
    store = FakeStore(started, arrive_after={"jit_eval-def": (5, b"executable")})
    assert _call(wait, store, key="jit_eval-def") == "compiled-or-shared jit_eval-def"
    assert calls == ["here jit_step-abc", "jit_eval-def"]


def test_a_waiting_process_passes_on_errors_other_than_a_timeout(monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    compiler, _, _ = _fake_compiler()

    class Gone(FakeStore):
        def blocking_key_value_get_bytes(self, key, timeout_ms):
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: the coordination service is gone")

    with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
        _call(_compile_share._waiting_on_disk_too(compiler), Gone())


def _key(program, args) -> str:
    """The persistent-cache key of `program` lowered for `args` on this process's first CPU device."""
    from jax._src import cache_key, compiler, xla_bridge

    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    return cache_key.get(jax.jit(program).lower(*args).compiler_ir(), np.array(jax.devices()[:1]), options,
                         xla_bridge.get_backend())


def test_shared_keys_hash_the_agreed_host_in_place_of_the_device_fingerprint(monkeypatch):
    from jax._src import cache_key, compiler, distributed

    jax.devices()  # the backend exists before the fake client below stands in for the distributed runtime's
    # Undone after the test: the functions share_compiles replaces, and the config value it sets.
    monkeypatch.setattr(cache_key, "_hash_accelerator_config", cache_key._hash_accelerator_config)
    monkeypatch.setattr(compiler, "_compile_and_share_module", compiler._compile_and_share_module)
    monkeypatch.setattr(distributed.global_state, "client", FakeStore())
    before = jax.config.jax_share_binary_between_hosts
    try:
        args = (jax.numpy.ones(3),)
        plain = _key(lambda x: x * 3.0 + 1.0, args)
        assert not _compile_share.sharing_compiles()
        assert _compile_share.share_compiles(None) is False  # no cache: nothing shared
        assert _compile_share.share_compiles(jax.config.jax_compilation_cache_dir or "/tmp")
        assert _compile_share.sharing_compiles() and jax.config.jax_share_binary_between_hosts
        shared = _key(lambda x: x * 3.0 + 1.0, args)
        assert shared != plain and shared.split("-")[0] == plain.split("-")[0]
        assert _key(lambda x: x * 3.0 + 1.0, args) == shared  # stable
        # Another host (another CPU, or another cache folder) gets another key.
        monkeypatch.setattr(_compile_share, "host_identity", lambda: "riscv64|other|flags|jaxlib 0")
        assert _compile_share.share_compiles(jax.config.jax_compilation_cache_dir or "/tmp")
        assert _key(lambda x: x * 3.0 + 1.0, args) not in (shared, plain)
        assert hasattr(compiler._compile_and_share_module, "jax_share")  # wrapped once, not twice
        assert not hasattr(compiler._compile_and_share_module.jax_share, "jax_share")
    finally:
        jax.config.update("jax_share_binary_between_hosts", before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.isdir("/proc/self/task"), reason="needs per-thread CPU affinity and two CPUs")
def test_a_pinned_process_compiles_on_every_cpu_and_steps_on_its_share(monkeypatch):
    every = sorted(os.sched_getaffinity(0))
    threads = os.listdir("/proc/self/task")
    try:
        for tid in threads:
            os.sched_setaffinity(int(tid), {every[0]})  # as a launcher's split leaves a process
        monkeypatch.delenv(_compile_cpus.COMPILE_CPUS_ENV, raising=False)
        assert not _compile_cpus.widen_for_compiles()  # no launcher asked: nothing changes
        monkeypatch.setenv(_compile_cpus.COMPILE_CPUS_ENV, ",".join(map(str, every)))
        # Two devices on one CPU: compiled for two CPUs, each step's loops would take turns on one.
        monkeypatch.setattr(jax, "local_device_count", lambda: 2)  # what the default reads
        assert not _compile_cpus.widen_for_compiles()
        assert all(os.sched_getaffinity(int(tid)) == {every[0]} for tid in os.listdir("/proc/self/task"))
        monkeypatch.setattr(jax, "local_device_count", lambda: 1)
        assert _compile_cpus.widen_for_compiles()
        assert all(os.sched_getaffinity(int(tid)) == set(every) for tid in os.listdir("/proc/self/task"))
        release = threading.Event()
        worker = threading.Thread(target=release.wait)  # a thread started while widened (as XLA's compile pool)
        worker.start()
        _compile_cpus.narrow_to_share()
        assert all(os.sched_getaffinity(int(tid)) == {every[0]} for tid in os.listdir("/proc/self/task"))
        release.set()
        worker.join()
        assert _compile_cpus.widen_for_compiles(local_devices=1)  # again after the last step, for the final programs
        assert os.sched_getaffinity(0) == set(every)
        _compile_cpus.narrow_to_share()
        assert os.sched_getaffinity(0) == {every[0]}
        monkeypatch.setenv(_compile_cpus.COMPILE_CPUS_ENV, "not,cpus")
        assert not _compile_cpus.widen_for_compiles(local_devices=1)
    finally:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), set(every))
            except OSError:
                pass
