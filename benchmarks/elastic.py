"""Elastic islands under fire: 3 islands, SIGKILL one at random moments, the run goes on.

Issue 14's acceptance benchmark. One run of `python -m eqx_diloco.launch --num-processes 3
--max-restarts K --rejoin-after-s 1 --drain-s 3 -- --elastic.enabled ...` (one island per
process) is attacked by a kill driver: K times it picks an island and a moment, SIGKILLs that
island's trainer process (the pid in `<run-dir>/elastic/island-<i>/progress.json`), then waits
until the run re-formed without it AND the island rejoined (all 3 islands training again)
before the next kill, so the kills are spread over the run. Then (not in `--smoke`) the same
command runs once more without kills (same seed), and the final eval losses are compared.

The moments (seeded `random.Random(--seed)`): each kill gets a target step (the run's
kill window cut into K equal slices, a uniform step in each; never earlier than 1 to H steps
after the previous rejoin), a random island, and a kind, the K kinds dealt round-robin from
(`checkpoint`, `sync`, `any`) and shuffled. Once the island reported the target step:

- `sync`: at a fresh line of a step during which a sync is in flight (see below), kill it
  0.3 to 1.5 step times later (uniform), when the sync's exchange is most likely running;
- `checkpoint`: once an orbax save is running (a `<step>.orbax-checkpoint-tmp*` folder of this
  generation under `<run-dir>/checkpoints`), kill it after a uniform delay in [0, 20 ms);
- `any`: after a uniform delay in [0, one step time).

A moment that does not come within 4 checkpoint periods falls back to `any`. What the kill
hit is recorded from what is visible just before the signal: an orbax save in progress (its tmp
folder), an island snapshot being written (a `<step>.snapshot.tmp` of this generation; a kill
mid-write leaves one behind), and whether the island had an overlapped sync in flight: launched
(dispatched to its communication device) and not merged yet, read off the island's newest
line t (`sync_in_flight`: the trainer writes the line of t once step t + 1, and the sync
launched after it, are dispatched, and waits for a boundary step t + 1 to be computed before
that line; with tau = 1 a sync is in flight during the lines of the odd steps). Whether its
bytes were on the wire at that instant or it was still queued behind step t + 1 is not visible
from outside. Step time is the attacked run's own, from metrics.jsonl.

Reported (from metrics.jsonl's `island_lost` / `island_rejoined` events and the driver's
clock): kills survived / tried (survived: the loss is logged for that island, the others
train on with 2 replicas, the island rejoins and trains with 3, and the run goes on to the
next kill, or for the last one finishes with exit 0 and its final evaluation); per kill the
seconds the run stalled at the loss and at the rejoin (the events' `stalled_s`), the inner
steps of work lost (the event's `lost_steps`: the newest step any island had reported minus
the sync boundary the run re-formed from; bound: H = `--diloco.sync-period`, flagged when
exceeded); the final eval loss of the attacked run vs the uninterrupted one (acceptance:
within 2%); and whether metrics.jsonl holds every step's line exactly once.

Pinned (every mode): 3 islands; the model of the tests (2 layers, width 32, 2 heads), seq 32,
4 sequences per island, the embedded corpus (first 1 MB), 16 eval sequences; Streaming DiLoCo
H = 6, P = 3, tau = 1 (a fragment syncs every 2 steps and each sync overlaps one step, so a
sync is in flight half the time; sync boundaries, where islands snapshot, every 2 steps);
the default inner AdamW; outer SGD lr 1.0 with Nesterov momentum 0.3 (the CLI default, pinned:
its buffer is outer state each re-formed run must carry over); checkpoints every 5 steps; one
evaluation at the end; training seed 0; `--elastic.min-replicas 2`; launcher `--rejoin-after-s 1
--drain-s 3 --grace-s 10`;
JAX's persistent compilation cache on (the CLI default) in a folder of this benchmark,
shared by both runs. Modes (`_common.add_mode_flags`):

- `--quick` (default): 3 kills, 120 steps;
- `--full`: 10 kills, 240 steps (the acceptance run);
- `--smoke`: 1 kill, 36 steps, for the test suite.

Every wait has a timeout and the whole benchmark a bound (`--timeout`, default per mode:
smoke 600 s, quick 1800 s, full 3600 s): past it, the launcher is stopped (SIGTERM, then
SIGKILL of its process group; islands die with it) and the result says why it failed, with
the tails of the launcher's and the islands' logs.

Output in `--out-dir` (default `runs/benchmarks/elastic_<mode>`; committed results under
`benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`elastic.json` (or `--json PATH`) and `elastic.md`. Run dirs and logs go to `--work-dir`
(default: a temporary folder, removed after a passing run and kept, and named, otherwise).
Exit status 0 when every acceptance check passed, 1 otherwise.

Run `python -m benchmarks.elastic --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/elastic.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from eqx_diloco.schedule import synced_fragment

NAME = "elastic"
REPO = pathlib.Path(__file__).resolve().parents[1]

ISLANDS = 3
H, P, TAU = 6, 3, 1  # sync period, fragments, overlap steps
CHECKPOINT_EVERY = 5
REJOIN_AFTER_S, DRAIN_S, GRACE_S = 1.0, 3.0, 10.0
TRAIN_SEED = 0
# The CLI's default outer optimizer since 391fda0, pinned: its Nesterov buffer is outer state that
# every re-formed run must carry over.
OUTER = ["--diloco.outer-lr", "1.0", "--diloco.outer-momentum", "0.3", "--diloco.nesterov"]
LOSS_TOLERANCE = 0.02  # final eval loss within 2% of the uninterrupted run
KINDS = ("checkpoint", "sync", "any")
ORBAX_TMP = ".orbax-checkpoint-tmp"


@dataclasses.dataclass(frozen=True)
class Mode:
    kills: int
    steps: int
    timeout_s: float  # the whole benchmark
    reference: bool = True  # also run uninterrupted and compare the final eval losses


MODES = {
    "smoke": Mode(kills=1, steps=36, timeout_s=600.0, reference=False),
    "quick": Mode(kills=3, steps=120, timeout_s=1800.0),
    "full": Mode(kills=10, steps=240, timeout_s=3600.0),
}


def train_flags(run_dir: pathlib.Path, steps: int) -> list[str]:
    return ["--run-dir", str(run_dir), "--elastic.enabled", "--elastic.min-replicas", "2",
            "--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2",
            "--train.seq-len", "32", "--train.batch-size", "4", "--data.source", "corpus",
            "--data.max-corpus-bytes", "1000000", "--train.eval-sequences", "16",
            "--diloco.sync-period", str(H), "--diloco.num-fragments", str(P), "--diloco.overlap-steps", str(TAU),
            "--train.steps", str(steps), "--train.eval-every", str(steps), "--train.log-every", "1",
            "--checkpoint.every", str(CHECKPOINT_EVERY), "--train.seed", str(TRAIN_SEED), *OUTER]


def launch_command(run_dir: pathlib.Path, log_dir: pathlib.Path, steps: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", str(ISLANDS),
            "--max-restarts", str(max_restarts), "--rejoin-after-s", f"{REJOIN_AFTER_S:g}",
            "--drain-s", f"{DRAIN_S:g}", "--grace-s", f"{GRACE_S:g}", "--log-dir", str(log_dir),
            "--", *train_flags(run_dir, steps)]


def display_command(cmd: Sequence[str], work: pathlib.Path) -> str:
    text = " ".join(["python", *cmd[1:]])
    return text.replace(str(work), "<work>")


def child_env(cache: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache))  # a test session's cache is kept
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# -- reading a run ------------------------------------------------------------------------


class Failed(Exception):
    """The benchmark cannot go on (a wait timed out, the run ended early); the message says why."""


def read_records(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return records


def progress(run_dir: pathlib.Path, island: int) -> dict[str, Any] | None:
    """{"step", "pid", "mtime"} of the island's progress.json, None before its first step."""
    path = run_dir / "elastic" / f"island-{island}" / "progress.json"
    try:
        mtime = path.stat().st_mtime
        return {**json.loads(path.read_text()), "mtime": mtime}
    except (OSError, ValueError):
        return None


