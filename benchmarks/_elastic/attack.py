"""The attacked run: the seeded kill plan, and the driver that SIGKILLs one island at
each planned moment and waits for the run to re-form and the island to rejoin."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import time
from collections.abc import Callable
from typing import Any

from benchmarks._elastic.launcher import Launch, wait_until
from benchmarks._elastic.observe import (
    Failed,
    checkpoint_saves,
    count_events,
    is_island_process,
    progress,
    read_records,
    snapshot_writes,
    step_of,
    step_time,
    sync_in_flight,
)
from benchmarks._elastic.settings import CHECKPOINT_EVERY, ISLANDS, KINDS, H, Mode, display_command, launch_command


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
