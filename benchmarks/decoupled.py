"""Decoupled islands against synchronous DiLoCo: equal speeds, a slow island, and islands killed at random.

Every run is `python -m eqx_diloco.launch --num-processes 4 ...` on this machine, 4 islands of one
replica each, as separate processes:

- `decoupled`: `--decoupled` (a syncer and 4 independent islands; `--decoupled.adaptive-h` in the slow
  and paced scenarios); in the failures scenario also `decoupled-no-wait`, the same with `--decoupled.no-wait`
  (an island pushes in the background and waits only for its first merge at the start; the run ends on
  theta_g's tokens);
- `sync`: the synchronous multi-process run (`--diloco.num-replicas 4`), one JAX world;
- `elastic`: the synchronous run with `--elastic.enabled` (the failures scenario: a lost island
  re-forms the run with the others, then rejoins).

Scenarios:

1. **equal**: no failures, equal speeds, seeds 0..S-1: final eval loss of the global model (every
   island's tokens merged: equal tokens) and wall time.
2. **slow**: island 3 sleeps one median step time after each step (`$EQX_DILOCO_SLOW_ISLANDS`, a
   benchmark-only knob both trainers read; the median step is measured in the equal scenario's first
   decoupled run), so it runs at half speed. Wall time from the launch to the first evaluation of the
   global model at or below the target loss: 1.05 x the mean final eval loss of the equal scenario's
   synchronous runs (within 5% of the fully trained model, fixed before any slow run).
   On this machine's shared cores a sleeping island frees its share for the others, which a
   synchronous run's islands use while they wait for it: the sleep slows island 3 without costing
   the synchronous run what a slower island costs on hardware of its own.
3. **paced**: the slow scenario with every island on a pace of its own (`$EQX_DILOCO_STEP_PERIODS`,
   the other benchmark-only knob): islands 0-2 step once per `PACE_FACTOR` median steps, island 3
   half as often. The pace is longer than a step takes on the shared cores, so each island runs at
   the speed it would have alone, whatever the others do: the case of islands on separate hardware,
   one of an older generation. Same target and measure as slow.
   **speeds_no_wait** adds `decoupled-no-wait` runs to both (same seeds, knobs and target).
4. **failures**: a kill driver SIGKILLs a random island at random moments (seeded; exponential gaps of
   mean `--kill-every-s` seconds, default `KILL_EVERY_S`, from the first step, `--max-kills` of them, a
   kill only once every island killed before has come back), `--max-restarts` enough for all, in
   runs of twice the steps (so the kills fall inside training). The decoupled modes restart a killed
   island with one of `--spares` standby islands (started and compiled, waiting: the launcher's
   `--spares`, default `SPARES`), their failure-free runs with the same idle spares; the
   `decoupled-no-wait-no-spare` mode restarts it from scratch. Reported per mode:
   - goodput, time-based: tokens merged into theta_g per second of the run's training (from the moment
     every island has stepped to the exit; also over the whole run, launch to exit) over the same in
     the mode's failure-free run of that seed and length: the share of the failure-free throughput
     that still reached the global model;
   - goodput, token-based: tokens merged into theta_g over tokens computed (every inner step any
     island ran, including steps a kill threw away). For `elastic` the computed tokens are the
     final run's steps plus each loss's `lost_steps` times the islands that lost them;
   - the survivors' longest step gap around each kill, over their median step time: `decoupled`, from
     the islands' own step lines (every island training at the kill, from its last step line before
     the kill to the next kill or 20 s after), beside the same islands' longest gap over the same
     stretch of the failure-free run (the machine's own jitter); `elastic`, the run's stall at the
     loss and at the rejoin (its `stalled_s` events);
   - seconds from each kill to the killed island's next step line;
   - wall time and final eval loss.
5. **failures_paced**: the failures scenario with every island paced (`$EQX_DILOCO_STEP_PERIODS`, one
   period of `PACE_FACTOR` median steps for all, synchronous runs included), for `decoupled-no-wait`
   with and without spares and `elastic`: each island has CPU to spare between its steps, as on
   hardware of its own, so neither a restart nor a spare warming up takes CPU from the survivors.
6. **long_steps**: the failures scenario for the decoupled modes at `LONG_STEP_BATCH` sequences per
   island step (`LONG_STEP_STEPS` steps): a step of several hundred ms, against which the jitter of 4
   islands and a syncer sharing 2 cores is small, so what a kill itself costs the survivors shows.

Pinned: 4 islands, 2 layers of width 64, 2 heads, 8 sequences of 128 tokens per island step, the embedded
corpus (first 1 MB, contiguous shares), `--diloco.sync-period 10`, int4 outer gradients with error
feedback, the CLI's default inner AdamW and outer optimizer, 16 evaluation sequences every 25 steps of
every island, no Orbax checkpoints in the trainer (the elastic mode uses its island snapshots; the syncer
checkpoints), JAX's compilation cache in a folder of this benchmark shared by all runs; the decoupled
grace window adaptive (the CLI defaults). Modes (`--quick` default: 3 seeds of equal and slow, one
failures run per mode, 300 steps, slow and paced: 3 seeds; `--full`: 3 failure seeds; `--smoke`: 1 seed, equal only, 30 steps).

Output: `decoupled.json` and `decoupled.md` in `--out-dir` (default runs/benchmarks/decoupled_<mode>;
committed results only with `--out-dir benchmarks/results`). Run `python -m benchmarks.decoupled --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import _common as common
from benchmarks._elastic.observe import read_jsonl

ISLANDS = 4
BATCH, SEQ_LEN = 8, 128
LONG_STEP_BATCH, LONG_STEP_STEPS = 48, 200
KILL_EVERY_S = 25.0
MAX_KILLS = 3
SPARES = 2  # kills come in bursts (exponential gaps) and a spare needs seconds to start on these shared cores
NO_SPARE = "-no-spare"  # a decoupled mode's suffix: its killed islands restart from scratch
TARGET_FACTOR = 1.05
PACE_FACTOR = 2.0  # the paced scenario's fast islands step once per this many median steps (of the equal runs)
FLAGS = ["--model.num-layers", "2", "--model.dim", "64", "--model.num-heads", "2",
         "--train.seq-len", str(SEQ_LEN), "--data.source", "corpus", "--data.max-corpus-bytes", "1000000",
         "--diloco.sync-period", "10", "--diloco.quantize", "int4", "--diloco.error-feedback",
         "--train.eval-every", "25", "--train.eval-sequences", "16", "--checkpoint.every", "0", "--train.log-every", "1"]
MODES = {"smoke": dict(steps=30, seeds=1, failure_seeds=0, slow=False, failure_steps=0),
         "quick": dict(steps=300, seeds=3, failure_seeds=1, slow=True, failure_steps=600),
         "full": dict(steps=300, seeds=3, failure_seeds=3, slow=True, failure_steps=600)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Run:
    """One launcher run, observed every 20 ms: evaluations as they appear, the first step, kills."""

    def __init__(self, kind: str, seed: int, steps: int, work: pathlib.Path, cache: pathlib.Path, *,
                 slow_s: float = 0.0, periods: dict[int, float] | None = None, kills: list[float] | None = None,
                 kill_seed: int = 0, batch: int = BATCH, spares: int = 0):
        self.kind, self.seed = kind, seed
        self.tokens_per_step = batch * SEQ_LEN
        self.run_dir = work / (f"{kind}_seed{seed}_{steps}_{'kills' if kills else 'slow' if slow_s else 'paced' if periods else 'equal'}"
                               f"_batch{batch}")
        shutil.rmtree(self.run_dir, ignore_errors=True)
        launcher = ["--num-processes", str(ISLANDS), "--grace-s", "20", "--log-dir", str(self.run_dir) + "_logs"]
        trainer = ["--run-dir", str(self.run_dir), *FLAGS, "--train.batch-size", str(batch),
                   "--train.steps", str(steps), "--train.seed", str(seed)]
        self.decoupled = kind.startswith("decoupled")
        spares = spares if self.decoupled and not kind.endswith(NO_SPARE) else 0  # only a decoupled launcher has them
        if self.decoupled:
            launcher = ["--decoupled", *launcher]
            trainer += ["--decoupled.adaptive-h"] if slow_s or periods else []
            trainer += ["--decoupled.no-wait"] if kind.startswith("decoupled-no-wait") else []
        else:
            trainer += ["--diloco.num-replicas", str(ISLANDS)]
        if kind == "elastic":
            launcher += ["--max-restarts", str(len(kills or ())), "--rejoin-after-s", "1", "--drain-s", "3"]
            trainer += ["--elastic.enabled", "--elastic.min-replicas", "2"]
        elif kills or spares:  # spares also in the failure-free reference: the same processes, one idle
            launcher += ["--max-restarts", str(max(len(kills or ()), 1))] + (["--spares", str(spares)] if spares else [])
        self.cmd = [sys.executable, "-m", "eqx_diloco.launch", *launcher, "--", *trainer]
        self.env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache))
        self.env.pop("EQX_DILOCO_SLOW_ISLANDS", None)
        self.env.pop("EQX_DILOCO_STEP_PERIODS", None)
        if slow_s:
            self.env["EQX_DILOCO_SLOW_ISLANDS"] = f"{ISLANDS - 1}:{slow_s:.4f}"
        if periods:
            self.env["EQX_DILOCO_STEP_PERIODS"] = ",".join(f"{k}:{p:.4f}" for k, p in periods.items())
        self.kill_plan, self.kill_rng = list(kills or []), random.Random(kill_seed)
        self.kills: list[dict] = []
        self.evals: list[dict] = []

    def _pid(self, island: int) -> int | None:
        try:
            if self.decoupled:
                return int((self.run_dir / f"island-{island}" / "pid").read_text())
            return json.loads((self.run_dir / "elastic" / f"island-{island}" / "progress.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None

    def _first_step_seen(self) -> bool:
        """Whether every island has made a step (the end of start-up; synchronous islands step together)."""
        if self.decoupled:
            return all(any("loss" in r for r in read_jsonl(self.run_dir / f"island-{k}" / "metrics.jsonl"))
                       for k in range(ISLANDS))
        return any("loss" in r for r in read_jsonl(self.run_dir / "metrics.jsonl"))

    def _eval_lines(self) -> list[dict]:
        return [r for r in read_jsonl(self.run_dir / "metrics.jsonl") if "eval_loss" in r]

    def go(self, timeout_s: float) -> dict:
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.env["EQX_DILOCO_RUN_T0"] = repr(self.t0)
        out = open(str(self.run_dir) + ".out", "w")
        proc = subprocess.Popen(self.cmd, cwd=common.REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        first_step = None
        waiting_for: tuple[int, int | None] | None = None  # (island, its killed pid) until it is back
        seen = 0
        try:
            while proc.poll() is None:
                now = time.time() - self.t0
                if now > timeout_s:
                    raise RuntimeError(f"{self.run_dir.name} did not finish within {timeout_s:.0f} s")
                lines = self._eval_lines()
                for r in lines[seen:]:
                    self.evals.append({"wall_s": now, "eval_loss": r["eval_loss"], "step": r["step"]})
                seen = len(lines)
                if first_step is None and self._first_step_seen():
                    first_step = now
                if first_step is not None and self.kill_plan:
                    if waiting_for is not None:
                        pid = self._pid(waiting_for[0])
                        if pid is not None and pid != waiting_for[1] and _alive(pid):
                            waiting_for = None
                    if waiting_for is None and now - first_step >= self.kill_plan[0]:
                        island = self.kill_rng.randrange(ISLANDS)
                        pid = self._pid(island)
                        if pid is not None and _alive(pid):
                            os.kill(pid, signal.SIGKILL)
                            self.kills.append({"island": island, "wall_s": time.time() - self.t0,
                                               "since_first_step_s": now - first_step})
                            self.kill_plan.pop(0)
                            waiting_for = (island, pid)
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
        wall = time.time() - self.t0
        lines = self._eval_lines()
        for r in lines[seen:]:
            self.evals.append({"wall_s": wall, "eval_loss": r["eval_loss"], "step": r["step"]})
        if proc.returncode != 0:
            raise RuntimeError(f"{self.run_dir.name} exited with {proc.returncode}: "
                               + pathlib.Path(str(self.run_dir) + ".out").read_text()[-2000:])
        return {"kind": self.kind, "seed": self.seed, "wall_s": wall, "first_step_s": first_step,
                "final_eval_loss": self.evals[-1]["eval_loss"], "evals": self.evals, "kills": self.kills,
                **self._accounting()}

    def _accounting(self) -> dict:
        if self.decoupled:
            summary = json.loads((self.run_dir / "syncer" / "summary.json").read_text())
            steps = {k: [r for r in read_jsonl(self.run_dir / f"island-{k}" / "metrics.jsonl") if "loss" in r]
                     for k in range(ISLANDS)}
            computed = self.tokens_per_step * sum(len(v) for v in steps.values())
            return {"tokens_merged": summary["tokens_merged"], "tokens_computed": computed,
                    "step_times": {k: [r["time"] for r in v] for k, v in steps.items()},
                    "merges_by_grace": summary["merges_by_grace"], "merges": summary["merges"]}
        records = read_jsonl(self.run_dir / "metrics.jsonl")
        merged = self.tokens_per_step * sum(len(r["replica_losses"]) for r in records if "replica_losses" in r)
        lost = [r for r in records if r.get("event") == "island_lost"]
        computed = merged + self.tokens_per_step * sum(r["lost_steps"] * (r["live_replicas"] + 1) for r in lost)
        stalls = [r["stalled_s"] for r in records if r.get("event") in ("island_lost", "island_rejoined")]
        step_times = [r["time"] for r in records if "replica_losses" in r]
        return {"tokens_merged": merged, "tokens_computed": computed, "stalls_s": stalls,
                "median_step_s": statistics.median(b - a for a, b in zip(step_times, step_times[1:])
                                                   if b > a) if len(step_times) > 2 else None}


def median_step_s(run: dict) -> float:
    """Median gap between consecutive step lines of the decoupled islands."""
    gaps = [b - a for times in run["step_times"].values() for a, b in zip(times, times[1:])]
    return statistics.median(gaps)


def back_after(run: dict) -> list[float | None]:
    """Per kill: seconds from the kill to the killed island's next step line (None: it never stepped again)."""
    out = []
    for kill in run["kills"]:
        later = [t for t in run["step_times"][kill["island"]] if t > kill["wall_s"]]
        out.append(min(later) - kill["wall_s"] if later else None)
    return out


