"""Where a run's time goes, from the moment its process started: one timestamp per phase.

The trainer marks the end of each phase (`mark`); at exit each process writes its marks to
`RUN_DIR/phases/process-K.json`, seconds since the process started (read from `/proc`, so
the interpreter's start and the imports before `main` are counted). `benchmarks/startup.py`
turns them into the start-up breakdown. Nothing here imports JAX.
"""

import json
import os
import time
from pathlib import Path


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start time in clock ticks since boot), or None."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Phases:
    """Named marks, in seconds since the process started (or since this object, where `/proc` is missing)."""

    def __init__(self):
        age = _process_age_s()
        self.since_process_start = age is not None
        self._origin = time.perf_counter() - (age or 0.0)
        self.started_unix = time.time() - (age or 0.0)  # the same origin on the wall clock, for other programs
        self.marks: list[tuple[str, float]] = []

    def clear(self) -> None:
        """Forget the marks (a run started in a process that ran another before: tests, benchmarks)."""
        self.marks.clear()

    def mark(self, phase: str) -> None:
        """Record that `phase` ended now (a phase marked twice keeps its first end)."""
        if all(name != phase for name, _ in self.marks):
            self.marks.append((phase, round(time.perf_counter() - self._origin, 4)))

    def write(self, run_dir: Path, process: int) -> None:
        """`run_dir/phases/process-<process>.json`; never fails the run (a run folder gone is not its business)."""
        try:
            folder = Path(run_dir) / "phases"
            folder.mkdir(parents=True, exist_ok=True)
            record = {"since_process_start": self.since_process_start, "started_unix": round(self.started_unix, 4),
                      "marks": [{"phase": name, "s": s} for name, s in self.marks]}
            (folder / f"process-{process}.json").write_text(json.dumps(record, indent=1) + "\n")
        except OSError:
            pass


PHASES = Phases()  # this process's clock: created when the trainer's modules are first imported
mark = PHASES.mark
