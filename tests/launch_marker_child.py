"""A stand-in trainer for the launcher's failure-marker tests (`--module launch_marker_child`).

Each process (under the elastic launcher: each island) acts as `$MARKER_CHILD_PLAN` says for its
index (`;`-separated, one `mark,exit,error` per process):

- `mark`: the failure time it records, in seconds after `$MARKER_CHILD_T0` (a wall-clock time the
  test sets), written at once to `$EQX_DILOCO_FAILURE_FILE` as the trainer's `record_failure`
  does; `-` writes no marker;
- `exit`: seconds after `$MARKER_CHILD_T0` at which it exits with code 1 (it sleeps until then);
- `error`: the one-line error of its marker.

The recorded time is given, not measured, so the test controls the order of failure apart from
the order of exit, whatever the load on the machine.
"""

import json
import os
import sys
import time

index = int(os.environ["JAX_PROCESS_ID"])
if os.environ.get("EQX_DILOCO_ISLANDS"):
    index = int(os.environ["EQX_DILOCO_ISLANDS"].split(",")[index])
mark, exit_at, error = os.environ["MARKER_CHILD_PLAN"].split(";")[index].split(",")
t0 = float(os.environ["MARKER_CHILD_T0"])
if mark != "-":
    path = os.environ["EQX_DILOCO_FAILURE_FILE"]
    with open(f"{path}.tmp", "w") as f:
        json.dump({"time": t0 + float(mark), "code": 1, "error": error}, f)
    os.replace(f"{path}.tmp", path)
time.sleep(max(0.0, t0 + float(exit_at) - time.time()))
print(f"error: {error}", file=sys.stderr, flush=True)
sys.exit(1)
