"""`python -m eqx_diloco.launch --decoupled`: a syncer and N decoupled islands on this machine.

    python -m eqx_diloco.launch --decoupled --num-processes 4 --max-restarts 2 -- --diloco.quantize int4

Every process runs `python -m eqx_diloco.train <flags>` with `--decoupled.role syncer` or
`--decoupled.role island --decoupled.island K`, the syncer's address and `--diloco.num-replicas N`.
Islands share no JAX runtime: an island that dies is restarted (up to `--max-restarts` times, after
`--rejoin-after-s`) while the others train on, and joins again from the current theta_g (with
`--spares N`, a standby island already started and compiled takes its place: `--decoupled.standby`); a syncer that
dies is restarted on the same port from its newest checkpoint while the islands retry. The shared
secret is `$EQX_DILOCO_SYNCER_TOKEN` if set, else a fresh random one, passed to the processes in their
environment (never on a command line, which other users of the machine can read). When every island
has finished (or failed with no restarts left), the syncer is stopped: it evaluates theta_g once more,
checkpoints and writes its summary. With `--processes-per-island S` each island is S processes, one JAX
world of their own (a coordinator of its own), its `--mesh.*` devices split over them; one process that
dies takes its island down and the island is restarted as a whole. Each island process runs on its own
share of this machine's CPUs (`--cpus split`, one CPU each where they outnumber the CPUs), so islands
sharing cores do not stall each other's steps; the syncer may use every CPU.

The same roles by hand, on several hosts (see the README):

    host A$ EQX_DILOCO_SYNCER_TOKEN=... python -m eqx_diloco.train --decoupled.role syncer --decoupled.syncer 0.0.0.0:50051 ...
    host B$ EQX_DILOCO_SYNCER_TOKEN=... python -m eqx_diloco.train --decoupled.role island --decoupled.island 0 --decoupled.syncer A:50051 ...
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from .._rpc import TOKEN_ENV
from ._decoupled_config import DECOUPLED_JOB_ENV
from ._processes import (
    LauncherSignals,
    _die_with_launcher,
    _pinned,
    cpu_shares,
    flag_value,
    free_port,
    signal_group,
    stop_all,
    tail,
)
from .island import RUN_T0_ENV


def _run_dir(flags: list[str]) -> Path:
    from .config import Config

    value = flag_value(flags, "--run-dir")
    return Path(value) if value is not None else Config().run_dir


class _Role:
    """One supervised role: the syncer or an island (of `processes` processes), restarted with the same flags.

    The processes of a multi-process island form a JAX world of their own, with a coordinator on a fresh
    port at each start; when one of them exits, the others are stopped with it (they would wait for it in
    their next collective) and the island counts as exited with the first code seen."""

    def __init__(self, name: str, flags: list[str], log: Path, env: dict[str, str], restarts: int,
                 processes: int = 1, cpus: list[list[int]] | None = None, standby: bool = False, island: int | None = None):
        self.name, self.flags, self.log, self.env, self.restarts_left = name, flags, log, env, restarts
        self.standby = standby  # a spare: its processes wait for their island on a pipe (`take_over`)
        self.island = island  # an island's id
        self.processes, self.cpus = processes, cpus  # cpus: each process's CPUs (None: every CPU)
        self.procs: list[subprocess.Popen] = []
        self.restarted = 0
        self.finished = False
        self.restart_at: float | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        """The role's first process (the island's leader), while it runs."""
        return self.procs[0] if self.procs else None

    def start(self, module: str) -> None:
        world: list[str] = []
        if self.processes > 1:
            world = ["--dist.num-processes", str(self.processes),
                     "--dist.coordinator-address", f"127.0.0.1:{free_port()}"]
        self.procs = []
        for p in range(self.processes):
            flags = [*self.flags, *world, *(["--dist.process-id", str(p)] if world else [])]
            log = self.log if p == 0 else self.log.with_name(f"{self.log.stem}-process-{p}.log")
            # The syncer's output (its evaluations of theta_g) is this terminal's; errors go to the logs.
            with log.open("a") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, *flags], env=self.env, stdin=subprocess.PIPE if self.standby else None,
                    stdout=None if self.name == "syncer" else out,
                    stderr=out if self.name == "syncer" else subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_pinned(_die_with_launcher(), self.cpus[p] if self.cpus else None)))

    def take_over(self, island: "_Role") -> None:
        """This spare's processes become `island`: each is told the island's id and its share of the CPUs
        on its standard input (`--decoupled.standby`), and the island's role holds them (its output goes
        on in the spare's log)."""
        for p, proc in enumerate(self.procs):
            line = json.dumps({"island": island.island, "cpus": island.cpus[p] if island.cpus else None}) + "\n"
            try:
                proc.stdin.write(line.encode())
                proc.stdin.close()
            except BrokenPipeError:  # it died meanwhile: the island's poll sees its exit code
                pass
        island.procs, island.log, self.procs = self.procs, self.log, []

    def poll(self, grace_s: float) -> int | None:
        """None while the role runs; else its exit code (0: every process finished), its processes gone."""
        codes = [proc.poll() for proc in self.procs]
        failed = [code for code in codes if code not in (None, 0)]
        if not failed and any(code is None for code in codes):
            return None
        if failed:
            stop_all([proc for proc, code in zip(self.procs, codes) if code is None], grace_s)
        self.procs = []
        return failed[0] if failed else 0


