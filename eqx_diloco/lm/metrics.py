"""metrics.jsonl, config.json and the terminal progress display."""

import json
import os
import sys
from pathlib import Path

from .._json import to_jsonable
from ._processes import record_failure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def write_config(run_dir: Path, config) -> None:
    """`<run_dir>/config.json`: the full resolved config."""
    (run_dir / "config.json").write_text(json.dumps(to_jsonable(config), indent=2) + "\n")


def set_aside_earlier_run(run_dir: Path) -> list[Path]:
    """Rename metrics.jsonl and config.json of an earlier run to `<name>.<n>` (first free n).

    For a run that starts from step 0 in a folder that already holds another run's metrics
    (its checkpoints are elsewhere or were deleted): that history is kept, not overwritten.
    Returns the new paths.
    """
    moved = []
    for name in ("metrics.jsonl", "config.json"):
        path = run_dir / name
        if path.exists() and path.stat().st_size > 0:
            n = 1
            while (run_dir / f"{name}.{n}").exists():
                n += 1
            path.rename(run_dir / f"{name}.{n}")
            moved.append(run_dir / f"{name}.{n}")
    return moved


def prepare_run_dir(config, *, fresh: bool, checkpoint_dir: Path, show: bool) -> None:
    """Create `config.run_dir` and write its config.json (process 0 only). A `fresh` start in a
    folder holding another run (its checkpoints elsewhere or deleted) keeps that run's metrics and
    config beside the new ones, and says so if `show` (`checkpoint_dir` is where it looked)."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    kept = set_aside_earlier_run(config.run_dir) if fresh else []
    if kept and show:
        print(f"{config.run_dir} held an earlier run but no checkpoint to resume in {checkpoint_dir}: starting "
              f"from step 0; its files were kept as {', '.join(p.name for p in kept)}", flush=True)
    write_config(config.run_dir, config)


class LogWriteError(RuntimeError):
    """Writing metrics.jsonl or the TensorBoard events failed (a full or read-only disk, a file made
    immutable). Its message is one line naming the file and the reason.

    The trainer then stops at the next step boundary with a checkpoint, as for SIGTERM, and the CLI
    exits 1 with this message, as after a failed checkpoint save."""

    def __init__(self, path: Path, error: OSError):
        reason = error.strerror or str(error) or type(error).__name__
        super().__init__(f"writing {path} failed ({reason})")
        self.path = path
        # This process fails now, whenever it gets to leave: the launcher's failure marker says when.
        record_failure(1, str(self))


class MetricsLog:
    """Appends one JSON object per line to `<run_dir>/metrics.jsonl`.

    **Arguments:**

    - `run_dir`: the run folder (created if missing).
    - `resume_step`: on resume, lines of steps after this one (written by a run that died
      before its next checkpoint) are dropped so the file reads like one uninterrupted run.
    - `enabled`: False on every process but process 0.
    - `append`: keep every line already in the file (a restarted decoupled island: the steps it
      lost stay in its log, as work done).

    A failed write raises `LogWriteError`, once; later records are dropped (the run is stopping).
    """

    def __init__(self, run_dir: Path, *, resume_step: int = 0, enabled: bool = True, append: bool = False):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = None
        if append:
            self._file = self.path.open("a")
            return
        kept = []
        if resume_step > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue  # a line torn by a kill mid-write
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        if not self.enabled or self._file is None:
            return
        line = json.dumps(to_jsonable(record), allow_nan=False) + "\n"
        try:
            if os.fstat(self._file.fileno()).st_nlink == 0:  # deleted under us: start the file again
                self._file.close()
                self._file = self.path.open("a")
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            file, self._file = self._file, None
            try:  # closing flushes what the failed write left in the buffer: it fails the same way
                file.close()
            except OSError:
                pass
            raise LogWriteError(self.path, e) from None

    def close(self) -> None:
        """Close the file (safe to call twice, and after a failed write)."""
        if self.enabled and self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as e:
                raise LogWriteError(self.path, e) from None


class ProgressDisplay:
    """A rich progress bar with loss and tokens/s on a terminal; plain log lines otherwise."""

    def __init__(self, total: int, start: int, *, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(file=sys.stdout)
        self.interactive = enabled and self.console.is_terminal
        self._progress = None
        if self.interactive:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total, completed=start, status="")
            self._progress.start()

    def update(self, step: int, status: str) -> None:
        if self.interactive:
            self._progress.update(self._task, completed=step, status=status)

    def log(self, line: str) -> None:
        if self.interactive:  # above the progress bar
            self.console.print(line, highlight=False)
        elif self.enabled:  # a log file or pipe: the line as it is (rich would parse and wrap it)
            print(line, file=self.console.file, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