def kill_windows(run: dict, horizon_s: float = 20.0) -> list[tuple[float, float, list[int]]]:
    """Per kill: (start, end, survivors): from the kill to the next kill (or `horizon_s` later), and the
    islands training through it (not the killed one, nor one killed before and not back yet, nor one
    that had finished: none may be left when a kill comes near the end)."""
    out = []  # the islands' `time` and the kills' `wall_s` share one origin ($EQX_DILOCO_RUN_T0)
    kills = run["kills"]
    for i, kill in enumerate(kills):
        start = kill["wall_s"]
        end = min(start + horizon_s, kills[i + 1]["wall_s"] if i + 1 < len(kills) else float("inf"))
        survivors = []
        for island, times in run["step_times"].items():
            earlier = [k["wall_s"] for k in kills[:i] if k["island"] == island]
            down = earlier and not any(earlier[-1] < t <= start for t in times)  # killed before, not back yet
            if str(island) != str(kill["island"]) and not down and any(start < t <= end for t in times):
                survivors.append(island)
        out.append((start, end, survivors))
    return out


def longest_gap(run: dict, start: float, end: float, islands: list[int]) -> float:
    """The longest gap between consecutive step lines of `islands` from their last line before `start`
    to `end`."""
    longest = 0.0
    for island in islands:
        times = run["step_times"][island]
        series = [t for t in times if t <= start][-1:] + [t for t in times if start < t <= end]
        longest = max([longest] + [b - a for a, b in zip(series, series[1:])])
    return longest


