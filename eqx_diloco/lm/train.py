"""`python -m eqx_diloco.train`: the command-line trainer.

Examples:

    python -m eqx_diloco.train                                   # DiLoCo, 2 replicas, embedded corpus
    python -m eqx_diloco.train --diloco.num-fragments 4          # Streaming DiLoCo
    python -m eqx_diloco.train --algorithm ddp                   # data-parallel baseline
"""

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import traceback

import tyro

from ._layout import check_dist, devices_needed, process_layout
from ._phases import PHASES, mark
from ._preflight import RunDirLock, check_memory, check_run_dir_free, check_writable
from ._processes import record_failure
from .config import Config, ConfigError, validate

# Nothing above imports JAX: the flags are checked and the setup is printed within a second of
# starting; JAX (seconds to import) comes after.


# Whether this process leaves with os._exit (after flushing) rather than a normal interpreter exit:
# - after a failed checkpoint save: orbax's threads of that save may never finish;
# - in a multi-process run, after a failure this process may be alone with (a disk error, Ctrl-C,
#   a bug): at a normal exit, JAX's atexit hook waits in `jax.distributed.shutdown` for every other
#   process, while they wait for this one in the per-step exchange or a collective, for minutes,
#   until a timeout. Leaving at once lets the launcher see who failed and stop the rest.
_hard_exit = False


def _quiet_closed_event_loops(unraisablehook=sys.unraisablehook):
    """A sys.unraisablehook that drops one kind of noise. TensorStore reports an exception raised
    in its completion callbacks with PyErr_WriteUnraisable. After a failed save, orbax closes its
    event loop while TensorStore writes are still finishing, and each of their callbacks then
    reports "RuntimeError: Event loop is closed" (dozens of tracebacks, racing the one line that
    says what happened). Only that error is dropped; everything else reaches the usual hook."""

    def hook(args):
        value = args.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            unraisablehook(args)

    return hook


def _drop_unretrieved_task_errors(record: logging.LogRecord) -> bool:
    """A filter for the "asyncio" logger. When a save fails, the write tasks orbax started on
    its event loop fail with it, and asyncio logs each one that nobody awaited ("Task exception
    was never retrieved", with a traceback) when it is garbage-collected, at a moment that
    depends on load. The failure itself reaches the trainer through orbax (the one line
    `error: saving checkpoint ...`); only those after-the-fact reports are dropped."""
    return "exception was never retrieved" not in record.getMessage()


class _Process:
    """Where this process stands, for the way it leaves."""

    num_processes = 1
    process_id = 0
    joined = False  # in jax.distributed with other processes: a local failure must not wait for them


def main(argv: list[str] | None = None) -> int:
    PHASES.clear()
    mark("python and the flag parser imported")
    config = tyro.cli(Config, args=argv, prog="python -m eqx_diloco.train")
    process = _Process()
    try:
        return _main(config, process)
    except ConfigError as e:
        return _fail(process, 2, str(e))
    except KeyboardInterrupt:
        return _fail(process, 130, "interrupted")
    except OSError as e:  # a full or read-only disk, a file removed under the run: what failed, in one line
        return _fail(process, 1, _os_error(e))
    except Exception as e:
        if not process.joined:
            record_failure(1, _one_line(e))
            raise  # one process: Python's own traceback (this is a bug), exit 1
        if not isinstance(e, _jax_runtime_error()):
            traceback.print_exc()  # a bug: its traceback, then the line that says which process failed
        # A JaxRuntimeError here is the runtime losing another process (gloo's "Connection closed by peer",
        # a timed-out exchange): one line, as this process is not the one that failed first.
        return _fail(process, 1, f"process {process.process_id} of {process.num_processes} failed: {_one_line(e)}")


