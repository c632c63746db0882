"""`python -m eqx_diloco.train`: the command-line trainer.

Examples:

    python -m eqx_diloco.train                                   # DiLoCo, 2 replicas, embedded corpus
    python -m eqx_diloco.train --diloco.num-fragments 4          # Streaming DiLoCo
    python -m eqx_diloco.train --algorithm ddp                   # data-parallel baseline
"""

import contextlib
import logging
import os
import sys
import threading

import tyro

from ._layout import devices_needed, process_layout
from ._preflight import RunDirLock, check_memory, check_writable
from .config import Config, ConfigError, validate

# Nothing above imports JAX: the flags are checked and the setup is printed within a second of
# starting; JAX (seconds to import) comes after.


# Set when a checkpoint save failed: orbax's threads of that save may never finish, so the
# command-line entry point leaves with os._exit (after flushing) instead of waiting for them.
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


def main(argv: list[str] | None = None) -> int:
    global _hard_exit
    config = tyro.cli(Config, args=argv, prog="python -m eqx_diloco.train")
    try:
        # Every check that can fail on the flags alone runs before JAX starts or compiles.
        validate(config)
        _, num_processes, process_id = process_layout(config)
        devices_needed(config)  # the process count must split the replicas
        check_memory(config, num_processes=num_processes)
        check_writable(config)
        # One trainer per run folder; in a multi-process run, process 0 holds the lock for all.
        with RunDirLock(config.run_dir) if process_id == 0 else contextlib.nullcontext():
            if process_id == 0:
                from ._banner import runtime_lines, setup_lines

                print("\n".join(setup_lines(config)), flush=True)
            from ._cache import enable_compilation_cache
            from ._devices import setup_devices

            setup_devices(config)
            enable_compilation_cache(config)  # before the first compile
            if process_id == 0:
                print("\n".join(runtime_lines(config)), flush=True)
            from .trainer import (  # after the device count is set
                REFORM_EXIT_CODE, CheckpointSaveError, NonFiniteError, Reforming, TrainingStopped, train)

            # A failed asynchronous save makes orbax log each of its threads' tracebacks (hundreds of
            # lines); the one line below says what happened.
            logging.getLogger("absl").setLevel(logging.CRITICAL)
            logging.getLogger("asyncio").addFilter(_drop_unretrieved_task_errors)
            sys.unraisablehook = _quiet_closed_event_loops()
            try:
                train(config)
            except NonFiniteError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            except CheckpointSaveError as e:
                # orbax's threads of the failed save may still raise (closed event loops) while we
                # leave; their tracebacks would bury the one line that says what happened.
                threading.excepthook = sys.unraisablehook = lambda args: None
                print(f"error: {e}", file=sys.stderr)
                _hard_exit = True
                return 1
            except Reforming:
                return REFORM_EXIT_CODE  # the elastic launcher starts the next run at once
            except TrainingStopped as e:
                print(e, file=sys.stderr, flush=True)
                return 128 + e.signum
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def entry() -> None:
    """Run `main` and exit with its code (a hard exit after a failed save; see `_hard_exit`)."""
    code = main()
    if _hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