def kill_gaps(run: dict, calm: dict | None = None) -> tuple[list[float | None], list[float | None] | None]:
    """Per kill, the survivors' longest step gap around it; and with `calm` (the failure-free run of the
    same seed and steps) the same islands' longest gap over the same stretch of training (the windows
    moved by the difference of the two runs' first steps): what the machine's jitter gives without kills."""
    windows = kill_windows(run)
    gaps = [longest_gap(run, *w) if w[2] else None for w in windows]
    if calm is None:
        return gaps, None
    shift = calm["first_step_s"] - run["first_step_s"]
    return gaps, [longest_gap(calm, start + shift, end + shift, islands) if islands else None
                  for start, end, islands in windows]


def time_to_target(run: dict, target: float) -> float | None:
    return next((e["wall_s"] for e in run["evals"] if e["eval_loss"] <= target), None)


def kill_schedule(seed: int, every_s: float = KILL_EVERY_S, count: int = MAX_KILLS) -> list[float]:
    rng = random.Random(1000 + seed)
    times, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(1.0 / every_s)
        times.append(t)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decoupled", description=__doc__.splitlines()[0])
    common.add_mode_flags(parser)
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    parser.add_argument("--work-dir", type=pathlib.Path, default=None, help="run folders (default: temporary)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--kill-every-s", type=float, default=KILL_EVERY_S,
                        help="mean seconds between kills in the failures and long_steps scenarios")
    parser.add_argument("--max-kills", type=int, default=MAX_KILLS, help="kills per run in those scenarios")
    parser.add_argument("--failure-seeds", type=int, default=None,
                        help="seeds of each failure scenario (default: the mode's)")
    parser.add_argument("--spares", type=int, default=SPARES,
                        help="the launcher's --spares in the failure scenarios' decoupled runs (not those named "
                             f"...{NO_SPARE})")
    parser.add_argument("--scenarios",
                        default="equal,equal_no_wait,slow,paced,speeds_no_wait,failures,failures_paced,long_steps",
                        help="which to run (comma-separated; equal implies slow and paced); the others are kept from "
                             "--out-dir's decoupled.json")
    args = parser.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    known = ["equal", "equal_no_wait", "slow", "paced", "speeds_no_wait", "failures", "failures_paced", "long_steps"]
    if not scenarios <= set(known):
        parser.error(f"--scenarios takes {', '.join(known)} (got {args.scenarios})")
    if "equal" in scenarios:
        scenarios |= {"slow", "paced"}  # their target loss and step times come from the equal runs
    mode = args.mode or "quick"
    pinned = dict(MODES[mode])
    if args.failure_seeds is not None:
        pinned["failure_seeds"] = args.failure_seeds
    out_dir = args.out_dir or common.default_out_dir("decoupled", mode)
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="eqx_diloco_decoupled_bench_"))
    cache = work / "jax_cache"
    steps = pinned["steps"]

    def run(kind, seed, steps=steps, **kw):
        print(f"decoupled benchmark: {kind} seed {seed}, {steps} steps, "
              f"{', '.join(f'{k}={v}' for k, v in kw.items()) or 'equal'}", flush=True)
        result = Run(kind, seed, steps, work, cache, **kw).go(args.timeout)
        if kind.startswith("decoupled"):
            result["median_step_s"] = median_step_s(result)
            result["longest_gap_s"] = max(b - a for times in result["step_times"].values()
                                          for a, b in zip(times, times[1:]))
        print(f"  wall {result['wall_s']:.1f} s, final eval loss {result['final_eval_loss']:.4f}", flush=True)
        return result

    # Warm the compilation cache once per kind, so no measured run pays for compiling.
    if mode != "smoke":
        for kind in ("decoupled", "sync"):
            Run(kind, 99, 20, work, cache).go(args.timeout)
    revision = common.revision()
    # Scenarios not run now are kept from --out-dir's decoupled.json (of the same mode).
    previous = out_dir / "decoupled.json"
    result = json.loads(previous.read_text()) if previous.exists() else {}
    if result.get("mode") != mode:
        result = {}
    for scenario in scenarios - {"speeds_no_wait"}:  # measured again below
        for key in {"equal": ["equal"], "equal_no_wait": ["equal_no_wait"], "slow": ["slow"], "paced": ["paced"],
                    "failures": ["failure_free", "failures"],
                    "failures_paced": ["failures_paced_free", "failures_paced"],
                    "long_steps": ["long_steps_free", "long_steps"]}[scenario]:
            result.pop(key, None)
    if "equal" in scenarios:
        equal = {kind: [run(kind, s) for s in range(pinned["seeds"])] for kind in ("decoupled", "sync")}
        result.update({"mode": mode, "steps": steps, "islands": ISLANDS, "flags": FLAGS,
                       "machine": common.machine_info(), "equal": equal,
                       "median_step_s": median_step_s(equal["decoupled"][0])})
        result.setdefault("revisions", {})["equal"] = revision
    elif "equal" not in result:
        parser.error(f"--scenarios without equal needs a decoupled.json of mode {mode} in {out_dir}")
    equal = result["equal"]
    sync_final = statistics.fmean(r["final_eval_loss"] for r in equal["sync"])

    def save() -> None:  # after each scenario: a run that fails later keeps what was measured
        out_dir.mkdir(parents=True, exist_ok=True)
        slim = json.loads(json.dumps(common.jsonable(result)))
        for scenario in ("equal", "equal_no_wait", "slow", "paced", "failure_free", "failures", "failures_paced_free",
                         "failures_paced", "long_steps_free", "long_steps"):
            for runs in slim.get(scenario, {}).values():
                for r in runs:
                    r.pop("step_times", None)
        common.write_json(out_dir / "decoupled.json", slim)
        common.write_text(out_dir / "decoupled.md", report(slim))

    if "equal_no_wait" in scenarios:  # the same seeds with --decoupled.no-wait, against the equal sync runs
        result["equal_no_wait"] = {"decoupled-no-wait": [run("decoupled-no-wait", s) for s in range(pinned["seeds"])]}
        result["revisions"]["equal_no_wait"] = revision
    save()
    result["target_eval_loss"] = target = TARGET_FACTOR * sync_final

    def speed_knobs(scenario: str) -> dict:  # the slow or paced scenario's `Run` arguments
        if scenario == "slow":
            return {"slow_s": result["median_step_s"]}
        return {"periods": {k: result["pace_s"] * (2 if k == ISLANDS - 1 else 1) for k in range(ISLANDS)}}

    for scenario in ("slow", "paced"):
        if not (pinned["slow"] and scenario in scenarios):
            continue
        result["revisions"][scenario] = revision
        if scenario == "paced":
            result["pace_s"] = PACE_FACTOR * result["median_step_s"]
        slow = speed_knobs(scenario)
        result[scenario] = {kind: [run(kind, s, **slow) for s in range(pinned["seeds"])] for kind in ("decoupled", "sync")}
        for runs in result[scenario].values():
            for r in runs:
                r["time_to_target_s"] = time_to_target(r, target)
        save()
    for scenario in ("slow", "paced"):  # the same with --decoupled.no-wait, beside the runs above
        if not (pinned["slow"] and "speeds_no_wait" in scenarios and scenario in result):
            continue
        runs = result[scenario]["decoupled-no-wait"] = [run("decoupled-no-wait", s, **speed_knobs(scenario))
                                                        for s in range(pinned["seeds"])]
        for r in runs:
            r["time_to_target_s"] = time_to_target(r, target)
        result["revisions"][f"{scenario}_no_wait"] = revision
        save()

    def failures(free_key: str, key: str, kinds: tuple[str, ...], steps: int, batch: int, **knobs) -> None:
        result[f"{key}_kill_every_s"], result[f"{key}_max_kills"] = args.kill_every_s, args.max_kills
        result[f"{key}_spares"] = args.spares
        result[free_key] = {kind: [run(kind, s, steps=steps, batch=batch, spares=args.spares, **knobs)
                                   for s in range(pinned["failure_seeds"])]
                            for kind in ["sync" if k == "elastic" else k for k in kinds]}
        save()
        result[key] = {}
        for kind in kinds:
            runs = []
            for s in range(pinned["failure_seeds"]):
                r = run(kind, s, steps=steps, kills=kill_schedule(s, args.kill_every_s, args.max_kills), kill_seed=s,
                        batch=batch, spares=args.spares, **knobs)
                reference = result[free_key]["sync" if kind == "elastic" else kind][s]
                rate = r["tokens_merged"] / (r["wall_s"] - r["first_step_s"])
                base = reference["tokens_merged"] / (reference["wall_s"] - reference["first_step_s"])
                r["goodput_time"] = rate / base
                r["goodput_wall"] = (r["tokens_merged"] / r["wall_s"]) / (reference["tokens_merged"] / reference["wall_s"])
                r["goodput_tokens"] = r["tokens_merged"] / r["tokens_computed"]
                if kind != "elastic":
                    r["kill_gaps_s"], r["calm_gaps_s"] = kill_gaps(r, reference)
                    r["back_after_s"] = back_after(r)
                runs.append(r)
            result[key][kind] = runs
        save()

    if pinned["failure_seeds"] and "failures" in scenarios:
        result["revisions"]["failures"] = revision
        result["failure_steps"] = pinned["failure_steps"]
        failures("failure_free", "failures", ("decoupled", "decoupled-no-wait", f"decoupled-no-wait{NO_SPARE}", "elastic"),
                 pinned["failure_steps"], BATCH)
    if pinned["failure_seeds"] and "failures_paced" in scenarios:
        # Every island on one pace (the paced scenario's fast one): each has CPU to spare between its steps,
        # as islands on hardware of their own do, so a restart or a spare warming up does not slow the others.
        result["revisions"]["failures_paced"] = revision
        result["failures_paced_pace_s"] = pace = PACE_FACTOR * result["median_step_s"]
        failures("failures_paced_free", "failures_paced", ("decoupled-no-wait", f"decoupled-no-wait{NO_SPARE}", "elastic"),
                 pinned["failure_steps"], BATCH, periods={k: pace for k in range(ISLANDS)})
    if pinned["failure_seeds"] and "long_steps" in scenarios:
        result["revisions"]["long_steps"] = revision
        failures("long_steps_free", "long_steps", ("decoupled", "decoupled-no-wait"), LONG_STEP_STEPS, LONG_STEP_BATCH)
    save()
    print(report(result))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _table(headers: list[str], rows: list[list[str]]) -> str:
    return common.markdown_table([dict(zip(headers, row)) for row in rows], [(h, h, None) for h in headers])