def _main(config: Config, process: _Process) -> int:
    # Every check that can fail on the flags alone runs before JAX starts or compiles.
    validate(config)
    if config.decoupled.role != "off":
        return _decoupled(config, process)
    check_dist(config)
    layout = process_layout(config)
    process.num_processes, process.process_id = layout.num_processes, layout.process_id
    devices_needed(config)  # the process count must split the replicas
    check_memory(config, num_processes=process.num_processes)
    check_writable(config, checkpoints=False)
    # One run per run folder; in a multi-process run, process 0 holds the lock for all of its processes.
    if process.process_id != 0:
        check_run_dir_free(config.run_dir, job=layout.job)
    with RunDirLock(config.run_dir, job=layout.job) if process.process_id == 0 else contextlib.nullcontext():
        check_writable(config, run_dir=False)
        if process.process_id == 0:
            from ._banner import runtime_lines, setup_lines

            print("\n".join(setup_lines(config)), flush=True)
        mark("flags checked, set-up printed")
        from ._cache import enable_compilation_cache
        from ._compile_cpus import widen_for_compiles
        from ._devices import setup_devices

        setup_devices(config)
        process.joined = process.num_processes > 1
        enable_compilation_cache(config)  # before the first compile
        widen_for_compiles()  # a pinned process compiles on every CPU of its launcher until its first step
        mark("JAX imported, processes joined, devices set up")
        if process.process_id == 0:
            print("\n".join(runtime_lines(config)), flush=True)
        from .metrics import LogWriteError
        from .trainer import (  # after the device count is set
            REFORM_EXIT_CODE, CheckpointSaveError, NonFiniteError, Reforming, Trainer, TrainingStopped)

        # A failed asynchronous save makes orbax log each of its threads' tracebacks (hundreds of
        # lines); the one line below says what happened.
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        logging.getLogger("asyncio").addFilter(_drop_unretrieved_task_errors)
        sys.unraisablehook = _quiet_closed_event_loops()
        trainer = None
        mark("trainer imported (equinox, optax)")
        try:
            trainer = Trainer(config)
            mark("data loaded, mesh and programs planned")
            trainer.run()
            mark("checkpoint written, logs closed")
            PHASES.write(config.run_dir, process.process_id)
        except NonFiniteError as e:
            # Every process reads the same exchanged values and stops at the same step: they all leave
            # together, through JAX's shutdown as usual.
            return _fail(process, 1, str(e), local=False)
        except CheckpointSaveError as e:
            # orbax's threads of the failed save may still raise (closed event loops) while we
            # leave; their tracebacks would bury the one line that says what happened.
            threading.excepthook = sys.unraisablehook = lambda args: None
            first = f"{trainer.log_error}; then " if trainer is not None and trainer.log_error else ""
            return _fail(process, 1, f"{first}{e}", hard=True)
        except LogWriteError as e:  # the TensorBoard event file could not even be created
            return _fail(process, 1, str(e))
        except Reforming:
            return REFORM_EXIT_CODE  # the elastic launcher starts the next run at once
        except TrainingStopped as e:
            if trainer.log_error is None:
                print(e, file=sys.stderr, flush=True)
                return 128 + e.signum
            # A failed metrics or TensorBoard write stopped the run (every process at one step, as for SIGTERM).
            return _fail(process, 1, f"{trainer.log_error}; {_stopped_at(trainer, e.step)}", local=False)
        if trainer.log_error is not None:  # it failed at the last step: the run finished all the same
            return _fail(process, 1, f"{trainer.log_error}; the run finished ({_saved(trainer)})", local=False)
    return 0