def launch_decoupled(num_islands: int, flags: list[str], *, module: str, log_dir: Path, grace_s: float,
                     max_restarts: int, rejoin_after_s: float, processes_per_island: int = 1,
                     split_cpus: bool = True, spares: int = 0) -> int:
    """Start the syncer and `num_islands` islands of `processes_per_island` processes each, restart what
    dies, stop the syncer when the islands are done. Returns 0 when every island finished its steps.
    With `split_cpus` every island process keeps to its own share of the CPUs (`cpu_shares`), a
    restarted one to the same share. With `spares`, that many standby islands (`--decoupled.standby`)
    are kept ready: a lost island's restart is a spare taking its place (a new spare starts behind it
    while restarts are left), else a fresh start."""
    from ._preflight import RunDirLock
    from .config import ConfigError

    # One decoupled run per run folder, as one trainer: the launch holds the folder's lock, and its
    # syncer and islands find their own job in it.
    job = f"decoupled launch {os.getpid()} {secrets.token_hex(4)}"
    try:
        lock = RunDirLock(_run_dir(flags), job=job).__enter__()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _launch_decoupled(num_islands, flags, module=module, log_dir=log_dir, grace_s=grace_s,
                                 max_restarts=max_restarts, rejoin_after_s=rejoin_after_s,
                                 processes_per_island=processes_per_island, split_cpus=split_cpus, spares=spares,
                                 job=job)
    finally:
        lock.__exit__(None, None, None)


