"""The trainer's host loop under faults: NaN under both policies, SIGTERM, a failing checkpoint
save, an explicit --checkpoint.restore-step; and what it says: compilation phase, end summary,
TensorBoard events, the final sync that lets every inner step reach the global model."""

import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eqx_diloco.lm import Trainer
from eqx_diloco._diloco import DiLoCo
from eqx_diloco.lm.train import main
from models import Transformer
from util import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--train.log-every", "1",
        "--diloco.sync-period", "2", "--train.eval-every", "0"]


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit()) if directory.exists() else []


def _strict_json_lines(path: Path) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (a bare NaN or Infinity fails)."""
    def refuse(name):
        raise ValueError(f"bare {name} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# -- what the run says: compilation, summary, TensorBoard ----------------------------------

@pytest.mark.slow  # trains through the CLI
def test_compile_phase_summary_and_tensorboard(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TINY, "--run-dir", str(run), "--train.steps", "4", "--train.eval-every", "2",
                 "--checkpoint.every", "0"]) == 0
    out = capsys.readouterr().out
    assert out.index("compiling the step programs...") < out.index("compiled the step programs in")
    assert out.index("compiled the step programs in") < out.index("step      1")
    assert "done: 4 steps" in out and "final eval loss" in out and "DDP would have sent" in out
    assert str(run / "metrics.jsonl") in out and "python -m eqx_diloco.plot" in out
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("eval_loss")] == [0, 2, 4]  # eval records too
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r}
    assert [e.value for e in acc.Scalars("eval_loss")] == pytest.approx([evals[0], evals[2], evals[4]])


# -- the final sync: every inner step reaches the global model ------------------------------

@pytest.mark.slow
def test_run_shorter_than_h_exports_a_trained_global_model(make_config):
    config = make_config(train={"steps": 3}, diloco={"sync_period": 4})
    trainer = Trainer(config, verbose=False)
    summary = trainer.run()
    assert summary["final_sync_groups"] == [0]  # no scheduled sync in 3 steps with H = 4
    model_key, _ = jax.random.split(jax.random.key(config.train.seed))
    initial = eqx.filter(Transformer(config.model, key=model_key), eqx.is_inexact_array)
    final = trainer.state.global_params
    differ = [not np.array_equal(np.asarray(a), np.asarray(b))
              for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(final))]
    assert len(differ) > 0 and all(differ)
    # The sync's bytes are counted; an aligned run (steps a multiple of H) needs no final sync.
    assert summary["sent_bytes"] == trainer.group_bytes[0]
    # ... and in metrics.jsonl, whose last byte counters are the run's totals.
    last = [r for r in read_metrics(config.run_dir) if "sent_bytes" in r][-1]
    assert last["event"] == "final_sync" and last["sent_bytes"] == summary["sent_bytes"] == last["wire_bytes"]
    aligned = Trainer(dataclasses.replace(config, run_dir=config.run_dir.parent / "aligned",
                                          train=dataclasses.replace(config.train, steps=4)), verbose=False)
    assert aligned.run()["final_sync_groups"] == []


# -- non-finite ---------------------------------------------------------------------------

def _poison(monkeypatch, at_step: int, what: str):
    """Make DiLoCo's outer step at `at_step` leave NaN in `what` ("global_params" or "params")."""
    original = DiLoCo.outer_steps

    def outer_steps(self, state, t):
        state, finite, synced, applied = original(self, state, t)
        if t == at_step:
            nan = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else x,
                               getattr(state, what))
            state = dataclasses.replace(state, **{what: nan})
        return state, finite, synced, applied

    monkeypatch.setattr(DiLoCo, "outer_steps", outer_steps)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ["--train.on-nonfinite", "skip"],
        # Eager anchors are per replica: their finiteness travels with the metrics rows (no collective).
        ["--diloco.outer-overlap", "eager"],
    ],
    ids=["skip", "eager"],
)
def test_the_run_stops_when_the_global_model_goes_non_finite(tmp_path, capsys, monkeypatch, flags):
    _poison(monkeypatch, at_step=4, what="global_params")
    run = tmp_path / "run"
    code = main([*TINY, "--run-dir", str(run), "--train.steps", "12", "--checkpoint.every", "0", *flags])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "the global model is non-finite after the outer step at step 4" in err, err
    assert max(r["step"] for r in _strict_json_lines(run / "metrics.jsonl")) <= 5  # stopped at once


