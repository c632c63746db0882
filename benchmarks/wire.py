"""Wire bytes, time and memory of one outer-gradient exchange: float32 psum vs quantized
one-shot gather vs quantized two-phase (reduce-scatter + all-gather), at R = 2, 4, 8.

Each cell runs `eqx_diloco._exchange.exchange_sum` inside `jax.shard_map` over an (R, 1)
("diloco", "data") mesh of simulated CPU devices, on a flat float32 vector of
`--values` values per replica (random normal, a different vector per replica), every
replica weighted, returning both the sum and the replica's error-feedback residual (the
sync with error feedback on). Reported per cell:

- `wire_bytes`: bytes one replica sends per sync (`_exchange.wire_nbytes`: psum as a
  ring all-reduce, 2 (R - 1) / R x 4n; gather (R - 1) x payload; two-phase
  2 (R - 1) x chunk payload), and the ratio to the float32 psum at the same R;
- `time_s`: median wall time of `--repeats` calls after one warm-up call (the compiled
  program, blocked until ready). On simulated CPU devices the collectives are memory
  copies inside one process, so this is mostly the encode/decode/sum compute of all R
  replicas sharing this machine's cores, not network time;
- `temp_bytes`: the compiled program's temporary buffers per device
  (`compiled.memory_analysis().temp_size_in_bytes`), i.e. the sync program's working
  memory beyond its inputs and outputs;
- `rel_error`: ||total - exact sum|| / ||exact sum|| (float64 exact sum), one round,
  no error feedback carried.

The simulated device count is pinned to `NUM_CPU_DEVICES` (recorded in the JSON) before
JAX starts. `--quick` is a microscopic setting for the tests (numbers meaningless).
Output: `<out>/wire.json` and `<out>/wire.md`; the default `--out` is
runs/wire_<mode>; benchmarks/results is written only when `--out benchmarks/results` is
given. Run `python -m benchmarks.wire --help`.
"""

from __future__ import annotations

NUM_CPU_DEVICES = 8  # simulated CPU devices in every mode (R <= 8)

if __name__ == "__main__":  # before anything starts a JAX backend
    import jax

    jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)

import argparse  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

if __package__ in (None, ""):  # `python benchmarks/wire.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks import _common as common  # noqa: E402
from eqx_diloco._exchange import exchange_sum, wire_nbytes  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
NAME = "wire"
MODES = {
    # values per replica, timed repeats, replica counts, quantized formats
    "full": dict(values=1 << 22, repeats=5, replicas=(2, 4, 8), formats=("bf16", "int8", "int4")),
    "quick": dict(values=1 << 14, repeats=2, replicas=(2, 4), formats=("int4",)),
}


def cells(replicas: Sequence[int], formats: Sequence[str]) -> list[tuple[int, str, str]]:
    out = []
    for R in replicas:
        out.append((R, "none", "psum"))
        for fmt in formats:
            out += [(R, fmt, "gather"), (R, fmt, "two_phase")]
    return out


def measure(R: int, fmt: str, method: str, values: np.ndarray, repeats: int) -> dict[str, Any]:
    """Compile and time one exchange on the first R devices."""
    n = values.shape[1]
    mesh = jax.make_mesh((R, 1), ("diloco", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:R])

    def body(x, w):
        total, own_error = exchange_sum(x[0], w[0], fmt, method=method)
        return total, own_error[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("diloco"), P("diloco")), out_specs=(P(), P("diloco"))))
    x = jax.device_put(jnp.asarray(values), NamedSharding(mesh, P("diloco")))
    w = jax.device_put(jnp.ones((R,), jnp.float32), NamedSharding(mesh, P("diloco")))
    start = time.perf_counter()
    compiled = fn.lower(x, w).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    total, _ = jax.block_until_ready(compiled(x, w))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x, w))
        times.append(time.perf_counter() - start)
    exact = values.astype(np.float64).sum(axis=0)
    rel_error = float(np.linalg.norm(np.asarray(total, np.float64) - exact) / np.linalg.norm(exact))
    return {
        "replicas": R,
        "format": fmt,
        "method": method,
        "wire_bytes": wire_nbytes(n, fmt, R, method),
        "time_s": statistics.median(times),
        "times_s": times,
        "compile_s": compile_s,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "rel_error": rel_error,
    }


