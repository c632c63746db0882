"""A stand-in for the trainer under `python -m eqx_diloco.launch --module launch_child`.

Each process writes its pid to `$LAUNCH_CHILD_DIR/pid_<JAX_PROCESS_ID>` and then behaves as
`$LAUNCH_CHILD_MODES` says for its process id (comma-separated, one mode per process; under the
elastic launcher, one per island, and the pid file is named by the island):

- `sleep`: sleep (default signal handling: SIGTERM/SIGHUP end it);
- `ignore`: ignore SIGTERM and SIGHUP and sleep (only SIGKILL ends it);
- `freeze`: stop itself with SIGSTOP;
- `ok`: exit 0 at once;
- `fail`: exit 3 a moment after every process has written its pid file;
- `gave-up-on-1`: after a moment, print what JAX prints when task 1 stops sending heartbeats, exit 1.
"""

import os
import signal
import sys
import time
from pathlib import Path

pid_dir = Path(os.environ["LAUNCH_CHILD_DIR"])
index = int(os.environ["JAX_PROCESS_ID"])
if os.environ.get("EQX_DILOCO_ISLANDS"):
    index = int(os.environ["EQX_DILOCO_ISLANDS"].split(",")[index])
mode = os.environ["LAUNCH_CHILD_MODES"].split(",")[index]
(pid_dir / f"pid_{index}.tmp").write_text(str(os.getpid()))
(pid_dir / f"pid_{index}.tmp").rename(pid_dir / f"pid_{index}")

if mode == "ok":
    sys.exit(0)
if mode == "fail":
    # Fail only once every process has written its pid file: a test reads them all before the launcher
    # stops the others (it stops them as soon as this one exits).
    deadline = time.monotonic() + 60
    modes = os.environ["LAUNCH_CHILD_MODES"].split(",")
    while not all((pid_dir / f"pid_{i}").exists() for i in range(len(modes))) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    sys.exit(3)
if mode == "gave-up-on-1":
    time.sleep(1.0)
    print("E1203 coordination_service.cc:1549] UNAVAILABLE: The following tasks are unhealthy (stopped sending "
          "heartbeats):\n1\nThe tasks have crashed.", file=sys.stderr, flush=True)
    sys.exit(1)
if mode == "freeze":
    os.kill(os.getpid(), signal.SIGSTOP)
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
time.sleep(600)
