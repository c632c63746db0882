"""What one float32 psum costs between two processes of this machine, with nothing else running.

A blocking DiLoCo sync of two processes is at least one such psum (through gloo, JAX's CPU
collectives). Two processes join a `jax.distributed` run on 127.0.0.1, each holding one CPU
device, and time `calls` psums of `floats` float32 values over the two (after one untimed
call), in three settings: each process pinned to one core of its own (as `eqx_diloco.launch`
places its processes by default) with gloo's network thread at idle priority (as the trainer
sets it: `eqx_diloco.lm._gloo_loop`); pinned likewise with that thread left at normal priority;
and unpinned (thread at idle priority). Reported per setting: median, 90th percentile and
largest time per psum, in milliseconds, from process 0's clock.

    python -m benchmarks.psum_floor   # writes benchmarks/results/psum_floor.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import _common as common
from eqx_diloco.lm._gloo_loop import idle_gloo_loop
from eqx_diloco.lm._processes import free_port

FLOATS = 131_393  # the sync payload of the 2 x 64 model `benchmarks/vs_torchft.py` trains
SETTINGS = ("pinned", "pinned-loop-normal", "unpinned")
SETTING_NAMES = {"pinned": "each pinned to a core of its own",
                 "pinned-loop-normal": "each pinned to a core of its own, gloo's thread at normal priority",
                 "unpinned": "unpinned"}


def worker(process_id: int, port: int, pin: bool, idle_loop: bool, floats: int, calls: int) -> None:
    """One of the two processes: time `calls` psums and print them, with how many gloo threads it put at
    idle priority, as one JSON line (process 0)."""
    if pin and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[process_id % len(cpus)]})
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    jax.devices()  # JAX's client, and with it gloo's network thread
    idled = idle_gloo_loop() if idle_loop else 0
    mesh = Mesh(np.array(jax.devices()), ("diloco",))
    values = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("diloco")),
                                                    np.ones((1, floats), np.float32))
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "diloco"), mesh=mesh, in_specs=PartitionSpec("diloco"),
                                 out_specs=PartitionSpec("diloco")))
    jax.block_until_ready(psum(values))  # compiled, and gloo's pairs connected
    took = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(psum(values))
        took.append(time.perf_counter() - start)
    if process_id == 0:
        print(json.dumps({"seconds": took, "idled_threads": idled}), flush=True)
    jax.distributed.shutdown()


def measure(setting: str, floats: int, calls: int) -> dict:
    """Run the two processes for one setting; process 0's times summarised (milliseconds)."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.psum_floor", "--port", str(port), "--floats", str(floats),
           "--calls", str(calls)] + (["--pin"] if setting.startswith("pinned") else []) + \
        (["--loop-normal"] if setting == "pinned-loop-normal" else [])
    procs = [subprocess.Popen(cmd + ["--worker", str(i)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              cwd=common.REPO) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"error: a psum_floor worker failed ({setting}; exit codes {[p.returncode for p in procs]})")
    report = json.loads(next(line for line in outs[0].splitlines() if line.startswith("{")))
    ms = 1000 * np.array(report["seconds"])
    return {"setting": setting, "calls": calls, "idled_threads": report["idled_threads"], "median_ms": float(np.median(ms)),
            "p90_ms": float(np.percentile(ms, 90)), "max_ms": float(ms.max())}


def render(result: dict) -> str:
    table = common.markdown_table(result["rows"], [
        ("processes", "setting", SETTING_NAMES.get), ("psums timed", "calls", None),
        ("gloo threads put at idle priority", "idled_threads", None), ("median ms", "median_ms", lambda v: f"{v:.2f}"),
        ("90th percentile ms", "p90_ms", lambda v: f"{v:.2f}"), ("largest ms", "max_ms", lambda v: f"{v:.2f}")])
    return (f"# One float32 psum of {result['floats']:,} values between two processes (gloo, 127.0.0.1)\n\n"
            f"Command: `python -m benchmarks.psum_floor`; revision {result['revision']}; "
            f"{result['machine'].get('cpu_count', '?')} CPUs. Nothing else ran.\n\n{table}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floats", type=int, default=FLOATS, help="float32 values per psum")
    parser.add_argument("--calls", type=int, default=200, help="psums timed per setting")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS_DIR)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loop-normal", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.floats < 1 or args.calls < 1:
        parser.error(f"--floats and --calls must be >= 1 (got {args.floats} and {args.calls})")
    if args.worker is not None:
        worker(args.worker, args.port, args.pin, not args.loop_normal, args.floats, args.calls)
        return 0
    rows = []
    for setting in SETTINGS:
        print(f"timing {args.calls} psums, {setting}...", flush=True)
        rows.append(measure(setting, args.floats, args.calls))
    result = {"revision": common.revision(), "machine": common.machine_info(), "floats": args.floats, "rows": rows}
    common.write_json(args.out_dir / "psum_floor.json", result)
    common.write_text(args.out_dir / "psum_floor.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
