"""Elastic islands, both sides: the launcher that runs one process per island and re-forms the run
with the live ones when one is lost (`launch_elastic`, `ElasticLauncher`, `ElasticPolicy`, the
`Generation` records and their summary), and what a trainer of one generation reads and writes for
it (`island_layout` from the launcher's variables, `write_progress` for its lost-work accounting,
`Reforming` when asked to re-form). The island snapshots themselves are the core's
(`eqx_diloco._elastic`).

JAX's multi-controller runtime on CPU cannot take a process back once it died (see
docs/elastic_probe.md: survivors can continue in-process, but a restarted process can never
rejoin their gloo context). So the run is re-formed one level up. A *generation* is one
multi-process run over the live islands. When an island dies (any exit but a clean one, or a
frozen process), the others are stopped after `drain_s` seconds (time for their asynchronous
snapshot of the newest sync boundary to reach disk) and the next generation starts at once with
the survivors, from that boundary (`--elastic.enabled`: every island snapshots its share of the
state at every sync boundary). An island with restarts left comes back `rejoin_after_s` seconds
later: the running generation is asked (SIGUSR1) to stop at its next sync boundary, and the next
generation includes the island again, starting from theta_g with a fresh inner optimizer state.

Each generation learns which islands it holds, the full island count and the events that led to
it from the variables `EQX_DILOCO_ISLANDS`, `EQX_DILOCO_NUM_ISLANDS` and
`EQX_DILOCO_ELASTIC_EVENTS` (see `island_layout`); the trainer logs those events in metrics.jsonl.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .._elastic import REFORM_EXIT_CODE, IslandSnapshots
from .._errors import ConfigError
from ._processes import (
    FAILURE_FILE_ENV,
    GENERATION_ENV,
    LauncherSignals,
    LinkLimit,
    failure_markers,
    first_failure,
    flag_value,
    is_stopped,
    link,
    link_env,
    read_failure,
    signal_group,
    spawn,
    stop_all,
    wait_or_kill,
)

ISLANDS_ENV, NUM_ISLANDS_ENV, EVENTS_ENV = "EQX_DILOCO_ISLANDS", "EQX_DILOCO_NUM_ISLANDS", "EQX_DILOCO_ELASTIC_EVENTS"


class Reforming(Exception):
    """The launcher asked (SIGUSR1) to re-form the run so an island can rejoin: every island
    stopped at the same sync boundary, after writing its snapshot of it."""

    def __init__(self, step: int):
        super().__init__(f"re-forming at step {step} so an island can rejoin")
        self.step = step


def island_layout(num_replicas: int) -> tuple[tuple[int, ...], int, list[dict]]:
    """(the island of each replica, the run's full island count, events to log), from the
    variables the elastic launcher sets; without them replica r is island r of R."""
    islands = os.environ.get(ISLANDS_ENV)
    ids = tuple(int(x) for x in islands.split(",")) if islands else tuple(range(num_replicas))
    if len(ids) != num_replicas:
        raise ConfigError(f"--diloco.num-replicas {num_replicas} does not match the {len(ids)} live islands "
                          f"the launcher started ({islands})")
    total = int(os.environ.get(NUM_ISLANDS_ENV, num_replicas))
    events = json.loads(os.environ.get(EVENTS_ENV, "[]"))
    return ids, total, events


def write_progress(directory: Path, t: int) -> None:
    """Record in the island's `directory` that it finished step `t`, for the launcher's lost-work
    accounting (written whole, then renamed: the launcher never reads half a file)."""
    path = directory / "progress.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("progress.json.tmp")
    tmp.write_text(json.dumps({"step": t, "pid": os.getpid()}))
    os.replace(tmp, path)


def launch_elastic(num_islands: int, flags: list[str], *, module: str, bandwidth: str | None, log_dir: Path,
                   grace_s: float, max_restarts: int, rejoin_after_s: float, drain_s: float, min_replicas: int,
                   split_cpus: bool = True) -> int:
    """Run one island per process (`--num-processes` of them, with the launcher's flags); a lost
    island re-forms the run with the others. Returns the launcher's exit code."""
    policy = ElasticPolicy(max_restarts=max_restarts, rejoin_after_s=rejoin_after_s, drain_s=drain_s,
                           min_replicas=min_replicas)
    run_dir = Path(flag_value(flags, "--run-dir") or "runs/default")
    if bandwidth and (problem := LinkLimit.check()):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log_dir.mkdir(parents=True, exist_ok=True)
    with link(bandwidth) as prefix:
        return ElasticLauncher(num_islands, flags, module=module, prefix=prefix, log_dir=log_dir, run_dir=run_dir,
                               policy=policy, grace_s=grace_s, env=link_env(bandwidth), split_cpus=split_cpus).run()


@dataclasses.dataclass
class Generation:
    """One multi-process run over the live islands: which, from which step to which, and when."""

    islands: list[int]
    start_step: int
    started: float  # wall-clock
    last_step: int | None = None  # the last step any of its islands finished
    ended: float | None = None


def generations_summary(generations: list[Generation], tokens_per_island_step: int) -> list[str]:
    """Every generation's islands, steps, time and the tokens its islands trained, then the totals,
    including the tokens of steps trained and then lost to a re-form (the next generation went back
    to an earlier sync boundary)."""
    lines, trained, kept = [], 0, 0
    for g, gen in enumerate(generations):
        last = gen.start_step if gen.last_step is None else max(gen.start_step, gen.last_step)
        tokens = (last - gen.start_step) * len(gen.islands) * tokens_per_island_step
        until = generations[g + 1].start_step if g + 1 < len(generations) else last
        trained += tokens
        kept += (max(gen.start_step, min(last, until)) - gen.start_step) * len(gen.islands) * tokens_per_island_step
        seconds = (gen.ended or time.time()) - gen.started
        lines.append(f"  generation {g}: islands {gen.islands}, steps {gen.start_step}-{last} in {seconds:.1f} s, "
                     f"{tokens:,} tokens")
    seconds = (generations[-1].ended or time.time()) - generations[0].started
    head = f"{len(generations)} generations in {seconds:.1f} s, {trained:,} tokens trained"
    if trained > kept:
        head += f" ({trained - kept:,} of them in steps redone after a re-form)"
    return [head, *lines]


@dataclasses.dataclass
class ElasticPolicy:
    """How the launcher treats lost islands.

    - `max_restarts`: times each island may come back after it was lost.
    - `rejoin_after_s`: seconds after a loss before the island comes back.
    - `drain_s`: seconds the survivors get to finish their snapshot before they are stopped.
    - `min_replicas`: below this many live islands the run stops (exit 1).
    """

    max_restarts: int = 0
    rejoin_after_s: float = 0.0
    drain_s: float = 3.0
    min_replicas: int = 1


class ElasticLauncher:
    """Runs generations until the run finishes, fails, or too few islands are left."""

    def __init__(self, num_islands: int, flags: list[str], *, module: str, prefix: list[str], log_dir: Path,
                 run_dir: Path, policy: ElasticPolicy, grace_s: float, env: dict[str, str] | None = None,
                 split_cpus: bool = True):
        self.num_islands, self.flags, self.module, self.prefix = num_islands, flags, module, prefix
        self.split_cpus = split_cpus  # each generation's islands split the CPUs among them
        self.env = env or {}  # for every island of every generation
        self.generations: list[Generation] = []
        self.log_dir, self.run_dir, self.policy, self.grace_s = log_dir, run_dir, policy, grace_s
        self.live = list(range(num_islands))
        self.restarts = [0] * num_islands
        self.rejoin_at: dict[int, float] = {}  # island -> when it comes back
        self.events: list[dict] = []  # to log in the next generation
        self.procs: list[subprocess.Popen] = []
        self.markers: list[Path] = []  # where each island of the generation writes its failure marker
        self.tee = None

    def _say(self, message: str) -> None:
        print(f"launcher: {message}", file=sys.stderr, flush=True)

    def _progress(self, island: int) -> tuple[int, float]:
        """(the last step the island finished, when it said so), (-1, 0) if never."""
        path = self.run_dir / "elastic" / f"island-{island}" / "progress.json"
        try:
            return json.loads(path.read_text())["step"], path.stat().st_mtime
        except (OSError, ValueError, KeyError):
            return -1, 0.0

    def _newest_snapshot(self, islands: list[int]) -> int:
        steps = [IslandSnapshots(self.run_dir / "elastic" / f"island-{i}").newest() for i in islands]
        return max([s for s in steps if s is not None], default=0)

    def run(self) -> int:
        with LauncherSignals() as signals:
            try:
                self._next_start = self._newest_snapshot(self.live)  # a relaunch goes on from its islands' snapshots
                generation = 0
                while True:
                    outcome = self._generation(generation, signals)
                    if outcome is not None:
                        if len(self.generations) > 1:  # the trainer's own summary covers the last one only
                            for line in generations_summary(self.generations, self._tokens_per_island_step()):
                                self._say(line)
                        return outcome
                    generation += 1
            finally:
                self._stop_all(self.grace_s)
                for marker in self.log_dir.glob("island_*.failed"):  # read by now; the logs say the same
                    marker.unlink(missing_ok=True)

    def _stop_all(self, grace_s: float) -> None:
        stop_all(self.procs, grace_s)
        if self.tee is not None:
            self.tee.join(timeout=5)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                signal_group(p, signal.SIGKILL)
        wait_or_kill(self.procs, 0)
        if self.tee is not None:
            self.tee.join(timeout=5)

    def _generation(self, generation: int, signals: LauncherSignals) -> int | None:
        """Start the live islands and supervise them. Returns an exit code, or None to re-form."""
        islands = list(self.live)
        n = len(islands)
        logs = [self.log_dir / f"island_{i}.log" for i in islands]
        for log in logs:
            with log.open("a") as f:
                f.write(f"=== generation {generation}: islands {islands} ===\n")
        self.markers = failure_markers(self.log_dir, "island", islands)
        env = [{**self.env, ISLANDS_ENV: ",".join(map(str, islands)), NUM_ISLANDS_ENV: str(self.num_islands),
                EVENTS_ENV: json.dumps(self.events),
                GENERATION_ENV: str(generation), FAILURE_FILE_ENV: str(marker)} for marker in self.markers]
        flags = [*self.flags, "--diloco.num-replicas", str(n)]
        started = time.time()
        self.generations.append(Generation(islands, self._next_start, started))
        self.procs, self.tee = spawn(n, flags, module=self.module, prefix=self.prefix, logs=logs, env=env,
                                     log_mode="a", split_cpus=self.split_cpus)
        self._unlogged, self.events = self.events, []  # logged by the generation once it trains
        self._started = started
        asked_to_reform = False
        self.exited_at: dict[int, float] = {}  # wall-clock times, comparable with the failure markers'
        while True:
            if signals.received:
                code = self._forward(signals)
                self._end_generation(islands)
                return code
            codes = [p.poll() for p in self.procs]
            for k, c in enumerate(codes):
                if c is not None:
                    self.exited_at.setdefault(k, time.time())
            if all(c == 0 for c in codes):
                self._end_generation(islands)
                self._report_end()
                return 0
            if all(c == REFORM_EXIT_CODE for c in codes):
                self._end_generation(islands)
                self._rejoin(started)
                return None
            failed = [k for k, c in enumerate(codes) if c not in (None, 0, REFORM_EXIT_CODE)]
            frozen = [k for k, p in enumerate(self.procs) if codes[k] is None and is_stopped(p.pid)]
            if failed or frozen:
                return self._lost(islands, frozen)
            due = [i for i, at in self.rejoin_at.items() if at <= time.time()]
            if due and not asked_to_reform and self._all_training(islands, started):
                for p in self.procs:
                    signal_group(p, signal.SIGUSR1)
                asked_to_reform = True
                self._say(f"island(s) {due} back: the islands re-form at the next sync boundary")
            time.sleep(0.05)

    def _all_training(self, islands: list[int], started: float) -> bool:
        """Every island of this generation finished a step (so its SIGUSR1 handler is installed)."""
        return all(self._progress(i)[1] > started for i in islands)

    def _lost(self, islands: list[int], frozen: list[int]) -> int | None:
        detected = time.time()
        deadline = time.monotonic() + self.policy.drain_s
        while time.monotonic() < deadline and not frozen:
            codes = [p.poll() for p in self.procs]
            for k, c in enumerate(codes):
                if c is not None:
                    self.exited_at.setdefault(k, time.time())
            if all(c is not None for c in codes):
                # Everyone failing alike on their own (a refused flag, a divergence) is the run's failure, not a loss.
                if self._failed_alike(codes):
                    self._end_generation(islands)
                    self._say(f"every island exited with code {codes[0]}; see its last lines above")
                    return codes[0]
                break
            time.sleep(0.05)
        # The lost island, chosen before the others are stopped (see `first_failure`): a frozen one, else
        # one killed from outside, else the one that failed first. An island that fails on its own makes
        # the others fail a moment later, when they lose contact with it: they are not the ones lost.
        first = first_failure(self.procs, self.exited_at, self.markers, frozen, ok=(0, REFORM_EXIT_CODE))
        code = self.procs[first].poll()
        last_step = max(self._progress(i)[0] for i in islands)
        self._kill_all()  # survivors may wait on the lost island inside a collective
        self._end_generation(islands)
        island = islands[first]
        if frozen:
            how = "was frozen"
        elif code is None:  # its marker says it failed first, though it had not exited yet
            how = f"failed ({(read_failure(self.markers[first]) or {}).get('error', 'no reason given')})"
        else:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self.live.remove(island)
        resume = self._newest_snapshot(self.live)
        self._next_start = resume
        event = {"event": "island_lost", "island": island, "detected_unix": detected, "last_step": last_step,
                 "resume_step": resume, "lost_steps": max(0, last_step - resume), "live_replicas": len(self.live)}
        if len(self.live) < self.policy.min_replicas:
            self._say(f"error: island {island} {how} at step {last_step}: {len(self.live)} live island(s) left, "
                      f"below --elastic.min-replicas {self.policy.min_replicas}; stopped")
            return 1
        if not any(self._progress(i)[1] > self._started for i in islands):
            self.events += self._unlogged  # that generation never trained, so never logged them
        self.events.append(event)
        plan = ""
        if self.restarts[island] < self.policy.max_restarts:
            self.restarts[island] += 1
            self.rejoin_at[island] = detected + self.policy.rejoin_after_s
            plan = f"; it rejoins in {self.policy.rejoin_after_s:g} s (restart {self.restarts[island]} of " \
                   f"{self.policy.max_restarts})"
        self._say(f"island {island} {how} at step {last_step}; re-forming with islands {self.live} from the sync "
                  f"boundary at step {resume}{plan}")
        return None

    def _end_generation(self, islands: list[int]) -> None:
        """Note when the running generation ended and the last step its islands finished in it."""
        gen = self.generations[-1]
        steps = [step for step, when in map(self._progress, islands) if when > gen.started]
        gen.last_step, gen.ended = max(steps, default=gen.start_step), time.time()

    def _tokens_per_island_step(self) -> int:
        """--train.batch-size x --train.seq-len among the trainer flags (the trainer's defaults if absent)."""
        from .config import TrainConfig

        def flag(name: str, default: int) -> int:
            value = flag_value(self.flags, name)
            return int(value) if value is not None and value.isdigit() else default

        return flag("--train.batch-size", TrainConfig.batch_size) * flag("--train.seq-len", TrainConfig.seq_len)

    def _failed_alike(self, codes: list[int]) -> bool:
        """Every island exited with the same error code, and (for those that wrote a failure marker)
        the same error: not one island's failure that the others ran into. Numbers are left out of the
        comparison, as each island names its own folder or process."""
        if not (codes[0] > 0 and all(c == codes[0] for c in codes)):
            return False
        markers = [read_failure(m) for m in self.markers]
        if all(m is None for m in markers):
            return True  # no island said why (not the trainer): the codes must do
        errors = {re.sub(r"\d+", "N", str(m.get("error"))) if m else None for m in markers}
        return len(errors) == 1 and None not in errors

    def _rejoin(self, started: float) -> None:
        due = sorted(i for i, at in self.rejoin_at.items() if at <= time.time())
        step = self._newest_snapshot(self.live)
        self._next_start = step
        for island in due:
            del self.rejoin_at[island]
            self.events.append({"event": "island_rejoined", "island": island, "detected_unix": time.time(),
                                "resume_step": step, "live_replicas": len(self.live) + len(due)})
        self.live = sorted(self.live + due)
        self._say(f"island(s) {due} rejoin at step {step}: islands {self.live}")

    def _forward(self, signals: LauncherSignals) -> int:
        sig = signals.received[0]
        forward = signal.SIGINT if sig == signal.SIGINT else signal.SIGTERM
        for p in self.procs:
            if p.poll() is None:
                signal_group(p, forward)
        self._say(f"got {signal.Signals(sig).name}, sent {forward.name} to the islands "
                  f"(killing them after {self.grace_s:g}s)")
        deadline = time.monotonic() + self.grace_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline and len(signals.received) < 2:
            time.sleep(0.05)
        self._kill_all()
        print("interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}", file=sys.stderr)
        return 128 + sig

    def _report_end(self) -> None:
        lost = sum(self.restarts)
        if lost or len(self.live) < self.num_islands:
            self._say(f"finished with islands {self.live} of {self.num_islands} ({lost} rejoin(s))")