def _launch_decoupled(num_islands: int, flags: list[str], *, module: str, log_dir: Path, grace_s: float,
                      max_restarts: int, rejoin_after_s: float, processes_per_island: int, split_cpus: bool,
                      spares: int, job: str) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    address = flag_value(flags, "--decoupled.syncer")
    if address is None:
        address = f"127.0.0.1:{free_port()}"
        flags = [*flags, "--decoupled.syncer", address]
    if flag_value(flags, "--diloco.num-replicas") is None:
        flags = [*flags, "--diloco.num-replicas", str(num_islands)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault(RUN_T0_ENV, repr(time.time()))  # the islands' and the syncer's common clock
    env.setdefault(TOKEN_ENV, secrets.token_hex(16))
    env[DECOUPLED_JOB_ENV] = job
    syncer = _Role("syncer", [*flags, "--decoupled.role", "syncer"], log_dir / "syncer.log", env, max_restarts)
    shares = cpu_shares(num_islands * processes_per_island) if split_cpus else None

    def share(k: int) -> list[list[int]] | None:  # island k's processes' CPUs
        return shares[k * processes_per_island:(k + 1) * processes_per_island] if shares else None

    islands = [_Role(f"island {k}", [*flags, "--decoupled.role", "island", "--decoupled.island", str(k)],
                     log_dir / f"island-{k}.log", env, max_restarts, processes_per_island, share(k), island=k)
               for k in range(num_islands)]
    started_spares = 0

    def new_spare() -> _Role:
        nonlocal started_spares
        j, k = started_spares, started_spares % num_islands  # spare j starts on island k's share of the CPUs
        started_spares += 1
        spare = _Role(f"spare {j}", [*flags, "--decoupled.role", "island", "--decoupled.standby"],
                      log_dir / f"spare-{j}.log", env, 0, processes_per_island, share(k), standby=True)
        spare.start(module)
        return spare

    pool: list[_Role] = []
    failed: list[str] = []
    each = f" of {processes_per_island} processes" if processes_per_island > 1 else ""
    ready = f", {spares} spare(s)" if spares else ""
    print(f"launcher: syncer at {address}, {num_islands} decoupled islands{each}{ready}; logs in {log_dir}",
          file=sys.stderr)
    roles = [syncer, *islands]
    try:
        with LauncherSignals() as signals:
            for role in roles:
                role.start(module)
            pool = [new_spare() for _ in range(spares)]
            while True:
                if signals.received:
                    sig = signals.received[0]
                    print(f"launcher: got {signal.Signals(sig).name}, stopping the syncer and the islands",
                          file=sys.stderr)
                    return 128 + sig
                now = time.monotonic()
                for role in roles:
                    if not role.procs:
                        if role.restart_at is not None and now >= role.restart_at:
                            role.restart_at = None
                            if role is not syncer and pool:
                                spare = pool.pop(0)
                                spare.take_over(role)
                                print(f"launcher: {spare.name} took the place of {role.name} (its output: {spare.log})",
                                      file=sys.stderr)
                                if any(r.restarts_left > 0 for r in islands):
                                    pool.append(new_spare())
                            else:
                                role.start(module)
                        continue
                    code = role.poll(grace_s)
                    if code is None:
                        continue
                    if code == 0 and role is not syncer:
                        role.finished = True
                        continue
                    last = (tail(role.log, 1) or "").strip()
                    if code == 2:  # a refused flag: every restart would be refused the same way
                        failed.append(f"{role.name} refused its flags: {last}")
                        return 2
                    if role.restarts_left > 0:
                        role.restarts_left -= 1
                        role.restarted += 1
                        role.restart_at = now + (rejoin_after_s if role is not syncer else 0.0)
                        print(f"launcher: {role.name} exited with {code}; restart {role.restarted} of {max_restarts}"
                              + (f" in {rejoin_after_s:g} s" if role is not syncer and rejoin_after_s else ""),
                              file=sys.stderr)
                    elif role is syncer:
                        failed.append(f"the syncer exited with {code} and has no restarts left: {last}")
                        return 1
                    else:
                        failed.append(f"{role.name} exited with {code} and has no restarts left: {last}")
                for spare in list(pool):
                    code = spare.poll(grace_s)
                    if code is not None:  # it is waiting for an island: it should not have exited
                        pool.remove(spare)
                        last = (tail(spare.log, 1) or "").strip()
                        if code == 2:
                            failed.append(f"{spare.name} refused its flags: {last}")
                            return 2
                        print(f"launcher: {spare.name} exited with {code} before it was needed; not replaced: {last}",
                              file=sys.stderr)
                if all(r.finished or (not r.procs and r.restart_at is None) for r in islands):
                    break
                time.sleep(0.05)
            if syncer.proc is not None:
                signal_group(syncer.proc, signal.SIGTERM)
                try:
                    code = syncer.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    failed.append(f"the syncer did not stop within --grace-s {grace_s:g}")
                else:
                    if code != 0:  # e.g. its last checkpoint could not be written: theta_g is not saved
                        failed.append(f"the syncer exited with {code}: {(tail(syncer.log, 1) or '').strip()}")
    finally:
        stop_all([proc for r in [*roles, *pool] for proc in r.procs], grace_s)
        for line in failed:
            print(f"launcher: {line}", file=sys.stderr)
    summary = _run_dir(flags) / "syncer" / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        restarts = sum(r.restarted for r in islands)
        print(f"launcher: {s['tokens_merged']:,} tokens merged into theta_g in {s['merges']} merges "
              f"({s['merges_by_grace']} closed by grace), {s['tokens_refused']:,} refused; "
              f"{restarts} island restarts", file=sys.stderr)
    return 1 if failed else 0
