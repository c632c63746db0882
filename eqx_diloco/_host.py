"""Syncs on the host's CPUs beside an accelerator (`comm_device="host"`).

On a GPU or TPU a sync program dispatched on the compute devices queues behind the inner
steps, so tau > 0 and eager exchanges overlap nothing there. JAX's CPU client exists beside
every accelerator backend (`jax.devices("cpu")`), and a program on CPU devices runs while the
accelerator keeps stepping. So a sync can run on the process's CPU devices: the fragment's
values are copied there (a local copy per shard, as onto communication devices), exchanged
there (a psum over `diloco` on a CPU mesh; gloo across processes) and outer-stepped, and
the result is copied back when it is merged, tau steps (or a round) later.

One difference from communication devices on the compute backend: a copy from an
accelerator onto a CPU device waits, in the calling thread, for the value it copies (measured
on a TPU v5e, JAX 0.10.2: `jax.device_put` of a step's output returned only once the step
had finished, while a copy within one backend returns at once). Made by the host loop, that
copy would stop it dispatching steps until the copy is done and let the accelerator run
dry. `HostHandoff` therefore makes the copy, and dispatches the sync, on a thread of its own.
"""

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import jax

from ._errors import ConfigError


def host_devices(process_index: int, taken: frozenset = frozenset()) -> list:
    """The CPU devices of process `process_index` that syncs with `comm_device="host"` may use, by id.

    The CPU client's devices, less those in `taken` (the compute devices: on a CPU backend
    they are CPU devices too, and the host's are the others). How many a process has is
    `jax_num_cpu_devices` (`eqx_diloco.use_cpu_devices`), one by default. Tests replace this
    function to choose which devices count as the host's.
    """
    return sorted((d for d in jax.devices("cpu") if d.process_index == process_index and d not in taken),
                  key=lambda d: d.id)


def sync_placement(comm_device: str, platform: str) -> str:
    """Where overlapped syncs run for `comm_device` on a `platform` backend: `on` (extra devices of
    the backend), `host` (the process's CPU devices) or `off` (the compute devices).

    `auto` is `on` for a CPU backend (a second CPU device runs beside the first) and `host` for
    a GPU or TPU (a second program on an accelerator queues behind its steps).
    """
    if comm_device == "auto":
        return "on" if platform == "cpu" else "host"
    return comm_device


def too_few_host_devices(need: int, *, process: int, have: int) -> ConfigError:
    """The one-line error for a process with `have` CPU devices free for syncs where `need` are wanted."""
    return ConfigError(
        f"comm_device host needs {need} CPU device{'s' if need > 1 else ''} per process beside the compute devices "
        f"(one per shard of each row of replicas), process {process} has {have}; call "
        f"eqx_diloco.use_cpu_devices(n) before JAX starts (n: the CPU devices in all, the compute devices included on "
        f"a CPU backend), or set comm_device off"
    )


class HostHandoff:
    """A worker thread that copies launched syncs to the host's devices and dispatches them there.

    Jobs run one at a time in the order they were handed over, so every process dispatches
    its collectives on the CPU mesh in the same order. The thread is a daemon: a sync that
    never finishes (a peer lost) does not keep the process alive.
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> Future:
        """Run `job()` on the worker thread after the jobs before it; its result (or error) arrives in the Future."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="eqx_diloco-host-sync", daemon=True)
            self._thread.start()
        future: Future = Future()
        self._jobs.put((job, future))
        return future

    def _work(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as e:  # handed to whoever waits for the result
                future.set_exception(e)


def arrived(outputs: Any) -> Any:
    """A launched sync's outputs: waits for them where a `HostHandoff` is still making them."""
    return outputs.result() if isinstance(outputs, Future) else outputs