def _failures_table(runs_by_kind: dict) -> str:
    rows = []
    for kind, runs in runs_by_kind.items():
        for r in runs:
            if kind != "elastic":
                median = r["median_step_s"]
                gaps = ", ".join("-" if g is None else f"{g:.2f}" for g in r["kill_gaps_s"])
                calm = ", ".join("-" if g is None else f"{g:.2f}" for g in r["calm_gaps_s"])
                most = max((g for g in r["kill_gaps_s"] if g is not None), default=0.0)
                most_calm = max((g for g in r["calm_gaps_s"] if g is not None), default=0.0)
                worst = (f"{most / median:.1f}x ({gaps} s; median step {median * 1000:.0f} ms); without kills "
                         f"{most_calm / median:.1f}x ({calm} s)")
            else:
                worst = (f"{max(r['stalls_s'], default=0) / r['median_step_s']:.0f}x (stalls "
                         + ", ".join(f"{g:.1f}" for g in r["stalls_s"]) + f" s; median step "
                         f"{r['median_step_s'] * 1000:.0f} ms)") if r["median_step_s"] else "-"
            back = ", ".join("-" if b is None else f"{b:.1f}" for b in r.get("back_after_s", []))
            rows.append([kind, str(r["seed"]), str(len(r["kills"])), f"{r['goodput_time']:.2f} ({r['goodput_wall']:.2f})",
                         f"{r['goodput_tokens']:.3f}", worst, f"{back} s" if back else "-", f"{r['wall_s']:.1f} s",
                         f"{r['final_eval_loss']:.4f}"])
    return _table(["mode", "seed", "kills", "goodput, time (whole run)", "goodput (tokens)",
                   "survivors' longest gap / median step", "killed island's next step after", "wall time",
                   "final eval loss"], rows)


