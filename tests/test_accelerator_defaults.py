"""What the `auto` choices resolve to on GPU and TPU, checked on CPU through their platform seams."""

import jax.numpy as jnp
import pytest

from models import TransformerConfig
from models._config import AUTO_UNROLL_MAX_LAYERS, compiling_for, target_platform


@pytest.mark.parametrize("layers", [2, 12, AUTO_UNROLL_MAX_LAYERS, AUTO_UNROLL_MAX_LAYERS + 1, 24, 48])
def test_auto_unroll_is_every_layer_on_gpu_and_tpu_and_the_depth_rule_on_cpu(layers):
    config = TransformerConfig(num_layers=layers)
    for platform in ("cuda", "rocm", "tpu"):
        assert config.layers_per_iteration(platform) == layers
    assert config.layers_per_iteration("cpu") == (layers if layers <= AUTO_UNROLL_MAX_LAYERS else 1)
    assert config.layers_per_iteration() == config.layers_per_iteration("cpu")  # this machine


def test_explicit_scan_unroll_is_kept_on_every_platform():
    for platform in ("cpu", "cuda", "tpu"):
        assert TransformerConfig(num_layers=24, scan_unroll=1).layers_per_iteration(platform) == 1
        assert TransformerConfig(num_layers=24, scan_unroll=4).layers_per_iteration(platform) == 4
        assert TransformerConfig(num_layers=24, scan_unroll=0).layers_per_iteration(platform) == 24


def test_compiling_for_resolves_auto_choices_as_on_that_platform():
    config = TransformerConfig(num_layers=24, dim=768, num_heads=12)
    assert target_platform() == "cpu"
    assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
        jnp.float32, "xla", 1)
    with compiling_for("cuda"):
        assert target_platform() == "cuda"
        assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
            jnp.bfloat16, "cudnn", 24)
    with compiling_for("tpu"):
        assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
            jnp.bfloat16, "xla", 24)
    assert target_platform() == "cpu"


# -- checkpoints by time -------------------------------------------------------------------------

import dataclasses  # noqa: E402
import json  # noqa: E402

from eqx_diloco.lm._checkpoint_schedule import ACCELERATOR_MINUTES, checkpoint_minutes  # noqa: E402
from eqx_diloco.lm.config import CheckpointConfig, Config, ConfigError, validate  # noqa: E402
from eqx_diloco.lm.trainer import Trainer  # noqa: E402


def test_checkpoints_go_by_time_on_gpu_and_tpu_by_steps_on_cpu_and_as_set():
    default = Config()
    assert checkpoint_minutes(default, "cpu") == 0
    assert checkpoint_minutes(default, "cuda") == checkpoint_minutes(default, "tpu") == ACCELERATOR_MINUTES
    for platform in ("cpu", "tpu"):
        assert checkpoint_minutes(Config(checkpoint=CheckpointConfig(every_minutes=2.5)), platform) == 2.5
        assert checkpoint_minutes(Config(checkpoint=CheckpointConfig(every_minutes=0)), platform) == 0
        assert checkpoint_minutes(Config(checkpoint=CheckpointConfig(every=0, every_minutes=3)), platform) == 0


@pytest.mark.parametrize("minutes", [-1.0, float("inf"), float("nan")])
def test_bad_checkpoint_minutes_are_refused(minutes):
    with pytest.raises(ConfigError, match="--checkpoint.every-minutes must be a finite number >= 0"):
        validate(Config(checkpoint=CheckpointConfig(every_minutes=minutes)))


def _saved_steps(tmp_path, name, every, minutes, capsys):
    from conftest import tiny_config

    config = tiny_config(tmp_path / name, train=dict(steps=6), checkpoint=dict(every=every, keep=10,
                                                                               every_minutes=minutes))
    trainer = Trainer(config, verbose=True)
    trainer.run()
    out = capsys.readouterr().out
    return sorted(int(p.name) for p in trainer.checkpointer.directory.iterdir() if p.name.isdigit()), out


def test_checkpoints_by_time_replace_the_step_schedule(tmp_path, capsys):
    steps, out = _saved_steps(tmp_path, "steps", 2, None, capsys)  # CPU: by steps
    assert steps == [2, 4, 6]
    assert "every 2 steps" in out
    steps, out = _saved_steps(tmp_path, "hours", 2, 1000.0, capsys)  # not a minute passes: only the end's
    assert steps == [6]
    assert "every 1000 minutes (--checkpoint.every-minutes)" in out
    # Every step is that long after the last save: saves at steps the step schedule (100) never reaches.
    # (The clock is read with each step's values, which a save's step has already consumed: every other step.)
    steps, _ = _saved_steps(tmp_path, "often", 100, 1e-9, capsys)
    assert steps == [2, 4, 6]


def test_the_banner_gives_the_size_of_a_checkpoint(make_config):
    trainer = Trainer(make_config(checkpoint=dict(every=5)), verbose=False)
    state_bytes = sum(x.size * x.dtype.itemsize for x in __import__("jax").tree.leaves(trainer.abstract_state))
    [line] = trainer.banner_lines()
    from eqx_diloco.lm._banner import format_bytes

    assert line.startswith(f"  checkpoint   {format_bytes(state_bytes)} each (the whole train state), every 5 steps")
    assert json.dumps(line)  # one line
