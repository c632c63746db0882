"""Checkpoints: resume after SIGKILL == uninterrupted, corruption, incompatible configs, non-finite guard."""

import dataclasses
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco.lm import Trainer
from eqx_diloco._checkpoint import Checkpointer
from eqx_diloco.lm.resume import incompatibility
from eqx_diloco.lm.metrics import to_jsonable
from eqx_diloco.lm.train import main
from util import read_metrics, train_losses

TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--train.log-every", "1"]
ROOT = Path(__file__).resolve().parents[1]

# Restoring a corrupt checkpoint makes orbax abandon its other pending reads: their coroutines
# (and the closed event loop they were meant for) report "Exception ignored in ..." tracebacks
# when garbage-collected. That is expected here, so collect them at the end of each test (not at
# interpreter exit, where they would be printed) and keep them out of the warnings summary.
pytestmark = [
    pytest.mark.filterwarnings(
        r"ignore:(?s)Exception ignored in.*(_read_array_index_and_device_put|Event loop is closed)"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
    # Every test here runs the CLI trainer (or its processes); the fast tier's checkpoint tests go
    # through the core (test_custom_model.py, test_lifecycle.py).
    pytest.mark.slow,
]


@pytest.fixture(autouse=True)
def _collect_abandoned_reads():
    yield
    gc.collect()

# -- SIGKILL, then resume: metrics identical to an uninterrupted run ------------------------

KILL_VARIANTS = {
    # H = 6 with a checkpoint every 4 steps: checkpoints land mid-round, replicas differ from
    # theta_g; dropout makes the per-replica PRNG keys matter.
    "diloco": ["--diloco.sync-period", "6", "--model.dropout", "0.1"],
    # H = 6, P = 3: fragments sync at every even step and merge one step later, so the
    # checkpoints at 4, 8, ... are taken while a fragment is in flight; int8 with error
    # feedback adds quantization residuals to the state.
    "streaming": ["--diloco.num-fragments", "3", "--diloco.sync-period", "6", "--diloco.overlap-steps", "1",
                  "--diloco.quantize", "int8", "--diloco.error-feedback"],
}
STEPS = 24


def _env(cache: Path) -> dict:
    """Environment for training subprocesses: a persistent compilation cache, so that only the
    first run of each program compiles (the compiled program is then reused bit for bit)."""
    env = dict(os.environ)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    return env


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted reference runs of every variant, started together in the background
    (they compile in parallel); each test waits for its own. Yields {variant: (dir, env, proc)}."""
    runs = {}
    for variant, extra in KILL_VARIANTS.items():
        base = tmp_path_factory.mktemp(f"reference_{variant}")
        env = _env(base / "jax_cache")
        log = (base / "log.txt").open("w")
        proc = subprocess.Popen(_train_cmd(base / "run", extra), stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT)
        runs[variant] = (base, env, proc, log)
    yield runs
    for _, _, proc, log in runs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def _train_cmd(run_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "eqx_diloco.train", *TINY, *extra, "--run-dir", str(run_dir),
            "--checkpoint.every", "4", "--train.steps", str(STEPS)]


def _run(cmd, env) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _complete_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit()) if directory.exists() else []


def _run_and_kill(cmd, env, checkpoints: Path, log: Path) -> list[int]:
    """Start `cmd`, SIGKILL it as soon as a complete checkpoint exists; return the steps on disk then."""
    killed = False
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                if _complete_steps(checkpoints):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.001)
        finally:
            if proc.poll() is None and not killed:
                proc.kill()
            proc.wait()
    assert killed and proc.returncode == -signal.SIGKILL, f"run ended on its own:\n{log.read_text()[-3000:]}"
    return _complete_steps(checkpoints)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(KILL_VARIANTS))
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, references, variant):
    extra = KILL_VARIANTS[variant]
    base, env, proc, _ = references[variant]
    assert proc.wait(timeout=600) == 0, (base / "log.txt").read_text()[-3000:]
    reference, victim = base / "run", tmp_path / "victim"
    on_disk = _run_and_kill(_train_cmd(victim, extra), env, victim / "checkpoints", tmp_path / "kill.log")
    assert on_disk and max(on_disk) < STEPS, on_disk
    resumed = _run(_train_cmd(victim, extra), env)
    match = re.search(r"resumed from checkpoint at step (\d+)", resumed.stdout)
    assert match and 4 <= int(match.group(1)) < STEPS, resumed.stdout
    assert int(match.group(1)) >= max(on_disk)  # the newest complete checkpoint is used

    ref_lines, got_lines = read_metrics(reference), read_metrics(victim)
    assert [r["step"] for r in got_lines] == [r["step"] for r in ref_lines]
    assert train_losses(victim) == train_losses(reference)  # exact
    assert [r["replica_losses"] for r in got_lines if "loss" in r] == [r["replica_losses"] for r in ref_lines
                                                                     if "loss" in r]
    assert [r["eval_loss"] for r in got_lines if "eval_loss" in r] == [r["eval_loss"] for r in ref_lines
                                                                     if "eval_loss" in r]
    assert [r["sent_bytes"] for r in got_lines if "loss" in r] == [r["sent_bytes"] for r in ref_lines if "loss" in r]


# -- in-process runs sharing one trained run folder -----------------------------------------

RUN_ARGS = [*TINY, "--diloco.sync-period", "4", "--checkpoint.every", "4", "--train.steps", "8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder with checkpoints at steps 4 and 8 (do not modify: copy it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main([*RUN_ARGS, "--run-dir", str(run)]) == 0
    assert _complete_steps(run / "checkpoints") == [4, 8]
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def _corrupt(step_dir: Path, mode: str) -> None:
    data = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(data, key=lambda p: p.stat().st_size)
    blob = bytearray(biggest.read_bytes())
    if mode == "truncate":
        biggest.write_bytes(bytes(blob[: len(blob) // 2]))
    elif mode == "delete":
        biggest.unlink()
    elif mode == "flip":  # same size, one bit off: only the checksums can tell
        blob[len(blob) // 2] ^= 0x10
        biggest.write_bytes(bytes(blob))
    elif mode == "metadata":
        (step_dir / "meta" / "metadata").write_text("{truncated")
    else:
        raise ValueError(mode)


def _checkpointer(run: Path) -> tuple[Checkpointer, Trainer]:
    from eqx_diloco.lm.config import Config
    import tyro

    config = tyro.cli(Config, args=[*RUN_ARGS, "--run-dir", str(run)])
    trainer = Trainer(config, verbose=False)
    return trainer.checkpointer, trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["truncate", "delete", "flip", "metadata"])
def test_corrupt_latest_checkpoint_falls_back_to_previous(trained, tmp_path, capsys, mode):
    run = _copy(trained, tmp_path)
    _corrupt(run / "checkpoints" / "8", mode)
    checkpointer, trainer = _checkpointer(run)
    state, step = checkpointer.restore_latest(trainer.abstract_state, trainer.shardings, trainer.resume_check)
    err = capsys.readouterr().err
    assert step == 4
    assert "checkpoint 8" in err and "corrupt" in err and "resuming from checkpoint 4" in err, err
    assert _complete_steps(run / "checkpoints") == [4] and (run / "checkpoints" / "8.corrupt").is_dir()
    # Every array is back on its sharding, and equals the untouched step-4 checkpoint.
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.shardings)):
        assert x.sharding == s
    expected, _ = Checkpointer(trained / "checkpoints", every=0, keep=1, read_only=True).restore_latest(
        trainer.abstract_state, trainer.shardings, trainer.resume_check, step=4)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    checkpointer.close()


def test_resume_after_corrupt_latest_with_harmless_changes(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    _corrupt(run / "checkpoints" / "8", "truncate")
    harmless = ["--train.log-every", "2", "--train.eval-every", "2", "--checkpoint.keep", "1"]
    assert main([*RUN_ARGS, "--run-dir", str(run), *harmless]) == 0
    captured = capsys.readouterr()
    assert "checkpoint 8" in captured.err and "corrupt" in captured.err
    assert "resumed from checkpoint at step 4" in captured.out
    assert _complete_steps(run / "checkpoints") == [8]  # step 8 written again; keep 1
    losses = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    expected = {r["step"]: r["loss"] for r in read_metrics(trained) if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 6, 8]  # logged every step before, every 2nd step after
    assert all(losses[t] == expected[t] for t in losses)
    assert [r["step"] for r in read_metrics(run) if "eval_loss" in r] == [0, 6, 8]


def test_finished_run_says_so_and_exits_0(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    before = (run / "metrics.jsonl").read_text()
    for extra in ([], ["--train.steps", "4"], ["--train.log-every", "3"]):
        assert main([*RUN_ARGS, "--run-dir", str(run), *extra]) == 0
        assert "already finished at step 8" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == before


def test_all_checkpoints_corrupt_is_a_clear_error(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    for step in (4, 8):
        _corrupt(run / "checkpoints" / str(step), "metadata")
    assert main([*RUN_ARGS, "--run-dir", str(run)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: none of the 2 checkpoints in") and "move that folder away" in last, last
    assert (run / "metrics.jsonl").read_text() == (trained / "metrics.jsonl").read_text()  # untouched


def test_partial_save_folder_is_ignored_and_cleaned_up(trained, tmp_path):
    run = _copy(trained, tmp_path)
    partial = run / "checkpoints" / "12.orbax-checkpoint-tmp-1700000000000"
    shutil.copytree(run / "checkpoints" / "8", partial)  # looks complete inside, but was never renamed
    checkpointer, trainer = _checkpointer(run)
    _, step = checkpointer.restore_latest(trainer.abstract_state, trainer.shardings, trainer.resume_check)
    assert step == 8
    assert not partial.exists()
    checkpointer.close()


INCOMPATIBLE = [
    (["--model.dim", "64"], "--model.dim 32 -> 64"),
    (["--model.num-layers", "4"], "--model.num-layers 2 -> 4"),
    (["--diloco.num-replicas", "4"], "--diloco.num-replicas 2 -> 4"),
    (["--diloco.num-fragments", "2"], "--diloco.num-fragments 1 -> 2"),
    (["--algorithm", "ddp"], "--algorithm diloco -> ddp"),
    (["--diloco.outer-momentum", "0"], "--diloco.outer-momentum 0.3 -> 0.0"),  # drops the momentum buffer
]


@pytest.mark.parametrize("args,message", INCOMPATIBLE, ids=[" ".join(a) for a, _ in INCOMPATIBLE])
def test_incompatible_config_is_one_line_error_naming_the_flag(trained, capsys, args, message):
    assert main([*RUN_ARGS, "--run-dir", str(trained), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoint is incompatible"), err
    assert message in err, err


def test_schedule_change_while_a_fragment_is_in_flight_is_refused(make_config):
    saved = make_config(model=dict(num_layers=2),
                        diloco=dict(num_fragments=3, sync_period=6, overlap_steps=1))
    shorter = dataclasses.replace(saved, diloco=dataclasses.replace(saved.diloco, sync_period=12))
    # Fragment 1 synced after step 4 and merges after step 5: step 4 is mid-flight.
    problem = incompatibility(to_jsonable(saved), shorter, step=4)
    assert problem is not None and "--diloco.sync-period 6 -> 12" in problem and "in flight" in problem
    assert incompatibility(to_jsonable(saved), shorter, step=5) is None  # merged: nothing in flight
    no_overlap = dataclasses.replace(saved, diloco=dataclasses.replace(saved.diloco, overlap_steps=0))
    assert "--diloco.overlap-steps 1 -> 0" in incompatibility(to_jsonable(saved), no_overlap, step=4)
    steps = dataclasses.replace(saved, train=dataclasses.replace(saved.train, steps=100, log_every=7, lr=1e-3))
    assert incompatibility(to_jsonable(saved), steps, step=4) is None


# -- non-finite guard -----------------------------------------------------------------------


def _poison_replica(trainer: Trainer, replica: int, before_step: int) -> None:
    """Make `replica`'s params NaN right before inner step `before_step` runs (1-based)."""
    real = trainer.core.inner_step  # what `DiLoCo.step` calls
    poison = jax.jit(lambda s: dataclasses.replace(
        s, params=jax.tree.map(lambda x: x.at[replica].set(jnp.nan), s.params)))
    calls = []

    def inner_step(state, tokens):
        calls.append(None)
        if len(calls) == before_step:
            state = poison(state)
        return real(state, tokens)

    trainer.core.inner_step = inner_step


@pytest.mark.slow
def test_nonfinite_skip_drops_that_replica_until_the_sync_heals_it(make_config):
    config = make_config(diloco=dict(num_replicas=2, sync_period=4), train=dict(steps=6, on_nonfinite="skip"))
    trainer = Trainer(config, verbose=False)
    _poison_replica(trainer, replica=1, before_step=2)
    trainer.run()
    lines = {r["step"]: r for r in read_metrics(config.run_dir) if "loss" in r}
    for t in (2, 3, 4):  # replica 1 is NaN: its steps are skipped, then its outer gradient
        assert lines[t]["skipped_replicas"] == [1], lines[t]
        assert np.isfinite(lines[t]["replica_losses"][0]) and lines[t]["replica_losses"][1] is None  # NaN: null
    assert lines[4]["skipped_sync_replicas"] == [1]
    for t in (1, 5, 6):  # before the NaN, and after the sync at step 4 replaced replica 1 by theta_g
        assert "skipped_replicas" not in lines[t] and "skipped_sync_replicas" not in lines[t]
        assert all(np.isfinite(lines[t]["replica_losses"]))
    for leaf in jax.tree.leaves(trainer.state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.isfinite(np.asarray(leaf)).all()


def test_nonfinite_stop_exits_1_naming_replica_and_step(tmp_path, capsys, monkeypatch):
    import eqx_diloco._programs as core_module  # where the trainer's core builds its inner step

    make = core_module.make_inner_step
    calls = []

    def make_poisoned(mesh, *args, **kwargs):
        real = make(mesh, *args, **kwargs)
        poison = jax.jit(lambda s: dataclasses.replace(
            s, params=jax.tree.map(lambda x: x.at[1].set(jnp.inf), s.params)))

        def inner_step(state, tokens):
            calls.append(None)
            return real(poison(state) if len(calls) == 3 else state, tokens)

        return inner_step

    monkeypatch.setattr(core_module, "make_inner_step", make_poisoned)
    code = main([*TINY, "--run-dir", str(tmp_path / "run"), "--train.steps", "6", "--checkpoint.every", "0"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("error: non-finite loss in replica 1 at step 3") and err.count("\n") == 1, err
    assert "--train.on-nonfinite" in err
