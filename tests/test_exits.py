"""Every process ends: after a failed metrics.jsonl or TensorBoard write (alone and under the
launcher) the CLI prints one line and exits 1 in bounded time, and the exit sequence of `entry()`
neither waits for ever on an idle thread-pool worker nor on a stuck thread."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--train.log-every", "1",
        "--diloco.sync-period", "2", "--train.eval-every", "0"]


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
                **extra)


def _leave_through_join_threads(body: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run `body`, then the CLI's exit-time join of threads (which imports no JAX), then exit 0."""
    script = textwrap.dedent(body) + textwrap.dedent(f"""
        import os
        from eqx_diloco.lm.train import _join_threads
        _join_threads(0, timeout_s={timeout_s})
        print("joined", flush=True)
        os._exit(0)
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=60)


@pytest.mark.slow  # starts a process (no JAX: about a second)
def test_exit_does_not_wait_for_an_idle_pool_worker():
    """orbax's metadata store keeps a one-worker pool whose idle worker stops only at interpreter
    exit: joining it before that hung every run that failed after a save (D3, D1b, D1c)."""
    proc = _leave_through_join_threads("""
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metadata_store")
        pool.submit(int).result()  # the worker now idles on the pool's queue
    """, timeout_s=30)
    assert proc.returncode == 0 and proc.stdout == "joined\n" and proc.stderr == "", proc


@pytest.mark.slow  # starts a process (no JAX: about two seconds)
def test_exit_leaves_a_stuck_thread_behind_with_one_line():
    proc = _leave_through_join_threads("""
        import threading, time
        threading.Thread(target=time.sleep, args=(600,), name="stuck-writer").start()
    """, timeout_s=1)
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr == ("error: leaving after 1 s without waiting for thread(s) still running: "
                           "stuck-writer\n"), proc.stderr


@pytest.mark.slow  # trains through the CLI
@pytest.mark.parametrize("log", ["metrics", "tensorboard"])
def test_a_failed_log_write_ends_the_process(tmp_path, log):
    """D3 / D3tb / D1b: the line was right, but the process never exited."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "full_disk_child", *TINY, "--run-dir", str(run),
                           "--train.steps", "40", "--checkpoint.every", "100"],
                          capture_output=True, text=True, env=_env(FULL_DISK_LOG=log, FULL_DISK_AFTER="5"),
                          cwd=tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    name = "metrics.jsonl" if log == "metrics" else "events.out.tfevents."
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: writing {run / name}"), proc.stderr
    assert "failed (No space left on device); stopped at step " in proc.stderr


@pytest.mark.slow  # two trainer processes through the launcher
def test_a_failed_log_write_ends_a_two_process_launch(tmp_path):
    """D1c: process 0's metrics.jsonl fills up; both processes stop at one step and the launcher returns."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--module",
                           "full_disk_child", "--", *TINY, "--run-dir", str(run), "--train.steps", "40",
                           "--checkpoint.every", "100"],
                          capture_output=True, text=True, env=_env(FULL_DISK_LOG="metrics", FULL_DISK_AFTER="5"),
                          cwd=tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # Stopped at a step boundary, or finished first (the records reach process 0 with a lag): either way one line.
    assert f"error: writing {run / 'metrics.jsonl'} failed (No space left on device); " in proc.stderr, proc.stderr
    assert "error: process 0 of 2 exited with code 1; stopped the other processes" in proc.stderr
