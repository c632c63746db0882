"""The CLI's devices and meshes from its flags: CPU device count, `jax.distributed`, `build_meshes`."""

import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from models._config import cudnn_backend

from .._errors import ConfigError
from .._mesh import build_meshes, ensure_cpu_devices
from ._layout import ProcessLayout, devices_needed, overlapped_syncs, process_layout
from .config import check_backend
from .launch import record_failure

if TYPE_CHECKING:
    from .config import Config


def setup_devices(config: "Config") -> None:
    """Set the local device count and, for several processes, join the distributed runtime."""
    layout = process_layout(config)
    ensure_cpu_devices(devices_needed(config))
    join_processes(config, layout)


def join_processes(config: "Config", layout: "ProcessLayout") -> None:
    """Join the JAX world of `layout`'s processes (a run's, or a multi-process decoupled island's own);
    one process joins nothing."""
    if layout.num_processes > 1:
        if layout.coordinator is None:
            raise ConfigError("--dist.coordinator-address (or $JAX_COORDINATOR_ADDRESS) is required with several "
                              "processes")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        quiet_gloo_lines()
        guard_stderr(layout.process_id, layout.num_processes, config.dist.heartbeat_timeout_s)
        join(layout.coordinator, layout.num_processes, layout.process_id,
             heartbeat_timeout_s=config.dist.heartbeat_timeout_s, timeout_s=config.dist.init_timeout_s)
        # Starts JAX's client, and with it gloo's network thread; a blocking sync then waits for no
        # timer tick. An overlapped sync needs that thread beside the compute instead (see _gloo_loop).
        if not overlapped_syncs(config) and jax.default_backend() == "cpu":
            from ._gloo_loop import idle_gloo_loop

            idle_gloo_loop()


# What gloo prints with std::cout each time it connects a communicator (twice per run here); no variable
# turns it off. When all peers are connected it is noise that reads like a warning; a shortfall is kept.
# Two communicators can connect at once, from two threads, and std::cout writes a message in pieces,
# so one message can land inside another: "[Gloo] Rank 0 is connected to 0[Gloo] Rank 0 ... : 0\n
#  peer ranks. ...". Messages are therefore cut out of the stream wherever they are, not line by line,
# and cutting the inner one joins the outer one up again.
_GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                             rb"Expected number of connected peer ranks is : (\d+) *\n?")
_GLOO_TAG = b"[Gloo]"
# How much unfinished gloo text is held back, waiting for the rest of its message, before it is let through.
_GLOO_HOLD_BYTES = 4096


def quiet_gloo_lines() -> None:
    """Drop gloo's "[Gloo] Rank r is connected to n peer ranks" lines from this process's stdout.

    Native code writes to file descriptor 1, so that becomes a pipe read by a thread that passes
    everything else on (`forward_without_gloo_lines`); Python's own output (`sys.stdout`: the
    banner, the progress bar, which needs to see the terminal) goes straight to the original stdout."""
    sys.stdout.flush()
    original = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)
    # Lives as long as the process, as sys.stdout does.
    sys.stdout = open(original, "w", buffering=1, encoding=sys.stdout.encoding,  # noqa: SIM115
                      errors=sys.stdout.errors, closefd=False)
    threading.Thread(target=forward_without_gloo_lines, args=(read_end, original), name="eqx_diloco-stdout",
                     daemon=True).start()


def forward_without_gloo_lines(source: int, target: int) -> None:
    """Copy file descriptor `source` to `target` until it closes, without gloo's all-connected messages.

    If `target` fails (a closed terminal), `source` is still drained, so native writers never block."""
    held = b""
    while chunk := os.read(source, 65536):
        out, held = drop_gloo_noise(held + chunk)
        target = _write_all(target, out)
    _write_all(target, held)


def drop_gloo_noise(text: bytes) -> tuple[bytes, bytes]:
    """Split `text` into what can be passed on now, with gloo's all-connected messages cut out, and
    what is held back: from an unfinished gloo message on (or a tail that may start one)."""
    previous = None
    while previous != text:  # cutting an inner message can complete an outer one
        previous = text
        text = _GLOO_CONNECTED.sub(lambda m: b"" if m[1] == m[2] else m[0], text)
    start = text.find(_GLOO_TAG, text.rfind(b"\n") + 1)  # a gloo message not finished by a newline yet
    if start >= 0 and len(text) - start < _GLOO_HOLD_BYTES:
        return text[:start], text[start:]
    for size in range(min(len(_GLOO_TAG) - 1, len(text)), 0, -1):  # a tail that may become "[Gloo]"
        if _GLOO_TAG.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, b""


def _write_all(target: int | None, data: bytes) -> int | None:
    """Write all of `data` to `target`; None (and nothing written from then on) once that fails."""
    try:
        while data and target is not None:
            data = data[os.write(target, data):]
    except OSError:
        return None
    return target


_GUARDS: list[subprocess.Popen] = []  # kept, so the guard is never collected (and warned about) while it runs


def guard_stderr(process_id: int, num_processes: int, heartbeat_s: int) -> None:
    """Send this process's file descriptor 2 through `_stderr_guard`, a separate process that turns the
    distributed runtime's multi-line reports of a lost peer (after which it aborts this process) into
    one line. The guard leaves when this process's last copy of the pipe closes: when it exits."""
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    guard = Path(__file__).with_name("_stderr_guard.py")
    command = [sys.executable, "-I", "-S", str(guard), str(process_id), str(num_processes), str(heartbeat_s)]
    _GUARDS.append(subprocess.Popen(command, stdin=read_end, stdout=2, stderr=subprocess.DEVNULL, close_fds=True))
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)