def _decoupled(config: Config, process: _Process) -> int:
    """A syncer or one island of a decoupled run: a program of its own that shares no `jax.distributed`
    world with the others (an island of several processes has one of its own), and no run-folder lock
    (the syncer and the islands share the run folder, each in its own files)."""
    check_writable(config, checkpoints=False)
    from .._mesh import ensure_cpu_devices
    from ._cache import enable_compilation_cache

    if config.decoupled.role == "island":  # before JAX starts: an island's own devices (simulated on CPU)
        from ._devices import join_processes

        # Only the island's own processes (flags or JAX_* variables): a cluster job's other tasks are other islands.
        config = dataclasses.replace(config, dist=dataclasses.replace(config.dist, cluster="none"))
        check_dist(config)
        layout = process_layout(config)
        process.num_processes, process.process_id = layout.num_processes, layout.process_id
        ensure_cpu_devices(config.mesh.data * config.mesh.fsdp * config.mesh.tensor // layout.num_processes)
        join_processes(config, layout)  # an island of several processes: a JAX world of its own
        process.joined = layout.num_processes > 1
    enable_compilation_cache(config)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    if config.decoupled.role == "syncer":
        from .._checkpoint import CheckpointSaveError
        from .syncer import run_syncer

        # A failed save: one line, not orbax's and asyncio's reports of each of its threads (as the trainer).
        logging.getLogger("asyncio").addFilter(_drop_unretrieved_task_errors)
        sys.unraisablehook = _quiet_closed_event_loops()
        try:
            return run_syncer(config)
        except CheckpointSaveError as e:
            threading.excepthook = sys.unraisablehook = lambda args: None
            return _fail(process, 1, f"syncer: {e}", hard=True)
    from .island import IslandError, run_island

    try:
        return run_island(config)
    except IslandError as e:
        return _fail(process, 1, str(e))


def _stopped_at(trainer, step: int) -> str:
    """What a stop after a failed metrics write left behind, and how to go on."""
    if trainer.checkpointer.every <= 0:
        return f"stopped at step {step}; {_saved(trainer)}"
    return (f"stopped at step {step} ({_saved(trainer)}); run the same command to resume once the file "
            f"can be written")


def _saved(trainer) -> str:
    if trainer.checkpointer.every <= 0:
        return "checkpointing is off (--checkpoint.every 0): nothing saved"
    return f"checkpoint saved in {trainer.checkpointer.directory}"


def _fail(process: _Process, code: int, message: str, *, local: bool = True, hard: bool = False) -> int:
    """Say why this process fails (one line on stderr, and the launcher's failure marker) and return
    its exit code. `local`: a failure the other processes of a multi-process run may not share, so
    this process must not wait for them on its way out (see `_hard_exit`)."""
    global _hard_exit
    print(message if code == 130 else f"error: {message}", file=sys.stderr, flush=True)
    record_failure(code, message)
    _hard_exit = _hard_exit or hard or (local and process.joined)
    return code


def _one_line(e: BaseException) -> str:
    """`Type: first line of the message` (JAX runtime errors run over many lines)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _os_error(e: OSError) -> str:
    """An OSError as `<what went wrong>: <file>` (its strerror and file name), else its text."""
    if e.strerror and e.filename is not None:
        return f"{e.strerror}: {e.filename}" + (f" -> {e.filename2}" if e.filename2 is not None else "")
    return _one_line(e)


def _jax_runtime_error() -> type[BaseException] | tuple[()]:
    """JAX's runtime error class, or () (which no exception is an instance of) if JAX never started."""
    errors = sys.modules.get("jax.errors")
    return getattr(errors, "JaxRuntimeError", ()) if errors is not None else ()


# How long a leaving process waits for its other non-daemon threads (after idle thread-pool workers
# were told to stop). By then the trainer has waited for its saves, so what is left is idle or stuck.
THREADS_EXIT_TIMEOUT_S = 60.0


def _join_threads(code: int, timeout_s: float = THREADS_EXIT_TIMEOUT_S) -> None:
    """Join the other non-daemon threads as the interpreter does at exit, within `timeout_s`.

    CPython's own exit first calls the hooks registered with `threading._register_atexit`
    (`concurrent.futures` stops its idle pool workers there: orbax's metadata store keeps one), and
    only then joins the threads; joining them without those hooks waits for ever on an idle
    worker. A thread still running after `timeout_s` is named in one line and the process leaves
    with `code` (1 if it was 0) instead of hanging."""
    shutdown = getattr(threading, "_shutdown", None)  # CPython's call at exit: pool hooks, then the joins
    if shutdown is None:
        return
    done = threading.Event()

    def give_up():
        if done.wait(timeout_s):
            return
        names = ", ".join(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        print(f"error: leaving after {timeout_s:.0f} s without waiting for thread(s) still running: {names}",
              file=sys.stderr, flush=True)
        os._exit(code or 1)

    threading.Thread(target=give_up, name="eqx_diloco-exit-timeout", daemon=True).start()
    shutdown()
    done.set()


def entry() -> None:
    """Run `main` and leave with its code through os._exit, without the interpreter's teardown.

    A normal end first does everything else an exit is for, in the interpreter's order: other
    non-daemon threads are joined (see `_join_threads`: idle pool workers are stopped first, and
    the wait is bounded) and the `atexit` handlers run (logging's flush, JAX's
    `jax.distributed.shutdown` barrier and cache clean-up, finalizers such as temporary folders);
    the trainer has closed its own files. What is skipped is the destruction of every module and
    object, JAX's runtime included: about 0.3 s at the end of every run, for a process that is
    ending anyway. Where `_hard_exit` says so, nothing is waited for."""
    code = main()
    if not _hard_exit:
        run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's own call at exit
        if run_exit_handlers is None:
            sys.exit(code)
        _join_threads(code)
        run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
