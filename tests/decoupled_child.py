"""A stand-in for the trainer under `python -m eqx_diloco.launch --decoupled --module decoupled_child`.

It reads its role from the flags the launcher adds (`--decoupled.role`, `--decoupled.island`,
`--dist.process-id`, `--dist.coordinator-address`) and appends one JSON line per start to
`$DECOUPLED_CHILD_DIR/starts.jsonl` (role, island, process, pid, coordinator, the CPUs it may use). Then:

- the syncer sleeps until it is stopped (SIGTERM), then exits 0 as the real syncer does;
- a spare (`--decoupled.standby`) reads its assignment, `{"island": K, "cpus": [...]}`, from its standard
  input, keeps to those CPUs, appends `{"took": K, "pid": ..., "cpus": ...}` and goes on as island K;
- an island process listed in `$DECOUPLED_CHILD_FAIL` as `K:P` (island K, process P) exits 1 after a
  moment at its first start; every other island process, and every restart, sleeps
  `$DECOUPLED_CHILD_SECONDS`, appends `{"finished": pid}` and exits 0.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def flag(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


folder = Path(os.environ["DECOUPLED_CHILD_DIR"])
role, island, process = flag("--decoupled.role"), flag("--decoupled.island"), flag("--dist.process-id") or "0"
record = {"role": role, "island": island, "process": int(process), "pid": os.getpid(),
          "coordinator": flag("--dist.coordinator-address"), "processes": flag("--dist.num-processes"),
          "cpus": sorted(os.sched_getaffinity(0))}
with (folder / "starts.jsonl").open("a") as log:
    log.write(json.dumps(record) + "\n")
if "--decoupled.standby" in sys.argv:
    message = json.loads(sys.stdin.readline())
    island = str(message["island"])
    if message["cpus"]:
        os.sched_setaffinity(0, message["cpus"])
    with (folder / "starts.jsonl").open("a") as log:
        log.write(json.dumps({"took": island, "process": int(process), "pid": os.getpid(),
                              "cpus": sorted(os.sched_getaffinity(0))}) + "\n")
if role == "syncer":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(600)
    sys.exit(0)
me = f"{island}:{process}"
marker = folder / f"failed-{island}-{process}"
if me in os.environ.get("DECOUPLED_CHILD_FAIL", "").split(",") and not marker.exists():
    marker.write_text("")
    time.sleep(0.5)
    sys.exit(1)
time.sleep(float(os.environ.get("DECOUPLED_CHILD_SECONDS", "2")))
with (folder / "starts.jsonl").open("a") as log:
    log.write(json.dumps({"finished": os.getpid()}) + "\n")
