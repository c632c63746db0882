"""One launcher run (`python -m eqx_diloco.launch`) with bounded waits, and the
uninterrupted reference run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from benchmarks._elastic.observe import Failed, is_island_process, progress, read_records, step_time, tail
from benchmarks._elastic.settings import GRACE_S, ISLANDS, REPO, display_command, launch_command


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
