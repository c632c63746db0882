"""`python -m eqx_diloco.export` of a decoupled run: theta_g from the syncer's checkpoints, put into the
run's model the way the syncer cuts it into fragments (DL06: it looked for `RUN/checkpoints` and told
the user to train with `--checkpoint.every`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco.lm import Config
from eqx_diloco.lm.export import load_model, main as export_main, read_model_info
from eqx_diloco.lm.metrics import write_config

ROOT = Path(__file__).resolve().parents[1]
TD = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.batch-size", "4",
      "--train.seq-len", "16", "--data.source", "synthetic", "--train.eval-every", "0", "--diloco.sync-period", "4",
      "--train.log-every", "1"]


def test_a_decoupled_run_without_syncer_checkpoints_says_where_it_looked(tmp_path, capsys):
    syncer = tmp_path / "run" / "syncer"
    syncer.mkdir(parents=True)
    (syncer / "address.json").write_text('{"port": 1, "pid": 1, "restored": null}')
    write_config(syncer, Config(run_dir=tmp_path / "run"))
    assert export_main([str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"error: no syncer checkpoint in {syncer / 'checkpoints'} (the syncer saves one "
                                       f"after its merges)\n")


@pytest.mark.slow  # a decoupled run: a syncer and two islands through the launcher
def test_a_decoupled_run_exports_the_syncers_theta_g(tmp_path, capsys):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "2",
                           "--log-dir", str(tmp_path / "logs"), "--", *TD, "--train.steps", "16", "--run-dir", str(run)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "syncer" / "config.json").read_text())["decoupled"]["token"] is None  # never the secret

    assert export_main([str(run)]) == 0
    out = run / "model.eqx"
    versions = json.loads((run / "syncer" / "summary.json").read_text())["versions"]
    assert capsys.readouterr().out.startswith(f"exported the global model of {run} at step {sum(versions)} to {out}")
    assert read_model_info(out)["step"] == sum(versions)

    # The exported model is the one the syncer evaluated last: the same held-out loss.
    from eqx_diloco.lm._core import eval_loss
    from eqx_diloco.lm.data import TokenBatches, load_tokens
    from eqx_diloco.lm.resume import read_run_config

    config = read_run_config(run / "syncer")
    t = config.train
    batches = TokenBatches(load_tokens(config.data, config.model.vocab_size, t.seed), num_replicas=1,
                           batch_size=t.batch_size, seq_len=t.seq_len, eval_fraction=config.data.eval_fraction,
                           seed=t.seed, split=config.data.split)
    loss = float(eval_loss(load_model(out), jnp.asarray(batches.eval_batch(t.eval_sequences))))
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert abs(loss - last["eval_loss"]) < 1e-5, (loss, last)

    # The export names the folder that holds the run's config, and evaluate takes the run folder and the
    # export alike (the run's own held-out split, the same loss from both).
    from eqx_diloco.lm.evaluate import main as evaluate_main

    assert read_model_info(out)["run_dir"] == str((run / "syncer").absolute())
    losses = []
    for model in (run, out):
        assert evaluate_main([str(model), "--json", "--sequences", "4"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["held_out"]["loss"])
    assert losses[0] == losses[1], losses

    older = tmp_path / "older.eqx"
    assert export_main([str(run), str(older), "--step", str(sum(versions) - 1)]) == 0
    assert read_model_info(older)["step"] == sum(versions) - 1
    leaves = [jax.tree.leaves(eqx.filter(load_model(path), eqx.is_array)) for path in (older, out)]
    assert any(not np.array_equal(a, b) for a, b in zip(*leaves))  # one merge earlier
    capsys.readouterr()
    assert export_main([str(run), str(older), "--step", "99"]) == 2
    assert capsys.readouterr().err.startswith(f"error: no syncer checkpoint of step 99 in {run / 'syncer' / 'checkpoints'}")