def step_of(run_dir: pathlib.Path, island: int) -> int:
    seen = progress(run_dir, island)
    return -1 if seen is None else seen["step"]


def is_island_process(pid: int, run_dir: pathlib.Path) -> bool:
    """Whether `pid` is a live trainer process of this run (never signal anything else)."""
    try:
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and b"eqx_diloco.train" in cmdline and str(run_dir).encode() in cmdline


def checkpoint_saves(run_dir: pathlib.Path, since_step: int) -> list[str]:
    """orbax tmp folders (saves in progress) of steps after `since_step` (older ones are leftovers of a kill)."""
    found = []
    try:
        names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    except OSError:
        return []
    for name in names:
        if ORBAX_TMP in name:
            head = name.split(".", 1)[0]
            if head.isdigit() and int(head) > since_step:
                found.append(name)
    return sorted(found)


def snapshot_writes(run_dir: pathlib.Path, since_step: int) -> list[str]:
    """Island snapshots being written (`<step>.snapshot.tmp`) of steps after `since_step` (a kill
    mid-write leaves its tmp file behind)."""
    found = []
    for i in range(ISLANDS):
        folder = run_dir / "elastic" / f"island-{i}"
        try:
            names = [p.name for p in folder.iterdir()]
        except OSError:
            continue
        for name in names:
            head = name.removesuffix(".snapshot.tmp")
            if name.endswith(".snapshot.tmp") and head.isdigit() and int(head) > since_step:
                found.append(f"island-{i}/{name}")
    return sorted(found)


