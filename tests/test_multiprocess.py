"""Islands as processes: the same run over 2 or 4 local processes equals the single-process run."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eqx_diloco.lm import Trainer
from eqx_diloco.lm.launch import free_port
from eqx_diloco.lm.launch import main as launch_main
from test_cli import TINY
from util import train_losses

STEPS = 8


def _launch(num_processes, run_dir, *flags, launcher_flags=(), **popen):
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", str(num_processes), *launcher_flags, "--",
           *TINY, "--run-dir", str(run_dir), "--train.log-every", "1",
           # the outer optimizer of tests/conftest.py's configs (not the CLI default)
           "--diloco.outer-lr", "0.7", "--diloco.outer-momentum", "0.9", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


# Two of the four (processes x method) pairs: each pair costs about a minute of compiling. The
# per-step values of the other processes are read at once in one and 2 steps late in the other
# (the run's values and metrics lines must not depend on it). In the 2-process run each process
# holds its two replicas on one device (vmapped), against one device per replica in one process.
@pytest.mark.slow
@pytest.mark.parametrize(("num_processes", "streaming", "metrics_lag", "per_device"),
                         [(2, False, 0, 2), (4, True, 2, 1)], ids=["diloco-2-lag0-k2", "streaming-tau1-4-lag2"])
def test_multi_process_run_equals_single_process_run(make_config, tmp_path, num_processes, streaming, metrics_lag,
                                                     per_device):
    diloco = dict(num_replicas=4, sync_period=6 if streaming else 2)
    flags = ["--diloco.num-replicas", "4", "--diloco.sync-period", str(diloco["sync_period"]),
             "--train.steps", str(STEPS), "--model.num-layers", "2", "--model.dim", "32", "--model.mlp-ratio", "2",
             "--train.lr", "0.01",
             "--dist.metrics-lag", str(metrics_lag), "--mesh.replicas-per-device", str(per_device)]
    if streaming:
        diloco.update(num_fragments=3, overlap_steps=1, alpha=0.5)
        flags += ["--diloco.num-fragments", "3", "--diloco.overlap-steps", "1", "--diloco.alpha", "0.5"]
    single = make_config(diloco=diloco, train=dict(steps=STEPS, lr=0.01, batch_size=4, seq_len=16,
                                                    eval_every=50, warmup_steps=20))
    Trainer(single, verbose=False).run()
    # The 2-process run starts from an empty compilation cache: process 0 compiles each program of both
    # processes, which load its executable (one cache entry each), and the results stay those of one process.
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache)) if num_processes == 2 else None
    proc = _launch(num_processes, tmp_path / "multi", *flags, env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "[Gloo]" not in out + err  # gloo's "Rank r is connected to n peer ranks" lines are filtered out
    # Every sync blocks: gloo's thread waits at idle priority; an overlapped one needs it beside the compute.
    assert (f"{num_processes} processes; gloo's network thread at idle priority" in out) == (not streaming)
    assert streaming == ("gloo's network thread" not in out)
    multi = train_losses(tmp_path / "multi")
    assert len(multi) == STEPS
    np.testing.assert_allclose(multi, train_losses(single.run_dir), rtol=1e-6)
    if env is not None:
        entries = [p.name.split("-")[0] for p in cache.iterdir()]
        assert entries.count("jit_step") == 1 and entries.count("jit_sync_and_merge") == 1, sorted(entries)


@pytest.mark.slow  # two runs of the CLI, one of them as 4 processes
def test_sharded_islands_over_processes_equal_one_process(make_config, tmp_path):
    """Two islands sharded over 2 devices each (--mesh.fsdp 2), each spanning 2 processes of one device
    (its fsdp collectives cross processes), against one process. (An island of 2 devices in one process
    of a multi-process run: the elastic launcher tests.)"""
    flags = ["--diloco.sync-period", "2", "--train.steps", str(STEPS), "--model.num-layers", "2", "--model.dim", "32",
             "--model.mlp-ratio", "2", "--train.lr", "0.01", "--mesh.fsdp", "2"]
    single = make_config(diloco=dict(num_replicas=2, sync_period=2), mesh=dict(fsdp=2),
                         train=dict(steps=STEPS, lr=0.01, batch_size=4, seq_len=16, eval_every=50, warmup_steps=20))
    Trainer(single, verbose=False).run()
    for processes, islands in [(4, "replica 0 on processes 0-1, replica 1 on processes 2-3")]:
        proc = _launch(processes, tmp_path / f"multi{processes}", *flags)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "fsdp=2" in out and islands in out
        multi = train_losses(tmp_path / f"multi{processes}")
        assert len(multi) == STEPS
        np.testing.assert_allclose(multi, train_losses(single.run_dir), rtol=1e-6)


def _children(pid: int) -> dict[int, int]:
    """{JAX process id: os pid} of the launcher's children."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            for var in env:
                if var.startswith(b"JAX_PROCESS_ID="):
                    found[int(var.split(b"=")[1])] = int(entry.name)
    return found