@pytest.mark.slow
def test_skip_stops_when_every_replica_is_skipped_and_metrics_stay_json(tmp_path, capsys, monkeypatch):
    _poison(monkeypatch, at_step=2, what="params")  # every replica NaN from step 3 on
    run = tmp_path / "run"
    code = main([*TINY, "--run-dir", str(run), "--train.steps", "12", "--checkpoint.every", "0",
                 "--train.on-nonfinite", "skip", "--diloco.sync-period", "4"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "non-finite loss in every replica at step 3" in err, err
    records = _strict_json_lines(run / "metrics.jsonl")
    last = records[-1]
    assert last["step"] == 3 and last["loss"] is None and last["replica_losses"] == [None, None]
    assert last["skipped_replicas"] == [0, 1]


@pytest.mark.slow
def test_stop_never_checkpoints_a_diverged_state_and_restore_step_goes_back(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    args = [*TINY, "--run-dir", str(run), "--train.steps", "8", "--checkpoint.every", "2", "--checkpoint.keep", "5"]
    with monkeypatch.context() as patch:
        _poison(patch, at_step=4, what="global_params")  # a checkpoint is due at that very step
        assert main(args) == 1
    err = capsys.readouterr().err
    assert "the global model is non-finite after the outer step at step 4" in err, err
    assert _steps_on_disk(run / "checkpoints") == [2]  # never the NaN state of step 4

    # An explicit step that does not exist: one line, exit 2.
    assert main([*args, "--checkpoint.restore-step", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint of step 3" in err, err

    # Finish the run, then go back to step 2 explicitly: newer checkpoints are moved aside.
    assert main(args) == 0
    assert _steps_on_disk(run / "checkpoints") == [2, 4, 6, 8]
    capsys.readouterr()
    assert main([*args, "--checkpoint.restore-step", "2", "--train.steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "resumed from checkpoint at step 2" in out and "[4, 6, 8] moved aside" in out, out
    assert _steps_on_disk(run / "checkpoints") == [2, 4, 6]
    assert (run / "checkpoints" / "8.superseded").is_dir()
    assert max(r["step"] for r in read_metrics(run)) == 6


# -- subprocess faults: SIGTERM, a checkpoint folder that goes away ------------------------

def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _start(run: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eqx_diloco.train", *TINY, "--run-dir", str(run), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited early with {proc.returncode}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _metrics_started(run: Path):
    return lambda: (run / "metrics.jsonl").exists() and '"loss"' in (run / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_exits_143(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, ["--train.steps", "400", "--checkpoint.every", "1000"])
    try:
        _wait_for(_metrics_started(run), proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM at step "), err
    stop = int(lines[0].split("at step ")[1].split(";")[0])
    assert 1 <= stop < 400
    assert _steps_on_disk(run / "checkpoints") == [stop]  # saved at the stop step (every 1000: no other)
    assert max(r["step"] for r in read_metrics(run)) == stop
    resumed = subprocess.run([sys.executable, "-m", "eqx_diloco.train", *TINY, "--run-dir", str(run),
                              "--train.steps", str(stop + 2), "--checkpoint.every", "1000"],
                             capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from checkpoint at step {stop}" in resumed.stdout


@pytest.mark.slow
def test_failing_checkpoint_save_exits_promptly_with_one_line(tmp_path):
    """The checkpoint folder is replaced by a regular file after the first save, so the next
    save cannot create its folder (what a folder turned read-only or removed does; chmod would
    not stop root, which runs these tests in CI containers). Orbax reports the failure at the
    next wait; the process must exit 1 with one line, not hang on orbax's threads."""
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    proc = _start(run, ["--train.steps", "400", "--checkpoint.every", "3"])
    try:
        _wait_for(lambda: _steps_on_disk(checkpoints) == [3], proc)
        shutil.move(checkpoints, tmp_path / "moved")
        checkpoints.write_text("not a folder")
        _, err = proc.communicate(timeout=120)  # bounded: a hang fails here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: saving checkpoint 6 in ") and "failed" in lines[0], err


@pytest.mark.slow
def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path):
    """Only process 1 of 2 gets SIGTERM (JAX's preemption notifier would otherwise take it):
    the stop request travels with the per-step metrics exchange, so both processes stop at one
    step and the checkpoint of that step is complete."""
    from test_multiprocess import _children

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--", *TINY, "--run-dir", str(run),
           "--train.steps", "100000", "--checkpoint.every", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)
    try:
        _wait_for(_metrics_started(run), proc)
        os.kill(_children(proc.pid)[1], signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    logs = Path(err.split("logs are in ")[1].split()[0])
    lines = [(logs / f"process_{i}.log").read_text().splitlines()[-1] for i in range(2)]
    shutil.rmtree(logs)
    assert lines[0] == lines[1] and lines[0].startswith("stopped by SIGTERM at step "), lines  # one step for both
    stop = int(lines[0].split("at step ")[1].split(";")[0])
    assert _steps_on_disk(run / "checkpoints") == [stop]
    # The launcher reports the clean stop of process 0 as a failure (exit 1) when it did not get the
    # signal itself; when it does (the usual case) it exits 128 + signal.
    assert proc.returncode != 0


def test_unraisablehook_drops_only_closed_event_loop_noise():
    """The hook train.py installs for TensorStore's late callbacks after a failed save."""
    from types import SimpleNamespace

    from eqx_diloco.lm.train import _quiet_closed_event_loops

    seen = []
    hook = _quiet_closed_event_loops(lambda args: seen.append(args.exc_value))
    hook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))
    assert seen == []
    other = RuntimeError("something else")
    hook(SimpleNamespace(exc_value=other))
    hook(SimpleNamespace(exc_value=ValueError("Event loop is closed")))
    assert seen[0] is other and isinstance(seen[1], ValueError)


def test_unretrieved_task_errors_of_a_failed_save_are_not_logged():
    """The filter train.py puts on the "asyncio" logger: the failed save's write tasks that
    nobody awaited are not reported again (they raced the one-line error under load); other
    asyncio errors still are."""
    from eqx_diloco.lm.train import _drop_unretrieved_task_errors

    def record(message):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    assert not _drop_unretrieved_task_errors(record("Task exception was never retrieved\nfuture: <Task finished>"))
    assert not _drop_unretrieved_task_errors(record("Future exception was never retrieved"))
    assert _drop_unretrieved_task_errors(record("Unclosed client session"))


@pytest.mark.slow
def test_rerun_with_checkpoints_elsewhere_keeps_the_first_runs_metrics(tmp_path, capsys):
    """Another --checkpoint.dir finds no checkpoint: the run starts at 0 without overwriting
    the earlier run's metrics.jsonl and config.json."""
    run = tmp_path / "run"
    base = [*TINY, "--run-dir", str(run), "--train.steps", "3", "--checkpoint.every", "0"]
    assert main([*base, "--checkpoint.dir", str(tmp_path / "a")]) == 0
    first = (run / "metrics.jsonl").read_text()
    assert main([*base, "--checkpoint.dir", str(tmp_path / "b"), "--train.seed", "1"]) == 0
    assert "held an earlier run but no checkpoint to resume" in capsys.readouterr().out
    assert (run / "metrics.jsonl.1").read_text() == first
    assert json.loads((run / "config.json.1").read_text())["checkpoint"]["dir"] == str(tmp_path / "a")
    assert json.loads((run / "config.json").read_text())["train"]["seed"] == 1
    assert max(r["step"] for r in read_metrics(run)) == 3


def _can_mount_tmpfs() -> bool:
    try:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs a private mount namespace to make a small tmpfs")
def test_disk_full_exits_promptly_with_one_line(tmp_path):
    """The checkpoint folder is a 2.6 MB tmpfs (in a private mount namespace): two checkpoints
    of this model (1.1 MB each) fit, the third does not (ENOSPC); --checkpoint.keep 3 deletes none."""
    run, checkpoints = tmp_path / "run", tmp_path / "checkpoints"
    checkpoints.mkdir()
    train = [sys.executable, "-m", "eqx_diloco.train", *TINY, "--run-dir", str(run), "--train.steps", "400",
             "--checkpoint.every", "2", "--checkpoint.keep", "3", "--checkpoint.dir", str(checkpoints)]
    script = f"mount -t tmpfs -o size=2600k tmpfs {checkpoints} && exec {' '.join(train)}"
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: saving checkpoint ") and "failed" in lines[0], proc.stderr
    step = int(lines[0].split("checkpoint ")[1].split()[0])
    assert 4 <= step <= 8  # promptly: the first save that did not fit, or the next
    assert max(r["step"] for r in read_metrics(run)) <= step + 2


# -- a failed metrics.jsonl or TensorBoard write ------------------------------------------------

class _FullDisk:
    """A log's file object that fails as a full disk does once `lines` writes went through."""

    def __init__(self, file, lines: int):
        self.file, self.left = file, lines

    def fileno(self):
        return self.file.fileno()

    def write(self, data):
        if self.left == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= 1
        return self.file.write(data)

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()


@pytest.mark.slow
@pytest.mark.parametrize("log", ["metrics", "tensorboard"])
def test_a_failed_log_write_stops_with_one_line_after_a_checkpoint(tmp_path, capsys, monkeypatch, log):
    """The 6th record cannot be written (ENOSPC). That used to end the run with a 36-71 line traceback and no
    checkpoint: now every process stops at the next step boundary with a checkpoint (as for SIGTERM) and the
    CLI says which file failed, in one line, and exits 1."""
    from eqx_diloco.lm._tensorboard import TensorBoardLog
    from eqx_diloco.lm.metrics import MetricsLog

    cls = MetricsLog if log == "metrics" else TensorBoardLog
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.enabled:  # TensorBoard's file already holds its header event
            self._file = _FullDisk(self._file, lines=5)

    monkeypatch.setattr(cls, "__init__", init)
    run = tmp_path / "run"
    assert main([*TINY, "--run-dir", str(run), "--train.steps", "40", "--checkpoint.every", "100"]) == 1
    err = capsys.readouterr().err
    name = "metrics.jsonl" if log == "metrics" else "events.out.tfevents."
    assert err.count("\n") == 1 and err.startswith(f"error: writing {run / name}"), err
    assert "failed (No space left on device); stopped at step " in err
    assert f"(checkpoint saved in {run / 'checkpoints'}); run the same command to resume" in err
    stop = int(err.split("stopped at step ")[1].split()[0])
    assert 6 <= stop <= 9  # the next step boundary or so after the failure at step 6
    assert _steps_on_disk(run / "checkpoints") == [stop]  # --checkpoint.every 100: the stop's own
    if log == "metrics":
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]
    else:
        assert max(r["step"] for r in read_metrics(run)) >= 6  # metrics.jsonl went on until the stop
