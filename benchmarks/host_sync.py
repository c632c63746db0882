"""What `comm_device="host"` rests on, measured on the backend at hand: does a program on the CPU client
run beside the accelerator's steps, and does a copy off the accelerator hold up the thread that makes it?

Plain JAX (no eqx_diloco), so it runs wherever JAX does. The accelerator's "step" is a chain of
matmuls on one device; the host's "sync" an elementwise loop over a buffer on a CPU device (on a CPU
backend: CPU device 0 against CPU device 1, as communication devices do). Rows:

- `step`: one step alone; `sync`: the sync alone (its values already on the host device);
- `overlap`: `steps` steps dispatched after the sync: when the steps are done and when both are,
  against the two run one after the other;
- `copy`: `jax.device_put` of a step's output still being computed onto the host device: when the call
  returned, and when the copy was ready (a call that returns only after the step blocks its thread);
- `loop`: a training loop of `steps` steps that waits for each step's output one step late (as a
  trainer reading its loss does), launching a sync after step 2 and merging its result tau steps later:
  no sync, the copy and dispatch made by the loop (`inline`), or by a worker thread (`thread`, what
  eqx_diloco does for host syncs). Total time and the longest the loop spent dispatching one step.

`python -m benchmarks.host_sync --out benchmarks/results/host_sync.md` writes the table (printed too).
"""

import argparse
import queue
import sys
import threading
import time

import jax

if jax.config.jax_num_cpu_devices < 2:
    try:  # a second CPU device: the host's, on a CPU backend
        jax.config.update("jax_num_cpu_devices", 2)
    except RuntimeError:  # JAX started already (imported by a test): its devices stay
        pass

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="matmul size of a step")
    parser.add_argument("--matmuls", type=int, default=40, help="matmuls per step")
    parser.add_argument("--sync-mb", type=int, default=32, help="MB a sync copies and works over")
    parser.add_argument("--sync-iters", type=int, default=10, help="elementwise passes of a sync")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--tau", type=int, default=12)
    parser.add_argument("--out", default=None, help="write the table here (markdown)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    accel = jax.devices()[0]
    host = jax.devices("cpu")[1 if accel.platform == "cpu" else 0]

    @jax.jit
    def step(x):
        return jax.lax.fori_loop(0, args.matmuls, lambda i, y: jnp.tanh(y @ y * 1e-3), x)

    n = args.sync_mb * 2**20 // 4
    extract = jax.jit(lambda x: jnp.tile(x.ravel(), n // x.size + 1)[:n] * 1.0)
    sync = jax.jit(lambda v: jax.lax.fori_loop(0, args.sync_iters, lambda i, w: jnp.sin(w) * 0.5 + v * 0.1, v))
    merge = jax.jit(lambda y, r: y + r[0] * 1e-9)
    x = jax.device_put(jnp.full((args.size, args.size), 0.01, jnp.float32), accel)
    on_host = jax.device_put(extract(x), host)

    def timed(f, reps=3):
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            jax.block_until_ready(f())
            times.append(time.perf_counter() - start)
        return float(np.median(times[1:]))

    rows = [("backend", f"{accel.platform} ({accel.device_kind}); host device {host}, JAX {jax.__version__}")]
    step_s, sync_s = timed(lambda: step(x)), timed(lambda: sync(on_host))
    rows += [("step", f"{step_s * 1e3:.1f} ms"), ("sync", f"{sync_s * 1e3:.1f} ms over {args.sync_mb} MB")]
    steps_s = timed(lambda: [step(x) for _ in range(args.steps)][-1])
    start = time.perf_counter()
    pending = sync(on_host)
    jax.block_until_ready([step(x) for _ in range(args.steps)][-1])
    steps_done = time.perf_counter() - start
    jax.block_until_ready(pending)
    both = time.perf_counter() - start
    rows.append(("overlap", f"{args.steps} steps alone {steps_s * 1e3:.0f} ms; with the sync in flight: steps done "
                            f"{steps_done * 1e3:.0f} ms, both {both * 1e3:.0f} ms (one after the other "
                            f"{(steps_s + sync_s) * 1e3:.0f} ms)"))
    for _ in range(2):
        y = extract(step(x))
        start = time.perf_counter()
        copied = jax.device_put(y, host)
        returned = time.perf_counter() - start
        jax.block_until_ready(copied)
        ready = time.perf_counter() - start
    rows.append(("copy", f"device_put of a step's pending output ({args.sync_mb} MB) to the host device returned "
                         f"after {returned * 1e3:.1f} ms, ready after {ready * 1e3:.1f} ms"))
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def worker():
        while True:
            job, box = jobs.get()
            box.append(job())

    threading.Thread(target=worker, daemon=True).start()

    def loop(mode):
        start, gaps, y, previous, launched, back = time.perf_counter(), [], x, None, None, None
        for t in range(1, args.steps + 1):
            before = time.perf_counter()
            y = step(x) if back is None or t != 3 + args.tau else merge(step(x), back)
            if t == 2 and mode != "none":
                values = extract(y)
                if mode == "inline":
                    launched = [sync(jax.device_put(values, host))]
                else:
                    launched = []
                    jobs.put((lambda v=values: sync(jax.device_put(v, host)), launched))
            if t == 2 + args.tau and launched is not None:
                while not launched:
                    time.sleep(1e-4)
                back = jax.device_put(launched[0], accel)
            gaps.append(time.perf_counter() - before)
            if previous is not None:
                previous.block_until_ready()  # the loss of the step before, as a trainer reads it
            previous = y
        y.block_until_ready()
        return time.perf_counter() - start, max(gaps)

    for mode in ("none", "inline", "thread"):
        loop(mode)
        total, gap = loop(mode)
        rows.append((f"loop {mode}", f"{args.steps} steps, tau {args.tau}: {total * 1e3:.0f} ms, longest dispatch "
                                     f"{gap * 1e3:.1f} ms"))
    table = "\n".join(["| what | measured |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# host_sync\n\n`python -m benchmarks.host_sync {' '.join(argv)}`\n\n{table}\n")
    return table


if __name__ == "__main__":
    main()