def render_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    psum = {row["replicas"]: row for row in rows if row["method"] == "psum"}
    table_rows = []
    for row in rows:
        base = psum[row["replicas"]]
        table_rows.append({
            **row,
            "ratio": row["wire_bytes"] / base["wire_bytes"],
            "ms": 1e3 * row["time_s"],
            "temp_per_value": row["temp_bytes"] / result["num_values"],
        })
    columns = [
        ("R", "replicas", None),
        ("format", "format", None),
        ("method", "method", None),
        ("wire bytes / replica", "wire_bytes", common.fmt_bytes),
        ("wire / f32 psum", "ratio", lambda v: f"{v:.3f}"),
        ("time / sync (ms, median)", "ms", lambda v: f"{v:.1f}"),
        ("temp memory / device", "temp_bytes", common.fmt_bytes),
        ("temp bytes / value", "temp_per_value", lambda v: f"{v:.2f}"),
        ("rel. error (1 round)", "rel_error", lambda v: f"{v:.1e}"),
    ]
    header = (
        f"# Outer-gradient exchange: wire bytes, time, memory ({result['mode']})\n\n"
        f"`python -m benchmarks.wire{' --quick' if result['mode'] == 'quick' else ''}`: "
        f"{result['num_values']:,} float32 values per replica, "
        f"{result['num_cpu_devices']} simulated CPU devices (one per replica used), "
        f"{result['machine']['cpu_count']} CPU cores (1-min load average {result['load_average_start_end'][0][0]:.1f} "
        f"at the start, {result['load_average_start_end'][1][0]:.1f} at the end), jax {result['machine']['jax']}; "
        f"time is the median of {result['repeats']} calls after a warm-up, with error feedback's "
        "residual computed too. Wire bytes are what one replica sends per sync "
        "(`_exchange.wire_nbytes`, scales and padding included). On simulated devices the "
        "collectives are memory copies in one process: the time is the encode/decode/sum "
        "work of all R replicas on these cores, not network time. Temp memory is the compiled "
        "sync program's temporary buffers per device (`memory_analysis().temp_size_in_bytes`).\n\n"
    )
    return header + common.markdown_table(table_rows, columns) + "\n"


def run(mode: str, *, out: pathlib.Path, values: int | None = None, repeats: int | None = None,
        replicas: Sequence[int] | None = None, log=print) -> dict[str, Any]:
    settings = dict(MODES[mode])
    values = values or settings["values"]
    repeats = repeats or settings["repeats"]
    replicas = tuple(replicas or settings["replicas"])
    if max(replicas) > len(jax.devices()):
        raise SystemExit(f"R = {max(replicas)} needs {max(replicas)} devices, JAX has {len(jax.devices())}")
    started = time.perf_counter()
    load_start = list(os.getloadavg())  # other work on this machine's cores skews the times
    rows = []
    data = np.random.default_rng(0).normal(size=(max(replicas), values)).astype(np.float32)
    for R, fmt, method in cells(replicas, settings["formats"]):
        row = measure(R, fmt, method, data[:R], repeats)
        log(f"R={R} {fmt:5s} {method:9s} wire {row['wire_bytes']:>11,d} B  {1e3 * row['time_s']:8.1f} ms  "
            f"temp {row['temp_bytes']:>11,d} B  err {row['rel_error']:.1e}")
        rows.append(row)
    result = {
        "benchmark": NAME,
        "mode": mode,
        "num_cpu_devices": len(jax.devices()),
        "pinned_num_cpu_devices": NUM_CPU_DEVICES,
        "num_values": values,
        "repeats": repeats,
        "replicas": list(replicas),
        "machine": common.machine_info(),
        "load_average_start_end": [load_start, list(os.getloadavg())],
        "rows": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    result["markdown"] = render_markdown(result)
    common.write_json(out / f"{NAME}.json", result)
    common.write_text(out / f"{NAME}.md", result["markdown"])
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", dest="mode", action="store_const", const="full", help="the default")
    group.add_argument("--quick", dest="mode", action="store_const", const="quick",
                       help="microscopic, for the tests (numbers are meaningless)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="output folder (default: runs/wire_<mode>; benchmarks/results only when given)")
    parser.add_argument("--values", type=int, default=None, help="float32 values per replica (full: 4Mi)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell (median)")
    parser.add_argument("--replicas", type=int, nargs="+", default=None, help=f"R values (<= {NUM_CPU_DEVICES})")
    args = parser.parse_args(argv)
    mode = args.mode or "full"
    out = args.out or REPO / "runs" / f"{NAME}_{mode}"
    result = run(mode, out=out, values=args.values, repeats=args.repeats, replicas=args.replicas)
    print()
    print(result["markdown"])
    print(f"total {result['elapsed_s']:.0f}s; wrote {out / (NAME + '.json')}, {out / (NAME + '.md')}")
    return result


if __name__ == "__main__":
    main()