# How much later than `join` JAX's own start-up deadline falls: past that deadline JAX's C++ client aborts
# the process (SIGABRT, a C++ stack) instead of raising, so `join` must always give up first.
_JAX_INIT_MARGIN_S = 30


def join(coordinator: str, num_processes: int, process_id: int, *, heartbeat_timeout_s: int, timeout_s: float) -> None:
    """`jax.distributed.initialize`; if the processes have not all joined within `timeout_s`, one line on
    stderr naming the coordinator and the processes waited for, and exit 1.

    JAX cannot be made to raise here (see `_JAX_INIT_MARGIN_S`), but it releases the GIL while it
    waits, so a watchdog thread can speak first. It leaves with os._exit: the runtime's threads are
    still waiting, and a normal exit would wait for them."""
    joined = threading.Event()

    def give_up() -> None:
        if not joined.wait(timeout_s):
            message = join_timeout_message(coordinator, num_processes, process_id, timeout_s)
            print(f"error: {message}", file=sys.stderr, flush=True)
            record_failure(1, message)
            os._exit(1)

    threading.Thread(target=give_up, name="eqx_diloco-join-timeout", daemon=True).start()
    if process_id != 0:
        wait_until_reachable(coordinator, timeout_s)
    try:
        # Detection is off: the layout already holds what a cluster manager says, and JAX's detection would
        # also give each process only the one GPU its local task index names, where a process here may
        # hold whole replicas over several devices (give a task its devices with the scheduler's binding,
        # CUDA_VISIBLE_DEVICES or $JAX_LOCAL_DEVICE_IDS).
        jax.distributed.initialize(coordinator, num_processes, process_id, cluster_detection_method="deactivate",
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   initialization_timeout=int(timeout_s) + _JAX_INIT_MARGIN_S,
                                   coordinator_bind_address=coordinator_bind_address(coordinator))
    finally:
        joined.set()


def coordinator_bind_address(coordinator: str) -> str | None:
    """Where process 0 listens for the others: on the loopback interface when the coordinator's address
    is a loopback one (every process on this host: the launcher's `127.0.0.1:PORT`), else where JAX
    puts it (every interface, `[::]:PORT`, which other hosts need). `$JAX_COORDINATOR_BIND_ADDRESS`,
    when set, wins. The coordination service has no authentication, and on CPU its key-value store
    carries compiled programs: on a shared host nothing else should be able to reach it."""
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return os.environ["JAX_COORDINATOR_BIND_ADDRESS"]
    host, _, port = coordinator.rpartition(":")
    bare = host.strip("[]")
    try:
        loopback = bare == "localhost" or ipaddress.ip_address(bare).is_loopback
    except ValueError:  # a host name: it may name this host for the others too
        loopback = False
    return f"{host}:{port}" if loopback else None


def join_timeout_message(coordinator: str, num_processes: int, process_id: int, timeout_s: float) -> str:
    """Why the run did not form within `timeout_s`: the processes waited for, or an unreachable coordinator."""
    within = f"within {timeout_s:g} s (--dist.init-timeout-s)"
    if process_id == 0:
        others = list(range(1, num_processes))
        missing = f"process {others[0]} did not" if len(others) == 1 else \
            f"not every one of processes {', '.join(map(str, others))} did"
        return (f"process 0 of {num_processes}, the coordinator at {coordinator}: {missing} join {within}; start "
                f"every process with --dist.coordinator-address {coordinator} --dist.num-processes {num_processes}, "
                f"or raise --dist.init-timeout-s")
    if not _reachable(coordinator):
        return (f"process {process_id} of {num_processes}: the coordinator (process 0) at {coordinator} did not "
                f"answer {within}; start process 0 there, or raise --dist.init-timeout-s")
    return (f"process {process_id} of {num_processes}: the coordinator at {coordinator} answers, but not all "
            f"{num_processes} processes joined {within}; every process needs --dist.num-processes {num_processes} "
            f"and its own --dist.process-id")


def _reachable(address: str, timeout_s: float = 2) -> bool:
    """Whether something accepts TCP connections at `host:port` (the coordinator's service)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def wait_until_reachable(address: str, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Wait until the coordinator at `address` accepts connections (at most `timeout_s`; returns whether it did).

    A process that asks JAX to join before the coordinator listens gets a refused connection, and gRPC
    only tries again after its reconnect back-off of a second: processes started together, whose
    coordinator is still importing JAX, all lost that second at every start."""
    deadline = time.monotonic() + timeout_s
    while not _reachable(address, timeout_s=1):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def make_meshes(config: "Config") -> tuple[Mesh, Mesh | None]:
    """The CLI's meshes: `build_meshes` from the config's flags (after the flag rules that need the
    backend: `check_backend`)."""
    check_backend(config, jax.default_backend(), cudnn_backend(jax.devices()[0]))
    d = config.diloco
    comm_device = d.comm_device if overlapped_syncs(config) else "off"
    return build_meshes(d.num_replicas, config.mesh.data, comm_device=comm_device,
                        replicas_per_device=config.mesh.replicas_per_device or None, fsdp=config.mesh.fsdp,
                        tensor=config.mesh.tensor)

