"""What the kill driver sees of a running or finished run from outside: metrics.jsonl,
each island's progress.json and pid, checkpoint and snapshot writes in progress."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks._elastic.settings import ISLANDS, ORBAX_TMP, TAU, H, P
from eqx_diloco.schedule import synced_fragment


class Failed(Exception):
    """The benchmark cannot go on (a wait timed out, the run ended early); the message says why."""


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """The JSON lines of a log another process is writing: [] before it exists, a torn last line skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return records


def read_records(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


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
