"""Probe of JAX's experimental fault-tolerant multi-controller support on CPU / gloo.

Starts N = 3 processes on 127.0.0.1 (`jax.distributed.initialize`, gloo CPU collectives,
`jax_num_cpu_devices=1` each). Every process loops: it builds an array with one shard per
process (process i holds the value i + 1), sums it with a jitted `jnp.sum` (an all-reduce over
gloo), prints the step and the result, sleeps `--period` seconds. Process 2 SIGKILLs itself
(`os.kill(os.getpid(), SIGKILL)`) at step `--kill-step` (5). Modes:

- plain:   no fault-tolerance flags; the array always spans all of `jax.devices()`.
- recover: `jax_enable_recoverability=True` and XLA_FLAGS `--xla_cpu_collective_timeout_seconds=5`
           (`--collective-timeout`; 0 leaves it unset); every step runs inside
           `with jax.experimental.multihost_utils.live_devices(jax.devices()) as devs:` and the
           array / mesh span only `devs`; exceptions are caught, printed and the loop goes on.
- rejoin:  recover, and the parent restarts process 2 (same process id, a fresh
           `jax.distributed.initialize`) `--restart-delay` seconds after it died (by then the survivors run with 2).

Every process stops by itself `--run-seconds` after its `initialize` returned; the parent kills
whatever is left after `--mode-timeout` seconds, so nothing can hang. Each line a worker prints
carries its wall time; the parent prints them (relative to the moment process 2 died) and a
summary table per mode. Wrap the whole thing in `timeout` anyway:

    timeout 300 python -m benchmarks.elastic_probe --modes plain,recover,rejoin

Findings: docs/elastic_probe.md.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

N = 3
VICTIM = 2


# --------------------------------------------------------------------------------------- worker

def _emit(pid: int, inc: int, kind: str, **kw) -> None:
    print(json.dumps({"t": time.time(), "p": pid, "inc": inc, "kind": kind, **kw}), flush=True)


def worker(args: argparse.Namespace) -> None:
    pid, inc, mode = args.process_id, args.incarnation, args.mode
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if mode in ("recover", "rejoin"):
        jax.config.update("jax_enable_recoverability", True)
    from jax.experimental import multihost_utils as mhu

    t0 = time.time()
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=N, process_id=pid,
        heartbeat_timeout_seconds=args.heartbeat, shutdown_timeout_seconds=args.shutdown_timeout,
        initialization_timeout=60)
    _emit(pid, inc, "init", seconds=round(time.time() - t0, 2), devices=str(jax.devices()))
    deadline = time.time() + args.run_seconds

    def total(devs):
        mesh = jax.sharding.Mesh(np.array(devs), ("i",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
        local = [jax.device_put(np.array([float(d.process_index + 1)], np.float32), d)
                 for d in devs if d.process_index == jax.process_index()]
        x = jax.make_array_from_single_device_arrays((len(devs),), sh, local)
        out = jax.jit(jnp.sum, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(x)
        return float(np.asarray(jax.block_until_ready(out).addressable_data(0)))

    step = 0
    while time.time() < deadline:
        if pid == VICTIM and inc == 0 and step == args.kill_step:
            _emit(pid, inc, "suicide", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        ts = time.time()
        if args.stuck_dump > 0:  # Python stacks of a step that takes longer than this, to stderr
            faulthandler.dump_traceback_later(args.stuck_dump, repeat=False)
        ndev = None
        try:
            if mode == "plain":
                ndev = len(jax.devices())
                val = total(jax.devices())
            else:
                _emit(pid, inc, "phase", step=step, at="enter live_devices")
                with mhu.live_devices(jax.devices()) as devs:
                    ndev = len(devs)
                    _emit(pid, inc, "phase", step=step, at="in live_devices", ndev=ndev)
                    val = total(devs)
                    _emit(pid, inc, "phase", step=step, at="sum done, leaving live_devices")
            _emit(pid, inc, "step", step=step, sum=val, ndev=ndev, seconds=round(time.time() - ts, 3))
        except Exception as e:  # noqa: BLE001 - the probe records whatever is raised
            _emit(pid, inc, "error", step=step, ndev=ndev, seconds=round(time.time() - ts, 3),
                  type=type(e).__name__, msg=str(e)[:600],
                  cause=(f"{type(e.__cause__).__name__}: {str(e.__cause__)[:400]}" if e.__cause__ else None))
        faulthandler.cancel_dump_traceback_later()
        step += 1
        time.sleep(args.period)
    ts = time.time()
    _emit(pid, inc, "shutdown_begin", step=step)
    try:
        jax.distributed.shutdown()
        _emit(pid, inc, "shutdown_end", seconds=round(time.time() - ts, 2))
    except Exception as e:  # noqa: BLE001
        _emit(pid, inc, "shutdown_error", seconds=round(time.time() - ts, 2), type=type(e).__name__, msg=str(e)[:600])
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------- parent

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, cmd: list[str], pid: int, inc: int, log: list, lock: threading.Lock, env: dict):
        self.pid, self.inc = pid, inc
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True)
        self.exit_time: float | None = None
        self.thread = threading.Thread(target=self._read, args=(log, lock), daemon=True)
        self.thread.start()

    def _read(self, log, lock):
        for line in self.popen.stdout:
            now = time.time()
            line = line.rstrip("\n")
            try:
                rec = json.loads(line)
                assert isinstance(rec, dict) and "kind" in rec
            except Exception:  # noqa: BLE001 - stderr / glog lines
                rec = {"t": now, "p": self.pid, "inc": self.inc, "kind": "raw", "msg": line[:800]}
            with lock:
                log.append(rec)
        self.popen.wait()
        self.exit_time = time.time()
        with lock:
            log.append({"t": self.exit_time, "p": self.pid, "inc": self.inc, "kind": "exit",
                        "rc": self.popen.returncode})

    def kill(self):
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    port = _free_port()
    log: list[dict] = []
    lock = threading.Lock()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    flags = args.xla_flags
    if mode != "plain" and args.collective_timeout > 0:
        flags += f" --xla_cpu_collective_timeout_seconds={args.collective_timeout}"
    if flags.strip():
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()

    def cmd(pid, inc):
        return [sys.executable, "-u", "-m", "benchmarks.elastic_probe", "--worker", "--mode", mode,
                "--process-id", str(pid), "--incarnation", str(inc), "--port", str(port),
                "--heartbeat", str(args.heartbeat), "--shutdown-timeout", str(args.shutdown_timeout),
                "--run-seconds", str(args.run_seconds), "--period", str(args.period),
                "--kill-step", str(args.kill_step), "--stuck-dump", str(args.stuck_dump)]

    t_start = time.time()
    procs = [Proc(cmd(i, 0), i, 0, log, lock, env) for i in range(N)]
    restarted = False
    try:
        while time.time() - t_start < args.mode_timeout:
            time.sleep(0.2)
            victim = procs[VICTIM]
            if (mode == "rejoin" and not restarted and victim.exit_time is not None
                    and time.time() - victim.exit_time >= args.restart_delay):
                procs.append(Proc(cmd(VICTIM, 1), VICTIM, 1, log, lock, env))
                restarted = True
            if all(p.popen.poll() is not None for p in procs) and (mode != "rejoin" or restarted):
                break
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.thread.join(timeout=5)
    timed_out = time.time() - t_start >= args.mode_timeout
    with lock:
        log = sorted(log, key=lambda r: r["t"])
    return {"mode": mode, "log": log, "timed_out": timed_out, "t_start": t_start}


def summarize(res: dict) -> list[dict]:
    log = res["log"]
    kill = next((r["t"] for r in log if r["kind"] == "suicide"), None)
    rows = []
    for p, inc in sorted({(r["p"], r["inc"]) for r in log}):
        mine = [r for r in log if r["p"] == p and r["inc"] == inc]
        steps = [r for r in mine if r["kind"] == "step"]
        errs = [r for r in mine if r["kind"] == "error"]
        after = [r for r in steps if kill is not None and r["t"] > kill]
        ex = next((r for r in mine if r["kind"] == "exit"), None)
        first_err = errs[0] if errs else None
        rows.append({
            "proc": f"p{p}" + (f" (restart {inc})" if inc else ""),
            "steps_ok": len(steps),
            "ok_after_kill": len(after),
            "sums_after_kill": sorted({r["sum"] for r in after}),
            "ndev_after_kill": sorted({r["ndev"] for r in after}),
            "errors": len(errs),
            "first_error_at_s": round(first_err["t"] - kill, 1) if first_err and kill else None,
            "first_error": (f"{first_err['type']}: {first_err['msg'][:90]}" if first_err else None),
            "exit_rc": ex["rc"] if ex else "killed-by-parent",
            "exit_at_s": round(ex["t"] - kill, 1) if ex and kill else None,
        })
    return rows


def print_log(res: dict) -> None:
    log = res["log"]
    kill = next((r["t"] for r in log if r["kind"] == "suicide"), res["t_start"])
    print(f"\n=== mode {res['mode']}: log (t relative to process {VICTIM}'s SIGKILL) ===")
    for r in log:
        rest = {k: v for k, v in r.items() if k not in ("t", "p", "inc", "kind")}
        tag = f"p{r['p']}" + (f".{r['inc']}" if r["inc"] else "")
        print(f"{r['t'] - kill:+8.2f}s {tag:5s} {r['kind']:14s} {json.dumps(rest)[:700]}")


def print_table(all_rows: list[tuple[str, bool, list[dict]]]) -> None:
    cols = ["proc", "steps_ok", "ok_after_kill", "sums_after_kill", "ndev_after_kill", "errors",
            "first_error_at_s", "exit_rc", "exit_at_s", "first_error"]
    print("\n=== summary (times in s after process 2's SIGKILL) ===")
    print("| mode | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    for mode, timed_out, rows in all_rows:
        for r in rows:
            print(f"| {mode}{' (TIMEOUT)' if timed_out else ''} | "
                  + " | ".join(str(r[c]) for c in cols) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="plain,recover,rejoin",
                    help="comma-separated subset of plain,recover,rejoin (default: all three)")
    ap.add_argument("--heartbeat", type=int, default=10, help="heartbeat_timeout_seconds (default 10)")
    ap.add_argument("--shutdown-timeout", type=int, default=10, help="shutdown_timeout_seconds (default 10)")
    ap.add_argument("--run-seconds", type=float, default=45.0,
                    help="each worker leaves its loop this long after initialize returned (default 45)")
    ap.add_argument("--period", type=float, default=0.5, help="sleep between steps (default 0.5 s)")
    ap.add_argument("--kill-step", type=int, default=5, help="step at which process 2 SIGKILLs itself (default 5)")
    ap.add_argument("--restart-delay", type=float, default=12.0,
                    help="rejoin mode: seconds after process 2 died before it is started again (default 12)")
    ap.add_argument("--mode-timeout", type=float, default=110.0,
                    help="the parent kills every process of a mode after this many seconds (default 110)")
    ap.add_argument("--stuck-dump", type=float, default=25.0,
                    help="a worker step stuck this long dumps its Python stacks (faulthandler; 0: off; default 25)")
    ap.add_argument("--collective-timeout", type=int, default=5,
                    help="recover/rejoin modes: XLA_FLAGS --xla_cpu_collective_timeout_seconds (the gloo timeout "
                         "of a collective; 0: flag not set, gloo's default applies; default 5)")
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for the workers (all modes; use --xla-flags=...)")
    ap.add_argument("--json", default="", help="also write the raw logs and summary rows to this file")
    ap.add_argument("--quiet", action="store_true", help="only print the summary table")
    # internal: one worker process
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    results, table = [], []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("plain", "recover", "rejoin"):
            ap.error(f"unknown mode {mode!r}")
        res = run_mode(mode, args)
        if not args.quiet:
            print_log(res)
        rows = summarize(res)
        table.append((mode, res["timed_out"], rows))
        results.append({**res, "rows": rows})
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