def _goodput_summary(runs_by_kind: dict) -> list[str]:
    """Per mode with more than one seed: its time-based goodput, mean +- sd over the seeds."""
    parts = [f"{kind} {common.fmt_pm(common.mean_sd(r['goodput_time'] for r in runs), '.3f')}"
             for kind, runs in runs_by_kind.items() if len(runs) > 1]
    if not parts:
        return []
    seeds = max(len(runs) for runs in runs_by_kind.values())
    return [f"Goodput, time, mean +- sd over {seeds} seeds: " + "; ".join(parts) + ".", ""]


def report(result: dict) -> str:
    ms = common.mean_sd
    equal = result["equal"]
    lines = [f"# Decoupled islands vs synchronous DiLoCo ({result['mode']}: {result['islands']} islands, "
             f"{result['steps']} steps each)", "",
             f"Command: `python -m benchmarks.decoupled --{result['mode']}`; trainer flags `{' '.join(result['flags'])}`.",
             "", "## Equal speeds, no failures", ""]
    rows = []
    for kind, runs in equal.items():
        rows.append([kind, str(len(runs)), common.fmt_pm(ms(r["final_eval_loss"] for r in runs), ".4f"),
                     common.fmt_pm(ms(r["wall_s"] for r in runs), ".1f", " s")])
    lines += [_table(["mode", "seeds", "final eval loss", "wall time"], rows), ""]
    gap = common.paired_gap({r["seed"]: r["final_eval_loss"] for r in equal["decoupled"]},
                            {r["seed"]: r["final_eval_loss"] for r in equal["sync"]})
    lines += [f"Decoupled vs synchronous final eval loss, paired by seed: {common.fmt_pm(gap, '+.2f', '%')} "
              f"(target: within 2%). Median island step: {result['median_step_s'] * 1000:.1f} ms.", ""]
    if "equal_no_wait" in result:
        runs = result["equal_no_wait"]["decoupled-no-wait"]
        gap = common.paired_gap({r["seed"]: r["final_eval_loss"] for r in runs},
                                {r["seed"]: r["final_eval_loss"] for r in equal["sync"]})
        lines += [f"With `--decoupled.no-wait` ({len(runs)} seeds): final eval loss "
                  f"{common.fmt_pm(ms(r['final_eval_loss'] for r in runs), '.4f')}, wall time "
                  f"{common.fmt_pm(ms(r['wall_s'] for r in runs), '.1f', ' s')}; against the synchronous runs above, "
                  f"paired by seed: {common.fmt_pm(gap, '+.2f', '%')}.", ""]
    for scenario in ("slow", "paced"):
        if scenario not in result:
            continue
        if scenario == "slow":
            lines += ["## Island 3 at half speed", "",
                      f"Island 3 sleeps {result['median_step_s'] * 1000:.1f} ms after each step; target eval loss "
                      f"{result['target_eval_loss']:.4f} (1.05 x the synchronous runs' final loss above). The "
                      "islands share this machine's cores: while island 3 sleeps and the synchronous run's other "
                      "islands wait for it, its next step has the cores to itself.", ""]
        else:
            lines += ["## Island 3 at half speed, every island on a pace of its own", "",
                      f"Islands 0-2 step once per {result['pace_s'] * 1000:.0f} ms ({PACE_FACTOR:g} median steps), "
                      f"island 3 once per {2 * result['pace_s'] * 1000:.0f} ms (`$EQX_DILOCO_STEP_PERIODS`): each runs "
                      "at the speed it would have on hardware of its own, as islands on separate machines do. "
                      "Same target.", ""]
        rows = []
        for kind, runs in result[scenario].items():
            reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
            rows.append([kind, str(len(runs)), f"{len(reached)} / {len(runs)}", common.fmt_pm(ms(reached), ".1f", " s"),
                         common.fmt_pm(ms(r["final_eval_loss"] for r in runs), ".4f"),
                         common.fmt_pm(ms(r["wall_s"] for r in runs), ".1f", " s")])
        lines += [_table(["mode", "seeds", "reached target", "wall time to target", "final eval loss",
                                         "wall time"], rows), ""]
        sync = {r["seed"]: r["time_to_target_s"] for r in result[scenario]["sync"]}
        for kind, label in (("decoupled", "Decoupled"), ("decoupled-no-wait", "With `--decoupled.no-wait`")):
            pairs = [(r["time_to_target_s"], sync.get(r["seed"])) for r in result[scenario].get(kind, [])]
            if pairs and all(d is not None and s is not None for d, s in pairs):
                lines += [f"{label}: over synchronous wall time to target, paired by seed: "
                          f"{common.fmt_pm(ms(d / s for d, s in pairs), '.3f')} (target: below 1).", ""]
    if "failures" in result:
        lines += ["## Islands killed at random", "",
                  f"{result['failure_steps']} steps per island. Kills: exponential gaps of mean "
                  f"{result.get('failures_kill_every_s', KILL_EVERY_S):g} s from "
                  f"the first step, at most {result.get('failures_max_kills', MAX_KILLS)}, a random island each "
                  "(seeded); each killed island is restarted: in the decoupled modes by one of "
                  f"{result.get('failures_spares', 0)} spare(s) the launcher keeps started and compiled "
                  f"(`--spares`), also in their failure-free runs, where it stays idle; in `{NO_SPARE[1:]}` modes "
                  "from scratch. Killed island's next step: seconds from each kill to the island's next step line. "
                  "Goodput, time: tokens merged per second of training (from the moment every island "
                  "has stepped to the exit) over the failure-free run's (same seed and steps), and in brackets the "
                  "same over the whole run (launch to exit); goodput (tokens): tokens merged over tokens computed. "
                  "Survivors' longest gap: per kill, the longest time between two step lines of the islands "
                  "training through it, from the kill to the next kill or 20 s after (-: the others had "
                  "finished); beside it the same islands' "
                  "longest gap over the same stretch of the failure-free run (its windows moved by the difference "
                  "of the runs' first steps): the machine's own step jitter, with no kill.", ""]
        lines += [_failures_table(result["failures"]), "", *_goodput_summary(result["failures"])]
    if "failures_paced" in result:
        lines += ["## Islands killed at random, every island paced", "",
                  f"As above (no waiting mode), every island stepping once per "
                  f"{result['failures_paced_pace_s'] * 1000:.0f} ms ({PACE_FACTOR:g} median steps of the equal runs, "
                  "`$EQX_DILOCO_STEP_PERIODS`), in the synchronous runs too: each island has CPU to spare between "
                  "its steps, as islands on hardware of their own have, so what a kill costs is the killed island's "
                  "time away, not a restart or a spare warming up on the survivors' cores.", ""]
        lines += [_failures_table(result["failures_paced"]), "", *_goodput_summary(result["failures_paced"])]
    if "long_steps" in result:
        lines += [f"## Islands killed at random, long steps ({LONG_STEP_BATCH} sequences per island step)", "",
                  f"As above with `--train.batch-size {LONG_STEP_BATCH}` and {LONG_STEP_STEPS} steps per island (kills "
                  f"at a mean gap of {result.get('long_steps_kill_every_s', KILL_EVERY_S):g} s), the "
                  "decoupled modes only: with a step of several hundred ms, the 4 islands and the syncer sharing "
                  "this machine's cores add little jitter to a step, so a stall that a kill caused would show.", ""]
        lines += [_failures_table(result["long_steps"]), "", *_goodput_summary(result["long_steps"])]
    m = result["machine"]
    revisions = ", ".join(f"{k}: {v}" for k, v in result.get("revisions", {}).items())
    lines += [f"{m['cpu_count']} CPUs, {m['platform']}, Python {m['python']}, JAX {m['jax']}; code revisions "
              f"{revisions}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
