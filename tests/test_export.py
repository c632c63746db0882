"""Export of the global model, loading it as a plain `models.Transformer`, and sampling from it."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco.lm import Trainer
from eqx_diloco.lm.trainer import global_model
from eqx_diloco.lm.export import load_model, main as export_main, read_model_info
from eqx_diloco.lm.sample import decode, generate, main as sample_main
from models import Transformer
from models.transformer import lm_loss

pytestmark = pytest.mark.slow  # every test first trains a run through the trainer


@eqx.filter_jit
def eval_loss(model, tokens):
    return lm_loss(model, tokens)[1]["ce"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(trainer after 4 steps with its final checkpoint, path of the exported model)."""
    from conftest import tiny_config

    tmp = tmp_path_factory.mktemp("export")
    config = tiny_config(tmp / "run", train=dict(steps=4, seq_len=16),
                         checkpoint=dict(every=3))  # saves at 3 and at the last step
    trainer = Trainer(config, verbose=False)
    trainer.run()
    out = tmp / "export" / "model.eqx"
    assert export_main([str(config.run_dir), str(out)]) == 0
    return trainer, out


def test_exported_model_is_the_global_model(exported, capsys):
    trainer, out = exported
    model = load_model(out)
    assert isinstance(model, Transformer) and model.config == trainer.config.model
    expected = global_model(trainer.state)  # theta_g; replica 0 for ddp
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.asarray(trainer.eval_tokens)
    assert float(eval_loss(model, tokens)) == float(eval_loss(expected, trainer.eval_tokens))
    info = read_model_info(out)
    assert info["step"] == 4 and info["algorithm"] == "diloco" and info["seq_len"] == 16


def test_ddp_export_is_replica_0(make_config, tmp_path):
    config = make_config(algorithm="ddp", checkpoint=dict(every=5))
    trainer = Trainer(config, verbose=False)
    state, _ = trainer.initial_state()
    # Make the replicas differ, so that picking replica 0 is checked.
    shift = jax.jit(lambda s: dataclasses.replace(s, params=jax.tree.map(
        lambda x: x + jnp.arange(x.shape[0], dtype=x.dtype).reshape((-1,) + (1,) * (x.ndim - 1)), s.params)))
    state = shift(state)
    trainer.checkpointer.save(5, state, config)
    trainer.checkpointer.wait()
    config.run_dir.mkdir(parents=True, exist_ok=True)  # no config.json: the default checkpoint folder is used
    assert export_main([str(config.run_dir), str(tmp_path / "ddp.eqx")]) == 0
    model = load_model(tmp_path / "ddp.eqx")
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(global_model(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert read_model_info(tmp_path / "ddp.eqx")["algorithm"] == "ddp"


def test_export_of_an_older_step_and_bad_input(exported, tmp_path, capsys):
    trainer, _ = exported
    run = trainer.config.run_dir
    assert export_main([str(run / "checkpoints"), str(tmp_path / "m3"), "--step", "3"]) == 0
    assert read_model_info(tmp_path / "m3")["step"] == 3
    capsys.readouterr()
    assert export_main([str(run), str(tmp_path / "m"), "--step", "2"]) == 2
    assert "no checkpoint of step 2" in capsys.readouterr().err
    assert export_main([str(tmp_path / "nowhere"), str(tmp_path / "m")]) == 2
    assert "run folder does not exist" in capsys.readouterr().err


def test_sample_length_determinism_and_window(exported):
    trainer, out = exported
    model = load_model(out)
    prompt = np.frombuffer(b"def", np.uint8).astype(np.int32)
    # One compiled program serves every call below (the temperature and seed are traced).
    a = generate(model, prompt, 20, temperature=0.8, seed=0, context=6)
    assert a.shape == (20,) and a.dtype == np.int32 and ((0 <= a) & (a < 256)).all()
    np.testing.assert_array_equal(a, generate(model, prompt, 20, temperature=0.8, seed=0, context=6))
    assert not np.array_equal(a, generate(model, prompt, 20, temperature=0.8, seed=1, context=6))
    # Greedy with a window of 6 tokens equals a plain loop over the last (up to) 6 tokens.
    greedy = generate(model, prompt, 20, temperature=0.0, context=6)
    last_logits = eqx.filter_jit(lambda m, window: m(window)[-1])
    tokens = list(prompt)
    for _ in range(20):
        window = np.asarray(tokens[-6:], np.int32)
        tokens.append(int(np.argmax(np.asarray(last_logits(model, window)))))
    np.testing.assert_array_equal(greedy, tokens[len(prompt):])


def test_sample_command_prints_prompt_and_continuation(exported, capsys):
    trainer, out = exported
    args = [str(out), "--prompt", "def", "--max-new-tokens", "20", "--temperature", "0.8", "--seed", "0",
            "--context", "6"]
    assert sample_main(args) == 0
    text = capsys.readouterr().out
    expected = decode(generate(load_model(out), np.frombuffer(b"def", np.uint8), 20, seed=0, context=6), 256)
    assert text == "def" + expected + "\n"
    assert sample_main([str(out), "--prompt", ""]) == 2
    assert "--prompt must not be empty" in capsys.readouterr().err
