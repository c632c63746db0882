"""Checks that run before any training step, so a run that cannot finish fails at once.

- `check_writable`: the run folder and the checkpoint folder can be created and written.
- `check_memory`: the biggest arrays a step or an evaluation makes fit in this machine's RAM.
- `RunDirLock`, `check_run_dir_free`: one run per run folder at a time (a run may be several processes).

Each failure is a `ConfigError` with one line naming the flag.
"""

import errno
import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path

from .config import Config, ConfigError


def _check_folder(path: Path, flag: str) -> None:
    """Create `path` (and its parents) if missing and prove a file can be written there."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} is not a folder: {path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".write_check_"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} is not writable: {path}: {e.strerror or e}") from None


def checkpoint_folder(config: Config) -> Path:
    """Where the run's checkpoints go (`--checkpoint.dir`, else `<run-dir>/checkpoints`)."""
    return config.checkpoint.dir or config.run_dir / "checkpoints"


def check_writable(config: Config, *, run_dir: bool = True, checkpoints: bool = True) -> None:
    """Raise `ConfigError` unless the run folder and the checkpoint folder (each unless its keyword
    is False) are writable folders.

    Creates them if missing (the trainer would create them anyway). The trainer checks the run folder
    before it takes the folder's lock, and the checkpoint folder once it holds it, so a run refused by
    the lock adds nothing to another run's folder.
    """
    if run_dir:
        _check_folder(Path(config.run_dir), "--run-dir")
    if checkpoints:
        _check_folder(Path(checkpoint_folder(config)), "--checkpoint.dir" if config.checkpoint.dir else "--run-dir")


def available_memory_bytes() -> int:
    """RAM this process can still get: MemAvailable from /proc/meminfo, else free physical pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_estimates(config: Config, num_processes: int = 1) -> dict[str, int]:
    """Rough bytes of the biggest arrays one process holds at once, by the flag that sets them.

    - `--train.batch-size`: a training step over this process's replicas keeps the logits (in the
      compute dtype), their float32 log-softmax and its gradient (vocab x (itemsize + 8) bytes per
      token), plus what the backward pass saves of each layer: all its activations (about
      6 x dim + 2 x hidden values per token, 3 x hidden for SwiGLU) with `--model.remat none`, its
      matmul outputs (5 x dim + hidden, 2 x hidden for SwiGLU) with `dots`, and only its input (dim)
      with `block`, where one layer's activations are rebuilt at a time.
    - `--train.eval-sequences`: an evaluation of the global model makes the logits of every
      held-out sequence at once, and their softmax.

    The compute dtype is `--model.dtype` (`auto` counts as float32: this is host memory, which a
    CPU run computes in). Meant as a lower bound: parameters, optimizer state, attention scores and
    XLA's temporaries are left out, so a refusal means the run could not fit, not that it might not.
    """
    m, t = config.model, config.train
    itemsize = 2 if m.dtype == "bfloat16" else 4
    local_replicas = max(1, config.diloco.num_replicas // max(1, num_processes))
    tokens = local_replicas * t.batch_size * t.seq_len
    hidden = m.ffn_hidden if m.kind == "dense" else m.mlp_ratio * m.dim
    gated = m.kind == "dense" and m.mlp == "swiglu"  # gate and up outputs, and their product
    every_activation = 6 * m.dim + (3 if gated else 2) * hidden
    saved_per_layer = {"none": every_activation, "dots": 5 * m.dim + (2 if gated else 1) * hidden,
                       "block": m.dim}[m.remat]
    rebuilt = every_activation if m.remat == "block" else 0
    per_token = m.vocab_size * (itemsize + 8) + (m.num_layers * saved_per_layer + rebuilt) * itemsize
    eval_tokens = t.eval_sequences * t.seq_len
    return {
        "--train.batch-size": tokens * per_token,
        "--train.eval-sequences": 4 * eval_tokens * 2 * m.vocab_size,
    }


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(config: Config, *, num_processes: int = 1, available: int | None = None) -> None:
    """Raise `ConfigError` naming the flag whose arrays (see `memory_estimates`) exceed `available` RAM."""
    available = available_memory_bytes() if available is None else available
    for flag, need in memory_estimates(config, num_processes).items():
        if need > available:
            raise ConfigError(
                f"{flag} is too large for this machine: its arrays need about {_gib(need)}, "
                f"{_gib(available)} of memory is available (lower {flag} or --train.seq-len)"
            )


# How long process 0 retries the lock: another process of its own job may hold it for a moment,
# shared, to see who holds it (`check_run_dir_free`).
_LOCK_RETRY_S = 2.0


# What flock's non-blocking attempt fails with while another descriptor holds a conflicting lock.
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _open_lock_file(run_dir: Path) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    return os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)


def _cannot_lock(run_dir: Path, e: OSError) -> ConfigError:
    return ConfigError(f"--run-dir {run_dir}: cannot lock {run_dir / '.lock'}: {e.strerror}")


def _holder(fd: int) -> tuple[str, str]:
    """(pid and host, job) recorded in a lock file by its holder; ("", "") if not written yet."""
    fields = os.pread(fd, 512, 0).decode(errors="replace").split("\n")
    return (fields[0].strip(), fields[1].strip()) if len(fields) >= 3 else ("", "")  # both lines written


def _in_use(run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(f"--run-dir {run_dir} is in use by another trainer" + (f" ({holder})" if holder else ""))


class RunDirLock:
    """An exclusive lock on `<run_dir>/.lock` for the life of a run (a context manager).

    A second run on the same folder gets a `ConfigError` at once instead of interleaving its
    metrics and checkpoints with the first one's. The lock is `flock`-based, so the kernel drops
    it when the holder exits, however it exits (no stale lock after a kill). The file records the
    holder's pid, host and `job`, so the other processes of a multi-process run can tell their
    own run's lock from another run's (`check_run_dir_free`).

    **Arguments:**

    - `run_dir`: the run folder.
    - `job`: what identifies this run among runs that may share the folder (`ProcessLayout.job`).
    """

    def __init__(self, run_dir: Path | str, *, job: str = ""):
        self.run_dir = Path(run_dir)
        self.job = job
        self._fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        fd = _open_lock_file(self.run_dir)
        deadline = time.monotonic() + _LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in _HELD and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                holder, _ = _holder(fd)
                os.close(fd)
                raise (_in_use(self.run_dir, holder) if e.errno in _HELD else _cannot_lock(self.run_dir, e)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n{self.job}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def check_run_dir_free(run_dir: Path | str, *, job: str) -> None:
    """For a process other than 0: raise `ConfigError` if another run (not `job`) holds the lock on
    `run_dir`, so every process of a second run on the folder leaves at once, not only its process 0.

    Takes the lock shared for a moment (which fails while a holder has it), never keeps it: process 0
    of this run takes it for the run, and retries past such a moment (`_LOCK_RETRY_S`)."""
    run_dir = Path(run_dir)
    fd = _open_lock_file(run_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return  # nobody holds it now: this run's process 0 will take it, or finds another run's first
        except OSError as e:
            if e.errno not in _HELD:
                raise _cannot_lock(run_dir, e) from None
        deadline = time.monotonic() + _LOCK_RETRY_S
        holder, holder_job = _holder(fd)
        while not holder_job and time.monotonic() < deadline:  # taken a moment ago, not written yet
            time.sleep(0.05)
            holder, holder_job = _holder(fd)
        if holder_job != job:
            raise _in_use(run_dir, holder)
    finally:
        os.close(fd)  # releases a shared lock taken above
