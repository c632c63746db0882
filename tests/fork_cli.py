"""Run many `python -m MODULE ARGS` command lines from one interpreter that imported the heavy
dependencies once: each command runs in a fork of it, as `python -m` would run it.

A bad-input case costs ~0.3 s of its own but ~3 s of Python start-up and imports (JAX,
Equinox, Orbax); forking a process that already paid them keeps every case a separate process
(its own exit code, stderr, environment and working folder) at a tenth of the cost.

Protocol (JSON, bytes as `{"b64": ...}`, see `encode`/`decode`): a list of `[argv, env, cwd]`
on stdin (argv = module then its arguments; bytes arguments reach the module as `python -m`
would decode them), a list of `[returncode, stdout bytes, stderr bytes]` on stdout, in the
same order.
"""

import atexit
import base64
import json
import os
import runpy
import sys
import tempfile
import traceback

# The entry modules stay unimported here: `runpy` runs them fresh in each child.
import einops  # noqa: F401
import equinox  # noqa: F401
import jax  # noqa: F401
import numpy  # noqa: F401
import optax  # noqa: F401
import orbax.checkpoint  # noqa: F401
import tyro  # noqa: F401

import eqx_diloco  # noqa: F401
import models  # noqa: F401

PARALLEL = 4


def encode(value):
    """`value` as JSON text, every bytes object as {"b64": base64 text}."""
    def default(o):
        if isinstance(o, bytes):
            return {"b64": base64.b64encode(o).decode("ascii")}
        raise TypeError(f"cannot encode {type(o).__name__}")

    return json.dumps(value, default=default)


def decode(text):
    """`encode`'s inverse (tuples come back as lists)."""
    return json.loads(text, object_hook=lambda d: base64.b64decode(d["b64"]) if set(d) == {"b64"} else d)


def _child(argv: list, env: dict, cwd: str, out_path: str, err_path: str) -> None:
    """Become `python -m argv[0] argv[1:]`; never returns."""
    code = 1
    try:
        # Never the parent's exit handlers (its temporary folder's finalizer among them), as
        # multiprocessing's forked children do not: the trainer's exit runs the handlers it finds.
        atexit._clear()
        for fd, path in ((1, out_path), (2, err_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(cwd)
        os.environ.update(env)
        module, *args = [os.fsdecode(a) if isinstance(a, bytes) else a for a in argv]
        sys.argv = [module, *args]
        sys.modules.pop(module, None)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # `sys.exit("message")`: Python prints it and exits 1
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def main() -> None:
    from jax._src import xla_bridge

    cases = decode(sys.stdin.read())
    # Forking is only safe while no XLA backend (and its thread pools) exists in this process.
    assert not xla_bridge._backends, "the backend started before forking"
    results: list = [None] * len(cases)
    running: dict[int, tuple[int, str, str]] = {}
    with tempfile.TemporaryDirectory(prefix="fork_cli_") as tmp:

        def reap() -> None:
            pid, status = os.wait()
            i, out_path, err_path = running.pop(pid)
            with open(out_path, "rb") as f_out, open(err_path, "rb") as f_err:
                results[i] = (os.waitstatus_to_exitcode(status), f_out.read(), f_err.read())

        for i, (argv, env, cwd) in enumerate(cases):
            while len(running) >= PARALLEL:
                reap()
            out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(argv, env, cwd, out_path, err_path)
            running[pid] = (i, out_path, err_path)
        while running:
            reap()
    sys.stdout.write(encode(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