@pytest.mark.slow
def test_killed_process_makes_the_launcher_stop_everything_quickly(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(2, run_dir, "--train.steps", "100000", "--diloco.num-replicas", "2")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    children = _children(proc.pid)
    os.kill(children[1], signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert proc.returncode != 0
    assert "process 1 of 2 was killed by signal 9" in err
    for pid in children.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.slow
def test_a_process_failing_alone_leaves_at_once_and_is_blamed(tmp_path):
    """Only process 1 raises, at step 3 (the trainer's test hook): a failure only it sees. It used to wait in
    JAX's shutdown barrier at interpreter exit, while process 0 waited for its step-3 values in the per-step
    exchange: 2 minutes until that exchange timed out, and then the launcher blamed process 0."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    proc = _launch(2, run_dir, "--train.steps", "100000", "--diloco.num-replicas", "2", "--dist.metrics-lag", "0",
                   launcher_flags=["--log-dir", str(logs)], env=dict(os.environ, EQX_DILOCO_TEST_FAIL_AT_STEP="1:3"))
    try:
        deadline = time.monotonic() + 300  # start-up and compiling, on a loaded machine
        log = logs / "process_1.log"
        while not (log.exists() and "fails at step 3" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        failed_at = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - failed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert took < 30, f"the launch ended {took:.0f} s after process 1 failed"
    assert proc.returncode == 1, err[-3000:]
    assert "error: process 1 of 2 exited with code 1; stopped the other processes" in err, err[-3000:]
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines[-1].startswith("error: process 1 of 2 failed: RuntimeError: ") and "fails at step 3" in lines[-1]
    assert sum(line.startswith("error:") for line in lines) == 1, lines
    assert "[Gloo]" not in out + err + log.read_text()  # its "connected" lines are filtered out, as in every run


@pytest.mark.slow
def test_an_island_failing_alone_is_dropped_and_the_summary_counts_both_generations(tmp_path):
    """Elastic, 2 islands: island 1 alone raises at step 6 (the test hook). It used to hang in JAX's shutdown
    barrier while island 0 waited for it; the launcher then blamed whichever timed out first. Now island 1 is
    the one lost, island 0 goes on from the boundary at step 4, and the launcher sums up both generations."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--log-dir", str(tmp_path / "logs"),
           "--", *TINY, "--run-dir", str(run_dir), "--elastic.enabled", "--train.log-every", "1",
           "--diloco.sync-period", "4", "--train.eval-every", "0", "--train.steps", "12", "--checkpoint.every", "1000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, EQX_DILOCO_TEST_FAIL_AT_STEP="1:6"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = re.search(r"launcher: island 1 exited with code 1 at step (\d+); re-forming with islands \[0\] from the "
                     r"sync boundary at step 4\n", proc.stderr)
    assert lost, proc.stderr[-3000:]
    last = int(lost[1])
    per_step = 4 * 16  # --train.batch-size x --train.seq-len, per island
    trained = (last * 2 + (12 - 4)) * per_step
    redone = (last - 4) * 2 * per_step
    lines = [line.split("launcher: ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("launcher: ")]
    start = next(i for i, line in enumerate(lines) if line.startswith("2 generations in "))
    summary = lines[start:start + 3]
    assert f", {trained:,} tokens trained" in summary[0] and (f"({redone:,} of them in steps redone" in summary[0]
                                                                 if redone else "redone" not in summary[0])
    assert re.fullmatch(rf"  generation 0: islands \[0, 1\], steps 0-{last} in [\d.]+ s, {last * 2 * per_step:,} "
                        r"tokens", summary[1]), summary
    assert re.fullmatch(rf"  generation 1: islands \[0\], steps 4-12 in [\d.]+ s, {8 * per_step:,} tokens",
                        summary[2]), summary
    assert "done: 12 steps (generation 1 of an elastic run" in proc.stdout
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 13))  # each step logged once


@pytest.mark.slow
@pytest.mark.parametrize("process_id", [0, 1], ids=["coordinator", "process-1"])
def test_a_process_without_its_peers_stops_after_the_init_timeout_with_one_line(tmp_path, process_id):
    """`--dist.*` with no peer: process 0 waits for process 1 as the coordinator; process 1 finds no
    coordinator. Either used to wait 120 s and then abort with SIGABRT and a C++ stack."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.train", *TINY, "--run-dir", str(tmp_path / "run"),
                           "--dist.num-processes", "2", "--dist.process-id", str(process_id),
                           "--dist.coordinator-address", address, "--dist.init-timeout-s", "5"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    assert time.monotonic() - started < 60  # start-up and 5 s, not JAX's abort 30 s later
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: process {process_id} of 2"), proc.stderr[-3000:]
    assert address in lines[0] and "within 5 s (--dist.init-timeout-s)" in lines[0]
    assert ("process 1 did not join" if process_id == 0 else "did not answer") in lines[0]


def test_launcher_rejects_bad_input(capsys):
    assert launch_main(["--num-processes", "0", "--", "--train.steps", "1"]) == 2
    assert "--num-processes must be >= 1" in capsys.readouterr().err
    assert launch_main(["--num-processes", "3", "--", "--diloco.num-replicas", "2"]) == 2
    assert ("--num-processes and --diloco.num-replicas must divide one another: every process trains whole replicas, "
            "or every island spans whole processes (got 3 processes for 2 replicas)") in capsys.readouterr().err


def test_bandwidth_without_root_says_so(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert launch_main(["--num-processes", "2", "--bandwidth", "800mbit", "--", "--train.steps", "1"]) == 2
    assert "--bandwidth needs root" in capsys.readouterr().err