def sync_in_flight(reported: int) -> int | None:
    """The fragment of an overlapped sync that an island has launched and not merged yet, while its
    newest line in progress.json is step `reported`; None if there is none.

    The trainer writes step t's line once step t + 1 is dispatched (with the sync launched after
    t + 1, if any, on the communication device), and at a sync boundary t + 1 (a merge) only after
    t + 1 is computed (its snapshot needs it). So during the line of t, the syncs launched after
    steps u in t + 2 - tau .. t + 1 are in flight: launched, their merge after u + tau not computed.
    """
    for u in range(reported + 2 - TAU, reported + 2):
        if u >= 1 and synced_fragment(u, H, P) is not None:
            return synced_fragment(u, H, P)
    return None


def tail(path: pathlib.Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- one launcher run ----------------------------------------------------------------------


class Launch:
    """One `eqx_diloco.lm.launch` run in its own session, stdout/stderr to files; stoppable for sure."""

    def __init__(self, cmd: list[str], work: pathlib.Path, name: str, env: dict[str, str]):
        self.cmd, self.name = cmd, name
        self.out, self.err = work / f"{name}.launcher.out", work / f"{name}.launcher.err"
        self.log_dir = work / f"{name}_logs"
        self.started = time.time()
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, deadline: float) -> int:
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise Failed(f"the {self.name} run did not finish in time") from None

    def stop(self, run_dir: pathlib.Path) -> None:
        """SIGTERM the launcher (it stops the islands within --grace-s), then SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=GRACE_S + 10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        for i in range(ISLANDS):  # islands die with the launcher (PDEATHSIG); make sure
            seen = progress(run_dir, i)
            if seen and is_island_process(seen["pid"], run_dir):
                os.kill(seen["pid"], signal.SIGKILL)

    def launcher_lines(self) -> list[str]:
        try:
            text = self.err.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.startswith("launcher:")]

    def tails(self) -> dict[str, str]:
        out = {"launcher_stderr": tail(self.err, 40), "launcher_stdout": tail(self.out, 15)}
        for i in range(ISLANDS):
            out[f"island_{i}_log"] = tail(self.log_dir / f"island_{i}.log", 25)
        return out


def wait_until(condition: Callable[[], Any], what: str, *, timeout_s: float, deadline: float, launch: Launch,
               poll_s: float = 0.01) -> Any:
    """Poll `condition` until it returns something truthy (returned); `Failed` on a timeout or when
    the run ends first."""
    until = min(time.monotonic() + timeout_s, deadline)
    while True:
        value = condition()
        if value:
            return value
        code = launch.poll()
        if code is not None:
            value = condition()
            if value:
                return value
            raise Failed(f"the run ended (launcher exit {code}) while waiting for {what}")
        if time.monotonic() > until:
            raise Failed(f"timed out ({timeout_s:.0f} s or the benchmark's bound) waiting for {what}")
        time.sleep(poll_s)


def finish_summary(run_dir: pathlib.Path, steps: int) -> dict[str, Any]:
    records = read_records(run_dir)
    logged = [r["step"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r and r["step"] == steps]
    return {
        "all_steps_logged": sorted(logged) == list(range(1, steps + 1)),
        "missing_steps": sorted(set(range(1, steps + 1)) - set(logged)),
        "repeated_steps": sorted({t for t in logged if logged.count(t) > 1}),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "records": records,
    }


def reference_run(work: pathlib.Path, steps: int, env: dict[str, str], deadline: float) -> dict[str, Any]:
    run_dir = work / "reference"
    launch = Launch(launch_command(run_dir, work / "reference_logs", steps, max_restarts=0), work, "reference", env)
    try:
        code = launch.wait(deadline)
    except Failed as e:
        launch.stop(run_dir)
        raise Failed(f"{e}\n" + json.dumps(launch.tails(), indent=1)) from None
    wall = time.time() - launch.started
    done = finish_summary(run_dir, steps)
    if code != 0 or done["final_eval_loss"] is None:
        raise Failed(f"the uninterrupted run failed (exit {code})\n" + json.dumps(launch.tails(), indent=1))
    return {"exit_code": code, "wall_s": wall, "final_eval_loss": done["final_eval_loss"],
            "all_steps_logged": done["all_steps_logged"],
        "missing_steps": done["missing_steps"],
        "repeated_steps": done["repeated_steps"], "step_s": step_time(run_dir),
            "command": display_command(launch.cmd, work)}


# -- the attacked run ----------------------------------------------------------------------


def kill_plan(rng: random.Random, kills: int, steps: int) -> list[dict[str, Any]]:
    """Per kill: target step, island, kind."""
    lo, hi = 2 * H, steps - 3 * H  # islands have snapshots; room to lose, re-form and rejoin before the end
    width = (hi - lo) / kills
    kinds = [KINDS[k % len(KINDS)] for k in range(kills)]
    rng.shuffle(kinds)
    plan = []
    for k in range(kills):
        start = lo + int(k * width)
        plan.append({"target_step": start + rng.randrange(max(1, int(width))), "island": rng.randrange(ISLANDS),
                     "kind": kinds[k]})
    return plan


def count_events(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == name]


def step_time(run_dir: pathlib.Path) -> float:
    """Seconds per step of the current generation: the mean over its last (up to 12) consecutive step
    lines (lines come in bursts: a line waits for the next boundary, so single gaps mislead)."""
    lines = [r for r in read_records(run_dir) if "loss" in r and "time" in r]
    run = lines[-1:]
    for line in reversed(lines[:-1]):
        if len(run) == 12 or line["step"] != run[0]["step"] - 1 or line["time"] >= run[0]["time"]:
            break
        run.insert(0, line)
    if len(run) < 3:
        return 0.3
    return (run[-1]["time"] - run[0]["time"]) / (len(run) - 1)


def attacked_run(work: pathlib.Path, mode: Mode, env: dict[str, str], deadline: float, rng: random.Random,
                 log: Callable[[str], None]) -> dict[str, Any]:
    run_dir = work / "elastic"
    launch = Launch(launch_command(run_dir, work / "elastic_logs", mode.steps, max_restarts=mode.kills), work,
                    "elastic", env)
    plan = kill_plan(rng, mode.kills, mode.steps)
    kills: list[dict[str, Any]] = []
    failure = None
    generation_start = 0  # the step the current 3-island generation started from
    recovery_s = 600.0
    try:
        # Every island trains (its first progress) before anything is killed.
        wait_until(lambda: all(progress(run_dir, i) for i in range(ISLANDS)), "the first step of every island",
                   timeout_s=900, deadline=deadline, launch=launch, poll_s=0.1)
        for k, planned in enumerate(plan):
            island, kind = planned["island"], planned["kind"]
            now_step = step_of(run_dir, island)
            target = max(planned["target_step"], now_step + rng.randint(1, H))
            if target > mode.steps - H - 2:
                log(f"kill {k + 1}: no room left before the end of the run (target step {target}); stopping here")
                break
            sub_delay = rng.random()  # scaled below by the kind's window
            wait_until(lambda i=island, t=target: step_of(run_dir, i) >= t,
                       f"island {island} to reach step {target}", timeout_s=recovery_s, deadline=deadline,
                       launch=launch)
            step_s = step_time(run_dir)
            moment_wait = 4 * CHECKPOINT_EVERY * step_s + 30  # generous: steps are slower on a loaded machine
            fallback = False
            try:
                if kind == "sync":
                    # A fresh line during which a sync is in flight; its exchange runs while the step
                    # after the sync step computes, so aim at 0.3 to 1.5 step times into the line.
                    def sync_ahead(i=island, step_s=step_s):
                        seen = progress(run_dir, i)
                        return bool(seen and sync_in_flight(seen["step"]) is not None
                                    and time.time() - seen["mtime"] < 0.3 * step_s) and seen

                    seen = wait_until(sync_ahead, "a line with a sync in flight", timeout_s=moment_wait,
                                      deadline=deadline, launch=launch, poll_s=0.002)
                    delay = max(0.0, seen["mtime"] + (0.3 + 1.2 * sub_delay) * step_s - time.time())
                elif kind == "checkpoint":
                    wait_until(lambda since=generation_start: checkpoint_saves(run_dir, since), "an orbax save in progress",
                               timeout_s=moment_wait, deadline=deadline, launch=launch, poll_s=0.002)
                    delay = sub_delay * 0.02
                else:
                    delay = sub_delay * step_s
            except Failed:
                if launch.poll() is not None:
                    raise
                fallback, delay = True, sub_delay * step_s
            time.sleep(delay)
            # The moment, read just before the signal.
            seen = progress(run_dir, island)
            saves, snaps = checkpoint_saves(run_dir, generation_start), snapshot_writes(run_dir, generation_start)
            steps_now = {i: step_of(run_dir, i) for i in range(ISLANDS)}
            if not is_island_process(seen["pid"], run_dir):
                raise Failed(f"kill {k + 1}: island {island}'s pid {seen['pid']} is not a live trainer of this run")
            kill_unix = time.time()
            os.kill(seen["pid"], signal.SIGKILL)
            kill = {"kill": k + 1, "island": island, "kind": kind, "fallback_to_any": fallback,
                    "target_step": target, "step": seen["step"], "island_steps": steps_now,
                    "progress_age_s": round(kill_unix - seen["mtime"], 4),
                    "sync_in_flight": sync_in_flight(seen["step"]) is not None,
                    "in_flight_fragment": sync_in_flight(seen["step"]), "checkpoint_write": bool(saves),
                    "checkpoint_tmp": saves, "snapshot_write": bool(snaps), "snapshot_tmp": snaps,
                    "delay_s": round(delay, 4), "step_s": round(step_s, 4), "kill_unix": kill_unix}
            kills.append(kill)
            what = ", ".join(w for w, on in (("sync in flight", kill["sync_in_flight"]),
                                             ("checkpoint write", kill["checkpoint_write"]),
                                             ("snapshot write", kill["snapshot_write"])) if on) or "inner steps"
            log(f"kill {k + 1}/{mode.kills}: island {island} at step {seen['step']} ({kind}: {what})")

            # The loss is logged once the survivors train again ...
            wait_until(lambda k=k: len(count_events(read_records(run_dir), "island_lost")) > k,
                       f"the loss of island {island} in metrics.jsonl", timeout_s=recovery_s, deadline=deadline,
                       launch=launch, poll_s=0.1)
            kill["kill_to_training_s"] = time.time() - kill_unix
            # ... and the island is back once all three train after the rejoin.

            def rejoined(k=k, kill_unix=kill_unix):
                events = count_events(read_records(run_dir), "island_rejoined")
                if len(events) <= k:
                    return None
                first = events[k]["step"]
                ps = [progress(run_dir, i) for i in range(ISLANDS)]
                return events[k] if all(p and p["step"] >= first and p["mtime"] > kill_unix for p in ps) else None

            event = wait_until(rejoined, f"island {island} to rejoin", timeout_s=recovery_s, deadline=deadline,
                               launch=launch, poll_s=0.1)
            kill["kill_to_rejoined_s"] = time.time() - kill_unix
            generation_start = event["resume_step"]
            log(f"  re-formed in {kill['kill_to_training_s']:.1f} s, island back in {kill['kill_to_rejoined_s']:.1f} s "
                f"(from step {event['resume_step']})")
        code = launch.wait(deadline)
    except Failed as e:
        failure = str(e)
        code = launch.poll()
    finally:
        tails = launch.tails() if failure else None
        launch.stop(run_dir)
    if code is None:
        code = launch.poll()
    return {"exit_code": code, "wall_s": time.time() - launch.started, "kills": kills, "failure": failure,
            "tails": tails, "launcher_lines": launch.launcher_lines(), "run_dir": run_dir,
            "command": display_command(launch.cmd, work)}


def analyse(attack: dict[str, Any], reference: dict[str, Any] | None, mode: Mode) -> dict[str, Any]:
    """Match the kills with the events and decide every acceptance check."""
    done = finish_summary(attack["run_dir"], mode.steps)
    records = done["records"]
    lost_events, rejoin_events = count_events(records, "island_lost"), count_events(records, "island_rejoined")
    finished = attack["exit_code"] == 0 and attack["failure"] is None and done["final_eval_loss"] is not None
    kills = attack["kills"]
    for k, kill in enumerate(kills):
        lost = lost_events[k] if k < len(lost_events) else None
        back = rejoin_events[k] if k < len(rejoin_events) else None
        kill["lost_event"] = lost
        kill["rejoin_event"] = back
        kill["lost_steps"] = lost["lost_steps"] if lost else None
        kill["resume_step"] = lost["resume_step"] if lost else None
        kill["stalled_lost_s"] = lost["stalled_s"] if lost else None
        kill["stalled_rejoin_s"] = back["stalled_s"] if back else None
        kill["stalled_s"] = (lost["stalled_s"] + back["stalled_s"]) if lost and back else None
        # The others trained on with 2 replicas after the loss, and with 3 after the rejoin.
        at = records.index(lost) if lost else None
        until = records.index(back) if back else None
        kill["continued_with_2"] = bool(lost and any(r.get("live_replicas") == 2 and "loss" in r
                                                     for r in records[at:until]))
        kill["continued_with_3"] = bool(back and any(r.get("live_replicas") == 3 and "loss" in r
                                                     for r in records[until:]))
        kill["island_matches"] = bool(lost and back and lost["island"] == back["island"] == kill["island"])
        kill["lost_steps_within_h"] = kill["lost_steps"] is not None and 0 <= kill["lost_steps"] <= H
        # The last kill counts only if the run also finished; an earlier one, once the run went on to the next.
        kill["survived"] = bool(kill["island_matches"] and kill["continued_with_2"] and kill["continued_with_3"]
                                and (finished or k < len(kills) - 1))
    survived = sum(1 for kill in kills if kill["survived"])
    lost_steps = [kill["lost_steps"] for kill in kills if kill["lost_steps"] is not None]
    stall = lambda key: common.mean_sd([kill[key] for kill in kills if kill[key] is not None])
    elastic_loss = done["final_eval_loss"]
    ref_loss = reference["final_eval_loss"] if reference else None
    rel = (elastic_loss - ref_loss) / ref_loss if elastic_loss is not None and ref_loss else None
    checks = {
        f"{mode.kills} kills tried": len(kills) == mode.kills,
        "every kill survived": len(kills) > 0 and survived == len(kills),
        "run finished (exit 0, final evaluation)": finished,
        f"lost steps <= H = {H}": bool(lost_steps) and len(lost_steps) == len(kills) and max(lost_steps) <= H,
        "no unexpected losses": len(lost_events) == len(kills),
        "metrics.jsonl has a line for every step, once": done["all_steps_logged"] and not done["repeated_steps"],
    }
    if mode.reference:  # the smoke run is far too short to compare losses
        checks["final eval loss within 2% of the uninterrupted run"] = rel is not None and abs(rel) <= LOSS_TOLERANCE
    return {
        "kills_tried": len(kills),
        "kills_survived": survived,
        "kills_planned": mode.kills,
        "run_finished": finished,
        "all_steps_logged": done["all_steps_logged"],
        "missing_steps": done["missing_steps"],
        "repeated_steps": done["repeated_steps"],
        "unexpected_losses": max(0, len(lost_events) - len(kills)),
        "moments": {
            "sync_in_flight": sum(kill["sync_in_flight"] for kill in kills),
            "checkpoint_write": sum(kill["checkpoint_write"] for kill in kills),
            "snapshot_write": sum(kill["snapshot_write"] for kill in kills),
            "inner_only": sum(not (kill["sync_in_flight"] or kill["checkpoint_write"] or kill["snapshot_write"])
                              for kill in kills),
        },
        "lost_steps": {"values": lost_steps, "max": max(lost_steps, default=None), "bound": H,
                       "bound_name": "H = --diloco.sync-period", "within_bound": checks[f"lost steps <= H = {H}"]},
        "stalled_s": {"at_loss": stall("stalled_lost_s"), "at_rejoin": stall("stalled_rejoin_s"),
                      "per_kill": stall("stalled_s")},
        "kill_to_training_s": stall("kill_to_training_s"),
        "kill_to_rejoined_s": stall("kill_to_rejoined_s"),
        "eval": {"elastic": elastic_loss, "uninterrupted": ref_loss, "relative_difference": rel,
                 "tolerance": LOSS_TOLERANCE},
        "checks": checks,
        "passed": all(checks.values()),
    }


# -- output ---------------------------------------------------------------------------------


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    ev = s["eval"]
    rel = None if ev["relative_difference"] is None else 100 * ev["relative_difference"]
    moments = s["moments"]
    plural = "" if s["kills_tried"] == 1 else "s"
    lines = [f"# Elastic islands: {s['kills_tried']} kill{plural} of 1 of 3 islands ({result['mode']})", ""]
    lines.append(f"Command: `{result['command']}`; attacked run: `{result['elastic']['command']}`.")
    lines.append("")
    lines.append(f"- **kills survived / tried: {s['kills_survived']} / {s['kills_tried']}** (planned "
                 f"{s['kills_planned']}; the run finished with exit {result['elastic']['exit_code']}; steps without a "
                 f"line in metrics.jsonl: {s['missing_steps'] or 'none'}, logged twice: {s['repeated_steps'] or 'none'})")
    lines.append(f"- kill moments: {moments['sync_in_flight']} with an overlapped sync in flight, "
                 f"{moments['checkpoint_write']} during an orbax checkpoint write, {moments['snapshot_write']} during "
                 f"an island snapshot write, {moments['inner_only']} during inner steps only")
    lines.append(f"- inner steps of work lost per kill: max {fmt(s['lost_steps']['max'], 'd')} (bound H = {H}: "
                 f"{'met' if s['lost_steps']['within_bound'] else 'NOT met'}); values {s['lost_steps']['values']}")
    lines.append(f"- seconds stalled per kill (loss + rejoin, from the events): "
                 f"{common.fmt_pm(s['stalled_s']['per_kill'], '.1f', ' s')} (at the loss "
                 f"{common.fmt_pm(s['stalled_s']['at_loss'], '.1f', ' s')}, at the rejoin "
                 f"{common.fmt_pm(s['stalled_s']['at_rejoin'], '.1f', ' s')}); from the kill until the survivors "
                 f"trained again {common.fmt_pm(s['kill_to_training_s'], '.1f', ' s')}, until all 3 trained again "
                 f"{common.fmt_pm(s['kill_to_rejoined_s'], '.1f', ' s')}")
    if ev["uninterrupted"] is not None:
        lines.append(f"- final eval loss: {fmt(ev['elastic'], '.4f')} attacked vs {ev['uninterrupted']:.4f} "
                     f"uninterrupted: {fmt(rel, '+.2f')}% (acceptance: within {100 * ev['tolerance']:g}%)")
    else:
        lines.append(f"- final eval loss: {fmt(ev['elastic'], '.4f')} attacked (no uninterrupted run to compare)")
    reference = result["reference"]
    lines.append(f"- wall time: attacked run {result['elastic']['wall_s']:.0f} s"
                 + (f", uninterrupted {reference['wall_s']:.0f} s ({reference['step_s']:.2f} s per step)"
                    if reference else " (no uninterrupted run in this mode)"))
    lines.append("")
    lines.append("| # | island | kind | step | sync in flight | checkpoint write | snapshot write | resume step | "
                 "lost steps | stalled at loss (s) | stalled at rejoin (s) | kill to training (s) | survived |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    yes = lambda b: "yes" if b else "no"
    for kill in result["kills"]:
        kind = kill["kind"] + (" (fell back to any)" if kill["fallback_to_any"] else "")
        flight = f"yes (fragment {kill['in_flight_fragment']})" if kill["sync_in_flight"] else "no"
        lines.append(f"| {kill['kill']} | {kill['island']} | {kind} | {kill['step']} | {flight} | "
                     f"{yes(kill['checkpoint_write'])} | {yes(kill['snapshot_write'])} | "
                     f"{fmt(kill.get('resume_step'), 'd')} | {fmt(kill.get('lost_steps'), 'd')} | "
                     f"{fmt(kill.get('stalled_lost_s'), '.1f')} | {fmt(kill.get('stalled_rejoin_s'), '.1f')} | "
                     f"{fmt(kill.get('kill_to_training_s'), '.1f')} | {yes(kill.get('survived'))} |")
    lines += ["", "| check | passed |", "|---|---|"]
    lines += [f"| {name} | {yes(ok)} |" for name, ok in s["checks"].items()]
    lines.append("")
    if result.get("failure"):
        lines += ["**Failure:** " + result["failure"].splitlines()[0], ""]
    m = result["machine"]
    lines.append(f"Stalls include the launcher's `--drain-s {DRAIN_S:g}`, process start-up, `jax.distributed` "
                 f"initialisation and loading compiled programs from the compilation cache. {m['cpu_count']} CPUs "
                 f"(load average at the end {m['load_average_at_end']}), {m['platform']}, Python {m['python']}, "
                 f"JAX {m['jax']}; code revision {result['revision'] or 'unknown'}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill driver's moments (default 0)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="bound in seconds on the whole benchmark (default: smoke 600, quick 1800, full 3600)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/elastic_<mode>; committed results under "
                             "benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="JSON output (default <out-dir>/elastic.json)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None,
                        help="run dirs, logs and the compilation cache (default: a temporary folder, removed after "
                             "a passing run)")
    parser.add_argument("--revision", default=None,
                        help="code revision recorded in the results (default: git rev-parse HEAD of the repo)")
    args = parser.parse_args(argv)
    mode_name = args.mode or "quick"
    mode = MODES[mode_name]
    timeout_s = args.timeout or mode.timeout_s
    out_dir = args.out_dir or REPO / "runs" / "benchmarks" / f"{NAME}_{mode_name}"
    json_path = args.json or out_dir / f"{NAME}.json"
    log = lambda msg: print(msg, flush=True)
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="eqx_diloco_elastic_"))
    for sub in ("reference", "reference_logs", "elastic", "elastic_logs"):
        shutil.rmtree(work / sub, ignore_errors=True)  # a leftover run dir would be resumed
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(work / "jax_cache")
    deadline = time.monotonic() + timeout_s
    started = time.time()
    command = " ".join(["python -m benchmarks.elastic", f"--{mode_name}"]
                       + (["--seed", str(args.seed)] if args.seed else []))
    log(f"{NAME} ({mode_name}): {mode.kills} kill(s) of 1 of {ISLANDS} islands over {mode.steps} steps, bound "
        f"{timeout_s:.0f} s; work dir {work}")
    attack = attacked_run(work, mode, env, deadline, random.Random(args.seed), log)
    failure, reference = attack["failure"], None
    if failure:
        log(f"FAILED: {failure}")
    elif mode.reference:
        try:
            reference = reference_run(work, mode.steps, env, deadline)
            log(f"uninterrupted run: eval loss {reference['final_eval_loss']:.4f} in {reference['wall_s']:.0f} s")
        except Failed as e:
            failure = str(e)
            log(f"FAILED: {failure}")
    summary = analyse(attack, reference, mode)
    if failure:
        summary["checks"]["no failure"] = False
        summary["passed"] = False
    result = {
        "benchmark": NAME,
        "mode": mode_name,
        "command": command,
        "revision": args.revision or common.revision(),
        "seed": args.seed,
        "settings": {"islands": ISLANDS, "steps": mode.steps, "kills": mode.kills, "sync_period": H,
                     "num_fragments": P, "overlap_steps": TAU, "checkpoint_every": CHECKPOINT_EVERY,
                     "rejoin_after_s": REJOIN_AFTER_S, "drain_s": DRAIN_S, "grace_s": GRACE_S,
                     "train_seed": TRAIN_SEED, "timeout_s": timeout_s,
                     "train_flags": train_flags(pathlib.Path("<run-dir>"), mode.steps)},
        "summary": summary,
        "passed": summary["passed"],
        "failure": failure,
        "kills": attack["kills"],
        "elastic": {k: v for k, v in attack.items() if k not in ("kills", "run_dir", "failure")},
        "reference": reference,
        "elapsed_s": time.time() - started,
        "machine": {"cpu_count": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                    "platform": platform.platform(), "python": platform.python_version(), "jax": version("jax")},
    }
    written = [common.write_json(json_path, result), common.write_text(out_dir / f"{NAME}.md", render_markdown(result))]
    print()
    print(render_markdown(result))
    print(f"wrote {', '.join(map(str, written))}")
    if summary["passed"] and args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        log(f"work dir kept: {work}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
